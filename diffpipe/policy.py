"""Reason codes and what happens to a file flagged with each.

Every problem validation finds carries one stable reason code (reports and
tests match on them). Each code has an action: ``error`` (the run stops
before any caching), ``skip`` (the file is left out of training and
reported) or ``warn`` (kept and reported). ``validation.actions`` in the
config overrides the defaults below, code by code.

This module imports nothing heavy: the config validates action overrides
against :data:`REASONS`.
"""

from __future__ import annotations

from typing import Literal

Action = Literal["error", "skip", "warn"]

#: Reason code -> (default action, what it means). Order is the table's in docs/validation.md.
REASONS: dict[str, tuple[Action, str]] = {
    # captions
    "missing_caption": ("skip", "No caption: no same-stem caption file and no metadata row."),
    "empty_caption": ("skip", "The caption is empty or only whitespace."),
    "caption_not_utf8": ("skip", "The caption file is not valid UTF-8 (the report names the byte offset)."),
    "caption_too_long": ("warn", "The caption has more tokens than a text encoder reads; the rest would be cut off."),
    "duplicate_caption": ("warn", "Another media file has the same caption."),
    "orphan_caption": ("warn", "A caption file with no media file of the same stem."),
    # media content
    "zero_byte": ("skip", "The media file is empty (0 bytes)."),
    "corrupt_media": ("skip", "The media file cannot be decoded: unreadable, truncated or corrupt."),
    "extension_mismatch": ("warn", "The content is another format than the extension says (decoded as what it is)."),
    "decompression_bomb": (
        "skip",
        "The header declares more pixels than `validation.max_pixels` (an image, a GIF's screen or any of "
        "its frames, a video frame); it is not decoded.",
    ),
    "large_media": (
        "warn",
        "The image (or a video frame) is over 16.8 megapixels (4096x4096): kept, but slow to cache.",
    ),
    "too_small": ("skip", "The image is below the smallest bucket (or below `validation.min_size`)."),
    "bad_aspect": ("skip", "The aspect ratio (width / height) is outside `validation.aspect_range`."),
    "no_frames": ("skip", "The video has no decodable frame."),
    "too_few_frames": ("skip", "The video has fewer decoded frames than `validation.min_frames`."),
    "duplicate_media": ("warn", "Another media file has the same content (SHA-256)."),
    # per-item auxiliary images (datasets[].mask_path / control_path and their columns)
    "missing_mask": ("warn", "No mask image for the item; it trains unmasked."),
    "corrupt_mask": ("skip", "The mask image cannot be decoded: unreadable, empty, truncated or not an image."),
    "mask_size_mismatch": ("skip", "The mask's aspect ratio differs from its media file's, so it would not line up."),
    "missing_control": ("skip", "No control image for the item."),
    "corrupt_control": ("skip", "The control image cannot be decoded: unreadable, empty, truncated or not an image."),
    "control_size_mismatch": (
        "skip",
        "The control image's aspect ratio differs from its media file's, so it would not line up.",
    ),
    # files and paths
    "unreadable": ("skip", "The file or folder cannot be read (permissions or I/O error)."),
    "broken_symlink": ("skip", "A symbolic link whose target does not exist."),
    "symlink_loop": ("skip", "A symbolic link that points to itself or to a folder above it."),
    "run_folder": (
        "skip",
        "A symbolic link into the run's `output_dir` or `cache.dir`: a run never reads its own outputs as data.",
    ),
    "bad_filename": ("skip", "The file name is not valid UTF-8 text or holds control characters."),
    "missing_file": ("skip", "A metadata row or `eval_files` entry names a file that does not exist."),
    "path_outside_root": ("error", "A metadata row names a path outside the dataset folder."),
    "bad_metadata": ("error", "The metadata file cannot be parsed or lacks its file or caption column."),
    # datasets
    "missing_dataset": ("error", "The dataset folder does not exist."),
    "no_media": ("error", "The dataset holds no media file."),
    "no_usable_items": (
        "error",
        "Every media file of the dataset is skipped (or held out for eval): nothing to train on.",
    ),
}


def default_actions() -> dict[str, Action]:
    return {code: action for code, (action, _) in REASONS.items()}


def resolve_actions(overrides: dict[str, Action] | None = None) -> dict[str, Action]:
    """Defaults with the config's overrides applied (unknown codes are a ValueError)."""
    actions = default_actions()
    for code, action in (overrides or {}).items():
        if code not in actions:
            raise ValueError(f"validation.actions: unknown reason code {code!r}; known: {', '.join(actions)}")
        actions[code] = action
    return actions


def status_of(reasons: list[str], actions: dict[str, Action]) -> str:
    """A row's status from its reasons: ``error`` > ``skipped`` > ``warning`` > ``ok``."""
    found = {actions[r] for r in reasons}
    if "error" in found:
        return "error"
    if "skip" in found:
        return "skipped"
    return "warning" if found else "ok"


def policy_markdown() -> str:
    """The table of reason codes and default actions in docs/validation.md (drift-tested)."""
    lines = ["| reason code | default action | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{code}` | `{action}` | {desc} |" for code, (action, desc) in REASONS.items()]
    return "\n".join(lines)
