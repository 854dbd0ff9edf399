"""``datasets[]``: where a dataset's media and captions are, how they are bucketed, augmented and split."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from diffpipe.config.base import (
    MAX_FRAMES,
    MAX_REPEATS,
    MAX_SIDE,
    AspectRatio,
    Bool,
    Float,
    HubId,
    Int,
    PathText,
    Section,
    Seed,
    Text,
)

#: The most control (reference) images an item may have (``datasets[].control_path`` as a list).
MAX_REFERENCES = 4
#: The aux roles of an item's control images, in order: ``control``, ``control2``, ...
CONTROL_ROLES = ["control"] + [f"control{k}" for k in range(2, MAX_REFERENCES + 1)]


class DatasetConfig(Section):
    name: Text = Field(..., description="Dataset name (used in item ids and reports).")
    path: PathText | None = Field(
        None,
        description="Folder of media with same-stem caption files or a metadata file; or a folder saved by the "
        "`datasets` library (`save_to_disk`), or of Parquet shards with media bytes (docs/validation.md, "
        "table datasets). Set `path` or `hub`.",
    )
    hub: HubId | None = Field(
        None,
        description="Hugging Face dataset id (`org/name`), resolved through the hub cache (`HF_HUB_OFFLINE=1`: "
        "the cache only) and read like `path`. Set `path` or `hub`.",
    )
    revision: Text | None = Field(
        None, description="With `hub`: branch, tag or commit of the dataset; null = `main`."
    )
    split: Text = Field(
        "train", description="Table datasets (`hub`, a saved `datasets` folder, Parquet shards): the split read."
    )
    image_column: Text | None = Field(
        None, description="Table datasets: the column of image bytes (`{bytes, path}` struct or binary); null: "
        "`image`, else the only such column."
    )
    video_column: Text | None = Field(
        None, description="Table datasets: the column of video bytes (an MP4 or WebM per row), instead of "
        "`image_column`."
    )
    caption_ext: Text = Field(".txt", description="Caption file extension.")
    resolution: Int = Field(
        64, description="Training resolution in pixels (bucket area = resolution²).", gt=0, le=MAX_SIDE
    )
    repeats: Int = Field(1, description="How many times each item appears per epoch.", ge=1, le=MAX_REPEATS)
    caption_variants: Int = Field(
        1,
        description="Cached variants of each caption (like diffusion-pipe's cache_shuffle_num): variant 0 is the "
        "caption itself, variants 1.. are augmented by `shuffle_tags` / `tag_dropout`, each a fixed function of "
        "(caption, `caption_seed`, variant) and cached content-addressed; training picks one per item per epoch, "
        "deterministically (resume stays exact), evaluation reads variant 0.",
        ge=1, le=64,
    )
    shuffle_tags: bool = Field(
        False, description="Caption variants shuffle the comma-separated tags after the first `keep_tags`."
    )
    keep_tags: Int = Field(
        0, description="Tags at the start of a caption that variants never move or drop (a trigger word, a "
        "class).", ge=0, le=1000,
    )
    tag_dropout: Float = Field(
        0.0, description="Caption variants drop each tag after the first `keep_tags` with this probability.",
        ge=0, lt=1,
    )
    caption_seed: Seed = Field(0, description="Seed of the caption variants' shuffles and drops.")
    role: Literal["train", "regularization"] = Field(
        "train",
        description="`regularization`: a prior-preservation set (class images, as DreamBooth trainers use): its "
        "items train with `loss_weight` and their loss is logged apart (`loss_reg` in metrics.jsonl and "
        "TensorBoard, beside `loss_train`).",
    )
    prior_target: Literal["data", "base"] = Field(
        "data",
        description="With role regularization, what its items train towards: `data` (their own latents, as "
        "DreamBooth's prior preservation does) or `base` (output preservation: the base model's own prediction "
        "on the same noisy input, the LoRA switched off, so the LoRA learns to leave these prompts as they "
        "were). `base` costs one more forward pass (without gradients) in each step that holds such items; "
        "LoRA training, one pipeline stage.",
    )
    loss_weight: Float = Field(
        1.0, description="Weight of this dataset's items in the training loss (each item's loss is multiplied "
        "by it; the step's loss is the batch mean).", ge=0, le=MAX_REPEATS,
    )
    caption_prefix: str = Field("", description="Text put before every caption (e.g. a trigger word).")
    weight: Float = Field(
        1.0,
        description="Relative sampling weight: items are drawn round(repeats x weight) times per epoch (at least once).",
        gt=0,
        le=MAX_REPEATS,
    )
    metadata: PathText | None = Field(
        None,
        description="Metadata file with a file and a caption column (.csv, .json, .jsonl, .parquet), relative "
        "to `path`; null: read every `metadata.jsonl|csv|json|parquet` in the dataset's folders (the Hugging "
        "Face `imagefolder` layout). File paths in it are relative to its folder.",
    )
    file_column: Text | None = Field(
        None, description="Metadata column holding file paths (relative to `path`); null: auto-detect "
        "(`file_name`, `file`, `filename`, `path`, `image`, `video`, ...)."
    )
    caption_column: Text | None = Field(
        None, description="Metadata (or table dataset) column holding the caption (text or list of alternatives); null: "
        "auto-detect (`caption`, `captions`, `text`, `prompt`, `tags`, ...)."
    )
    caption_lines: Literal["alternatives", "join"] = Field(
        "alternatives",
        description="Caption files with several lines: `alternatives` keeps each non-empty line as an "
        "alternative caption; `join` joins them with spaces into one.",
    )
    caption_style: Literal["text", "tags"] = Field(
        "text",
        description="`tags`: captions are comma-separated tags, normalised (trimmed, empty and repeated tags "
        "dropped, joined with `, `).",
    )
    eval_files: list[PathText] = Field(
        [], description="Media files (relative to `path`) held out for evaluation instead of training."
    )
    eval_fraction: Float = Field(
        0.0, description="Fraction of the items held out for evaluation, drawn by a hash of `eval_seed` and "
        "the file path (stable when files are added).", ge=0, lt=1,
    )
    eval_seed: Seed = Field(0, description="Seed of the `eval_fraction` draw.")
    resolutions: list[Annotated[Int, Field(gt=0, le=MAX_SIDE)]] | None = Field(
        None,
        description="Several training resolutions (each item is cached once per resolution); null = [`resolution`].",
        min_length=1,
    )
    aspect_ratios: list[AspectRatio] | None = Field(
        None, description="Explicit bucket aspect ratios (width / height); overrides `ar_buckets`.", min_length=1
    )
    ar_buckets: Int | None = Field(
        None,
        description="Number of log-spaced aspect ratios between `min_ar` and `max_ar`; null (and no "
        "`aspect_ratios`) = the classic nine from 1:2 to 2:1.",
        ge=1,
        le=1000,
    )
    min_ar: AspectRatio = Field(0.5, description="Smallest bucket aspect ratio (width / height) for `ar_buckets`.")
    max_ar: AspectRatio = Field(2.0, description="Largest bucket aspect ratio (width / height) for `ar_buckets`.")
    crop: Literal["center", "random"] = Field(
        "center", description="Crop to the bucket: `center`, or `random` (a fixed random offset per item, cached)."
    )
    flip: Bool = Field(False, description="Also train on a horizontally flipped copy of every item (cached once).")
    frame_buckets: list[Annotated[Int, Field(ge=1, le=MAX_FRAMES)]] | None = Field(
        None,
        description="Video: frame counts clips are cut to (each snapped to the model's frame rule, e.g. 4k+1); "
        "null = the longest valid count a clip holds.",
        min_length=1,
    )
    # -- which frames of a clip are trained on --
    clip_windows: Literal["first", "uniform", "multiple"] = Field(
        "first",
        description="Video: which frames of a clip make its window (the frame bucket's length): `first` = its "
        "first frames; `uniform` = one window spread over the whole clip at an even frame stride; `multiple` = "
        "non-overlapping windows spread over the clip, each a separate training item (at most `max_windows`).",
    )
    max_windows: Int | None = Field(
        None, description="Video, `clip_windows: multiple`: at most this many windows per clip; null = as many "
        "as fit.", ge=1, le=MAX_FRAMES,
    )
    mask_path: PathText | None = Field(
        None,
        description="Folder of loss masks: one image per item with the same relative stem as its media file "
        "(`img/a.png` -> `<mask_path>/img/a.<any image extension>`). White trains, black is ignored; an alpha "
        "channel, when not fully opaque, is the mask. Items without a mask train unmasked (`missing_mask`).",
    )
    mask_column: Text | None = Field(
        None,
        description="Metadata column naming each item's mask image (a path relative to the metadata file's "
        "folder, like the file column); empty cells train unmasked.",
    )
    control_path: PathText | list[PathText] | None = Field(
        None,
        description="Folder of control / reference images (edit pairs, image-to-video first frames), same stems "
        "as the media files. Each is resized and cropped like its target and cached as conditioning latents. "
        f"A list of up to {MAX_REFERENCES} folders gives each item several reference images, one from each "
        "folder in order (Qwen-Image-Edit `variant: 2509 | 2511`, flux2 / flux2-klein `variant: edit`); an item "
        "missing any of them is `missing_control`.",
    )
    control_column: Text | list[Text] | None = Field(
        None,
        description="Metadata column naming each item's control image (relative to the metadata file's folder); "
        "a list of columns: several reference images per item, as with a list of `control_path` folders.",
    )
    # -- image-to-video: the clip's own first frame as its control --------------------------
    control_from_first_frame: Bool = Field(
        False,
        description="Use each item's own first frame (of the clip window trained, at its bucket and crop; an "
        "image is its own first frame) as its control image when it has none from `control_path` / "
        "`control_column` (image-to-video training on plain clips). Changing it re-caches the items it affects.",
    )
    control_from_last_frame: Bool = Field(
        False,
        description="Append each item's own last frame (of the clip window trained, at its bucket and crop) to "
        "its control image: first-and-last-frame-to-video training (Wan `variant: 2.1-flf2v`). Applies to items "
        "that have a control (from `control_path` / `control_column` or `control_from_first_frame`); an image "
        "is its own last frame. Changing it re-caches the items it affects.",
    )

    @model_validator(mode="after")
    def _check_caption_variants(self) -> DatasetConfig:
        augments = self.shuffle_tags or self.tag_dropout > 0
        if augments and self.caption_variants < 2:
            raise ValueError(f"datasets[{self.name}]: shuffle_tags / tag_dropout change caption variants 1..; set "
                             "caption_variants to 2 or more (variant 0 is the caption itself)")
        if self.caption_variants > 1 and not augments:
            raise ValueError(f"datasets[{self.name}]: caption_variants {self.caption_variants} without shuffle_tags "
                             "or tag_dropout would all be the caption itself")
        return self

    @model_validator(mode="after")
    def _check_buckets(self) -> DatasetConfig:
        if self.min_ar > self.max_ar:
            raise ValueError(f"min_ar ({self.min_ar}) must not exceed max_ar ({self.max_ar})")
        return self

    @model_validator(mode="after")
    def _check_source(self) -> DatasetConfig:
        if (self.path is None) == (self.hub is None):
            raise ValueError("set path (a local folder) or hub (a Hugging Face dataset id), one of them")
        if self.revision and not self.hub:
            raise ValueError("revision applies to hub datasets only; set hub, or remove revision")
        if self.image_column and self.video_column:
            raise ValueError("set image_column or video_column, not both")
        return self

    @model_validator(mode="after")
    def _check_aux(self) -> DatasetConfig:
        for role in ("mask", "control"):
            if getattr(self, f"{role}_path") and getattr(self, f"{role}_column"):
                raise ValueError(f"set {role}_path or {role}_column, not both")
        for key in ("control_path", "control_column"):
            value = getattr(self, key)
            if isinstance(value, list) and not 1 <= len(value) <= MAX_REFERENCES:
                raise ValueError(f"datasets[{self.name}].{key}: give 1 to {MAX_REFERENCES} references, not {len(value)}")
            if isinstance(value, list) and len(set(value)) < len(value):
                raise ValueError(f"datasets[{self.name}].{key}: a reference is named twice: {value}")
        if self.references > 1 and (self.control_from_first_frame or self.control_from_last_frame):
            raise ValueError(f"datasets[{self.name}]: control_from_first_frame / control_from_last_frame make a "
                             "clip's own frames its control; they do not combine with several reference images")
        return self

    def _controls(self) -> list[str]:
        value = self.control_path or self.control_column
        return [] if value is None else value if isinstance(value, list) else [value]

    @property
    def references(self) -> int:
        """How many control (reference) images each item has: 0, 1, or the length of a list."""
        return len(self._controls())

    def aux_roles(self) -> list[str]:
        """Which per-item auxiliary images the dataset has: ``mask``, ``control``, ``control2``, ..."""
        mask = ["mask"] if self.mask_path or self.mask_column else []
        return mask + CONTROL_ROLES[: self.references]

    def aux_source(self, role: str) -> tuple[str | None, str | None, str]:
        """A role's ``(folder, metadata column, config key)``: one of the first two is None."""
        if role == "mask":
            return self.mask_path, self.mask_column, "mask_path" if self.mask_path else "mask_column"
        k = CONTROL_ROLES.index(role)
        controls = self._controls()
        value = controls[k] if k < len(controls) else None
        key = "control_path" if self.control_path else "control_column"
        if isinstance(self.control_path or self.control_column, list):
            key += f"[{k}]"
        return (value, None, key) if self.control_path else (None, value, key)

    def training_resolutions(self) -> list[int]:
        """The resolutions items are cached at (sorted, unique)."""
        return sorted(set(self.resolutions or [self.resolution]))
