"""Third-party log lines that mean nothing to a user, filtered where they are emitted.

Each filter names the one message it drops and why it is harmless; anything
else those libraries log is still shown. ``--verbose`` (env ``DIFFPIPE_VERBOSE=1``,
which the workflow's jobs inherit) keeps every line; ``--quiet`` (env
``DIFFPIPE_QUIET=1``) shows only their errors.
"""

from __future__ import annotations

import logging
import os
import re

#: logger name -> (pattern of the dropped message, why it is harmless).
HARMLESS = {
    "transformers.utils.import_utils": (
        re.compile(r"requires torchvision \(not installed\); falling back to `\w+Pil`"),
        # Image processors we never call for training (CLIP / SigLIP ones imported with their
        # pipelines); the PIL backend it falls back to is the one we would use anyway.
        "an image processor's PIL backend is used instead of torchvision's; diffpipe does not need torchvision",
    ),
    "diffusers.models.modeling_utils": (
        re.compile(r"that should be kept in float32: \[\]"),
        # Printed on every `.to(dtype)` even when the list of modules to keep in float32 is empty:
        # nothing is affected. A non-empty list is still shown.
        "no module is affected (the list is empty)",
    ),
    "diffusers.loaders.lora_base": (
        re.compile(r"No LoRA keys associated to \w+ found with the prefix='text_encoder(_\d)?'"),
        # load_lora_weights looks for text-encoder keys in every file; diffpipe trains the denoiser only,
        # so its files never hold any. A denoiser without keys is logged elsewhere and still shown.
        "diffpipe's LoRA files hold no text-encoder keys by design",
    ),
}


class _DropHarmless(logging.Filter):
    def __init__(self, pattern: re.Pattern[str]):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def configure(*, quiet: bool | None = None, verbose: bool | None = None) -> None:
    """Install the filters (unless verbose) and, when quiet, raise the libraries' log level to errors.

    The levels are also put in the environment so the workflow's jobs (child processes) follow them.
    """
    if quiet:
        os.environ["DIFFPIPE_QUIET"] = "1"
    if verbose:
        os.environ["DIFFPIPE_VERBOSE"] = "1"
    verbose = os.environ.get("DIFFPIPE_VERBOSE") == "1"
    quiet = os.environ.get("DIFFPIPE_QUIET") == "1" and not verbose
    for name, (pattern, _why) in HARMLESS.items():
        logger = logging.getLogger(name)
        for f in [f for f in logger.filters if isinstance(f, _DropHarmless)]:
            logger.removeFilter(f)
        if not verbose:
            logger.addFilter(_DropHarmless(pattern))
    if quiet:
        # Both libraries read these when they set up their loggers (possibly after this call).
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
        for name in ("transformers", "diffusers", "deepspeed", "torch"):
            logging.getLogger(name).setLevel(logging.ERROR)
