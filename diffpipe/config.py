"""The typed experiment config: one pydantic model per stage plus the root.

Every field carries a description: it feeds ``--help``, the JSON schema that
Snakemake validates with (``diffpipe schema``) and the config reference in ``docs/configuration.md``.
Unknown keys are errors that name the key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    StrictBool,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from diffpipe import config_paths, yamlload
from diffpipe.policy import resolve_actions


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and value."""


# -- value types: strict, finite, bounded --------------------------------------------------------------
# Lax pydantic reads `epochs: true` as 1, `shards: 2.5` as an error but `2.0` as 2, and `weight: .inf`
# as a weight; each ends in a traceback or a silent surprise later. These types refuse them up front.

#: A whole number: no bool (`true` is not 1), no float (not even `2.0`), no text.
Int = Annotated[int, Strict()]
#: A finite number (a whole number is fine): no bool, no text, no `.inf` or `.nan`.
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: `true` or `false`, not 1, 0 or "yes".
Bool = StrictBool
#: Text that must not be empty (names, columns, extensions).
Text = Annotated[str, StringConstraints(min_length=1)]
#: A file or folder: not empty, not only spaces, no NUL character.
PathText = Annotated[str, StringConstraints(pattern=r"^[^\x00]*[^\s\x00][^\x00]*$")]
#: The most control (reference) images an item may have (``datasets[].control_path`` as a list).
MAX_REFERENCES = 4
#: The aux roles of an item's control images, in order: ``control``, ``control2``, ...
CONTROL_ROLES = ["control"] + [f"control{k}" for k in range(2, MAX_REFERENCES + 1)]
#: A Hugging Face repo id: ``name`` or ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
HubId = Annotated[str, StringConstraints(pattern=r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$", max_length=96)]
#: A random seed (torch and NumPy both take it).
Seed = Annotated[int, Strict(), Field(ge=0, le=2**32 - 1)]
LoadDtype = Literal["auto", "float32", "bfloat16", "float16"]
#: A fraction strictly between 0 and 1: bounds in the schema (Snakemake); the model's validator checks them
#: with a message naming the range.
Quantile = Annotated[Float, Field(json_schema_extra={"exclusiveMinimum": 0, "exclusiveMaximum": 1})]
#: A width / height ratio.
AspectRatio = Annotated[Float, Field(ge=0.01, le=100)]

# Upper bounds: a larger value can only be a typo (`shards: 1e9`), and would cost hours or memory
# before failing, or never fail at all.
MAX_SIDE = 16_384  # pixels: image resolution, sample size
MAX_FRAMES = 10_000  # video frames
MAX_REPEATS = 10_000  # dataset repeats and weight
MAX_SHARDS = 10_000  # cache shards: one Snakemake job each
MAX_BATCH = 4_096  # batch size, gradient accumulation
MAX_WORKERS = 256  # processes per job
MAX_EPOCHS = 1_000_000
MAX_STEPS = 10**9


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    # family and flavor default to null in the schema: Snakemake's validation fills schema defaults into
    # the config, and a filled-in `tiny` or `sd` would hide that only a path was given (see below).
    family: Text | None = Field(
        None,
        description="Model family, a name from the family table in docs/families.md (`sd`, `sdxl`, `flux`, `wan`, ...; "
        "an unknown name is an error that lists them all). null: detected from the `model_index.json` "
        "(`_class_name`) of the model at `path`; `sd` without a path (or a local folder without that file). Given, it must match "
        "that file.",
    )
    flavor: Text | None = Field(
        None,
        description="`tiny`: small random-weight model built offline from `seed`; `local`: load the "
        "diffusers model at `path`. null: `local` when `path` is set, else `tiny`.",
    )
    path: PathText | None = Field(
        None,
        description="The diffusers model: a local folder, or a Hugging Face id (`org/name`, when no such local "
        "folder exists) resolved through the Hugging Face cache (downloaded once; `HF_HUB_OFFLINE=1` reads only "
        "the cache; `HF_TOKEN` or `huggingface-cli login` for gated models).",
    )
    revision: Text | None = Field(
        None,
        description="Hugging Face id only: branch, tag or commit of `path` (null: `main`). Cache keys follow the "
        "weights themselves, so a revision with other weights re-encodes and one with the same weights does not.",
    )
    weight_variant: Text | None = Field(
        None,
        description="Local flavor or Hugging Face id: load the weight files of this variant "
        "(`diffusion_pytorch_model.<variant>.safetensors`, `model.<variant>.safetensors`), e.g. `fp16` for a "
        "repository's half-size copies; null: the plain files. (`model.variant` names a family's model "
        "version, e.g. Wan's `2.2-5b`.)",
    )
    seed: Seed = Field(0, description="Seed of the tiny flavor's random weights.")
    single_files: dict[Text, PathText] = Field(
        {},
        description="Local flavor: single-file checkpoints (`.safetensors`, in the original checkpoint naming "
        "that ComfyUI and A1111 load, or in diffusers naming) that replace components of the folder at `path`, "
        "by subfolder: `{transformer: flux1-dev.safetensors}`, `{unet: sd15.safetensors, vae: vae.safetensors}`. "
        "The component's config still comes from `path/<subfolder>/config.json`; its weights may be absent there. "
        "The denoiser and the VAE can come from single files (Wan 2.2 A14B: also `transformer_2`). A value "
        "`org/name/file.safetensors` (when no such local file exists) is that file of a Hugging Face repository "
        "(its `main` revision), read through the Hugging Face cache.",
    )
    _origin: str | None = PrivateAttr(None)

    @property
    def origin(self) -> str | None:
        """``path`` as the config wrote it (a Hugging Face id stays an id after :func:`diffpipe.hub.resolved`)."""
        return self._origin or self.path

    @model_validator(mode="before")
    @classmethod
    def _default_flavor_and_family(cls, data: Any) -> Any:
        """A path alone means a diffusers model (flavor local) whose family its ``model_index.json`` names:
        parsing reads no file, the resolution step (``diffpipe.families.resolve_family``) reads it."""
        if not isinstance(data, dict):
            return data
        path = data.get("path") if isinstance(data.get("path"), str) else None
        data = {**data, "flavor": data.get("flavor") or ("local" if path else "tiny")}
        if path is None or data["flavor"] != "local":
            return {**data, "family": data.get("family") or "sd"}
        return data

    dtype: LoadDtype = Field(
        "auto",
        description="dtype the denoiser loads in (straight from the weight files, no float32 copy first): `auto` = "
        "bfloat16 on CUDA, float32 on CPU.",
    )
    text_encoder_dtype: LoadDtype = Field(
        "auto", description="dtype the text encoders load and encode in (cache jobs): `auto` = bfloat16 on CUDA, "
        "float32 on CPU. Part of the text cache key."
    )
    text_encoder_weights: Literal["auto", "fp8"] = Field(
        "auto", description="Storage of the text encoders' weights where they encode (cache jobs, samples): "
        "`auto` = `text_encoder_dtype`; `fp8` = float8_e4m3fn, cast to `text_encoder_dtype` layer by layer for "
        "each forward (diffusers' layerwise casting; norms, embeddings and the layers a model keeps in float32, "
        "such as T5's `wo`, keep `text_encoder_dtype`). T5-XXL about 5.9 GB instead of 9.5 in bf16, Gemma 3 12B "
        "about 13 GB instead of 24; the embeddings change slightly, so it "
        "is part of the text cache key. Not with `train.text_encoder` (a trained encoder keeps its dtype).",
    )
    vae_dtype: LoadDtype = Field(
        "auto",
        description="dtype the VAE loads and encodes in (cache jobs): `auto` = bfloat16 on CUDA, float32 on CPU and "
        "for the families whose VAE loses precision in 16 bits (sd, sdxl, wan). Part of the latent cache key.",
    )
    prediction_type: Literal["epsilon", "v_prediction"] | None = Field(
        None, description="UNet families: training target; null uses the scheduler's own setting."
    )
    zero_terminal_snr: Bool | None = Field(
        None,
        description="sd, sdxl: rescale the noise schedule so the last timestep has zero SNR (pure noise; Lin et "
        "al. 2024), for training and sampling alike (the scheduler's `rescale_betas_zero_snr`, sampled with "
        "`timestep_spacing: trailing`). Needs `prediction_type: v_prediction`. null = the scheduler's own setting.",
    )
    # -- versions within a family (Wan 2.1 / 2.2) --
    variant: Text | None = Field(
        None,
        description="Model version within the family. wan: `2.1` (T2V), `2.2-5b` (TI2V-5B used text-to-video: "
        "48-channel VAE), `2.2-a14b` (T2V-A14B: two experts), `2.1-i2v` (I2V-14B), `2.2-i2v-a14b` (I2V-A14B: two "
        "experts, first-frame condition latents). qwenimage-edit: `2509`, `2511` (Qwen-Image-Edit-Plus: several "
        "reference images per item; null = Qwen-Image-Edit). null: tiny flavor = the family's first; local "
        "flavor = read from the folder (a given value must match it).",
    )
    prefix_frames: Int | None = Field(
        None,
        description="skyreels-v2 `variant: df-v2v`: the frames at each clip's start that are given clean, as the "
        "video-to-video pipeline's `overlap_history` takes the end of its input clip (4k+1; 17 or 37 as the "
        "pipeline suggests; null = 17). Samples pass it as `overlap_history`.", ge=1, le=MAX_FRAMES,
    )
    first_frame_p: Float | None = Field(
        None, description="ltx2 `variant: i2v`: the probability that an item trains with its first frame given "
        "(image-to-video); the others train as text-to-video on the same clip, so one LoRA does both, as "
        "Lightricks' trainer's `first_frame_conditioning_p` (which it sets to 0.1). null = 1: every item.",
        gt=0, le=1,
    )
    expert: Literal["high", "low", "both"] | None = Field(
        None,
        description="Wan 2.2 A14B: the expert to train, only on its own timesteps: `high` (`transformer`, "
        "scheduler timesteps at or above `boundary_ratio` x 1000) or `low` (`transformer_2`, below; its "
        "LoRA loads with `load_lora_weights(..., load_into_transformer_2=True)`); `both`: a LoRA on each in "
        "one run, each sample sent to its timestep's expert (the low one exported with a `_low_noise` suffix).",
    )

    @field_validator("variant", mode="before", json_schema_input_type=str | int | float | None)
    @classmethod
    def _variant_as_text(cls, value: Any) -> Any:
        # YAML reads `variant: 2511` as a number and `variant: 2.1` as a float; both name a version.
        return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check_zero_terminal_snr(self) -> ModelConfig:
        if self.zero_terminal_snr and self.family is not None and self.family not in ("sd", "sdxl"):
            raise ValueError(
                f"model.zero_terminal_snr applies to the DDPM families sd and sdxl, not {self.family!r} (flow "
                "matching already ends at pure noise); remove it"
            )
        if self.zero_terminal_snr and self.prediction_type == "epsilon":
            raise ValueError(
                "model.zero_terminal_snr: true needs model.prediction_type: v_prediction (got epsilon; the noise "
                "is undefined to predict at zero SNR)"
            )
        return self

    @model_validator(mode="after")
    def _check_flavor(self) -> ModelConfig:
        if self.flavor not in ("tiny", "local"):
            raise ValueError(f"model.flavor must be 'tiny' or 'local', got {self.flavor!r}")
        if self.flavor == "local" and not self.path:
            raise ValueError("model.path is required when model.flavor is 'local'")
        if self.single_files and self.flavor != "local":
            raise ValueError(
                "model.single_files replaces components of a local model folder: set model.flavor: local and "
                "model.path (the folder with the components' configs)"
            )
        return self


class DatasetConfig(_Section):
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


class ValidationConfig(_Section):
    image_exts: list[Text] = Field(
        [".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"], description="File extensions treated as images."
    )
    min_size: Int = Field(16, description="Smallest accepted image side in pixels.", ge=1, le=MAX_SIDE)
    video_exts: list[Text] = Field(
        [".mp4", ".webm", ".mov", ".mkv", ".gif"],
        description="File extensions treated as videos (decoded with PyAV; frames and fps measured by decoding).",
    )
    min_frames: Int = Field(1, description="Fewest decoded frames a video must have.", ge=1, le=MAX_FRAMES)
    aspect_range: tuple[AspectRatio, AspectRatio] = Field(
        (0.25, 4.0), description="Accepted width / height ratios, [smallest, largest]."
    )
    max_pixels: Int = Field(
        178_956_970,
        description="Files whose header declares more pixels (an image, a GIF's screen or any of its frames, "
        "a video frame) are flagged `decompression_bomb` and never decoded, in validation and in the cache jobs "
        "(Pillow's own limit by default).",
        ge=1,
        le=2**40,
    )
    actions: dict[str, Literal["error", "skip", "warn"]] = Field(
        {}, description="Per reason code, override the default action (`error`, `skip` or `warn`); see the "
        "reason table in docs/validation.md."
    )

    @model_validator(mode="after")
    def _check(self) -> ValidationConfig:
        lo, hi = self.aspect_range
        if not 0 < lo <= hi:
            raise ValueError(f"validation.aspect_range must be [smallest, largest] > 0, got {[lo, hi]}")
        resolve_actions(self.actions)
        return self


class CacheConfig(_Section):
    shards: Int = Field(2, description="Number of cache shards (one Snakemake job each).", ge=1, le=MAX_SHARDS)
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Storage dtype of cached tensors.")
    batch_size: Int = Field(8, description="Encoder batch size in cache jobs.", ge=1, le=MAX_BATCH)
    dir: PathText | None = Field(
        None,
        description="Content-addressed store that cache jobs reuse entries from; share it across runs and "
        "datasets. null = `<output_dir>/cache/store`.",
    )
    workers: Int = Field(
        2, description="Decoding worker processes per latent cache job (0: decode inline).", ge=0, le=MAX_WORKERS
    )


LoraKind = Literal["lora", "dora", "lokr", "loha"]


class LoraConfig(_Section):
    kind: LoraKind = Field(
        "lora",
        description="Adapter type, trained through PEFT: `lora`; `dora` (LoRA plus a learned magnitude per "
        "output row); `lokr` (Kronecker product, LyCORIS LoKr); `loha` (Hadamard product of two rank-`rank` "
        "pairs, LyCORIS LoHa). Which tools read each: docs/formats.md.",
    )
    rank: Int = Field(8, description="LoRA rank (LoHa: of each pair; LoKr: of the factored matrices).", ge=1, le=4096)
    alpha: Float = Field(8.0, description="LoRA alpha; the update is scaled by alpha / rank.", gt=0)
    dropout: Float = Field(0.0, description="LoRA dropout (LoKr/LoHa: rank dropout).", ge=0, lt=1)
    lokr_factor: Int = Field(
        -1,
        description="LoKr only: each dimension is split as factor x (dim / factor) for the Kronecker product; "
        "-1: as square as possible.",
        ge=-1,
        le=65536,
    )
    lokr_decompose_both: bool = Field(
        False, description="LoKr only: factor the left Kronecker matrix into two rank-`rank` matrices too."
    )
    targets: list[Text] | None = Field(
        None, description="Module names to adapt (PEFT target_modules); null = the family's defaults.", min_length=1
    )
    blocks: list[Text] | None = Field(
        None,
        description="Only adapt targets inside modules whose path matches one of these regular expressions "
        "(e.g. `up_blocks\\.1`, `transformer_blocks\\.[0-3]\\.`); null = every block.",
        min_length=1,
    )
    init: Literal["gaussian", "kaiming"] = Field(
        "gaussian", description="Initialisation of the LoRA down matrix (the up matrix starts at zero)."
    )
    init_from: PathText | None = Field(
        None,
        description="Continue from an existing LoRA: a PEFT adapter folder, or a diffusers "
        "`pytorch_lora_weights.safetensors`; its rank must equal `rank`. With `text_encoder.encoders`, a "
        "folder's `text_encoder*/` LoRAs (as training and `import-lora` write them) continue too; encoders "
        "without one start fresh.",
    )

    @field_validator("blocks")
    @classmethod
    def _blocks_compile(cls, blocks: list[str] | None) -> list[str] | None:
        for b in blocks or []:
            try:
                re.compile(f"(?:{b})")
            except re.error as err:
                raise ValueError(f"{b!r} is not a regular expression: {err}") from None
        return blocks

    @model_validator(mode="after")
    def _lokr_options(self) -> LoraConfig:
        if self.kind != "lokr" and (self.lokr_factor != -1 or self.lokr_decompose_both):
            raise ValueError(f"lokr_factor / lokr_decompose_both apply to kind lokr, not {self.kind}")
        if self.lokr_factor == 0:
            raise ValueError("lokr_factor 0: use -1 (as square as possible) or a factor >= 1")
        return self


class EvalConfig(_Section):
    every_steps: Int = Field(
        0, description="Eval loss every N optimizer steps (0: only before and after training).", ge=0, le=MAX_STEPS
    )
    quantiles: list[Quantile] = Field(
        [0.1, 0.3, 0.5, 0.7, 0.9],
        description="Timestep quantiles the eval loss is measured at (empty: no eval).",
    )
    max_items: Int = Field(
        16, description="Eval items (the `eval` split, else a fixed subset of training items).", ge=1, le=100_000
    )
    seed: Seed = Field(0, description="Seed of the fixed eval noise.")

    @model_validator(mode="after")
    def _check_quantiles(self) -> EvalConfig:
        if any(not 0 < q < 1 for q in self.quantiles):
            raise ValueError(f"train.eval.quantiles must lie strictly between 0 and 1, got {self.quantiles}")
        return self


class EmaConfig(_Section):
    enabled: bool = Field(
        False,
        description="Keep an exponential moving average of the trained LoRA weights (float32, updated after "
        "optimizer steps, saved in every checkpoint so resume is exact). LoRA training, ZeRO 0-2, one pipeline "
        "stage.",
    )
    decay: Float = Field(
        0.999,
        description="The average's decay; at update t+1 the decay is min(decay, (1 + t) / (10 + t)) (diffusers' "
        "EMAModel), 0 at the first update, so the average starts at the weights.",
        gt=0, lt=1,
    )
    update_every: Int = Field(1, description="Fold the weights in every N optimizer steps.", ge=1, le=MAX_STEPS)
    output: Literal["ema", "raw"] = Field(
        "ema",
        description="Which weights become the run's adapter (`train/adapter/`, what `diffpipe export` and the "
        "sample stage read): `ema`, the raw weights going to `train/adapter_raw/`; or `raw`, the average going "
        "to `train/adapter_ema/`. Export the other with `diffpipe export <run>/train/adapter_raw` (or "
        "`adapter_ema`).",
    )
    samples: bool = Field(False, description="Render the in-training samples from the average.")


class ObjectiveConfig(_Section):
    loss: Literal["mse", "huber"] = Field(
        "mse", description="`mse`, or `huber`: pseudo-Huber, robust to outlier items (Khrapov et al. 2024)."
    )
    huber_c: Float = Field(0.1, description="Pseudo-Huber constant: quadratic below it, linear above.", gt=0)
    timestep_sampling: Literal["uniform", "logit_normal"] | None = Field(
        None, description="How training timesteps are drawn; null = the family's own (sd: uniform, flux: logit-normal)."
    )
    logit_mean: Float = Field(0.0, description="Logit-normal sampling: mean.")
    logit_std: Float = Field(1.0, description="Logit-normal sampling: standard deviation.", gt=0)
    shift: Float | None = Field(
        None, description="Flow families: fixed timestep shift; null = the model's (resolution-dependent) shift.", gt=0
    )
    min_timestep: Float = Field(0.0, description="Lowest training timestep, as a fraction of the schedule.", ge=0, le=1)
    max_timestep: Float = Field(1.0, description="Highest training timestep, as a fraction of the schedule.", ge=0, le=1)
    min_snr_gamma: Float | None = Field(
        None, description="UNet families: Min-SNR-gamma loss weighting (Hang et al. 2023; 5 is usual); null = off.", gt=0
    )
    offset_noise: Float = Field(
        0.0, description="UNet families: offset noise strength (a per-channel constant added to the noise; 0.05-0.1).",
        ge=0,
    )
    # -- the SD3 paper's timestep densities and loss weightings (sd3) --
    weighting_scheme: Literal["none", "sigma_sqrt", "logit_normal", "mode", "cosmap"] | None = Field(
        None,
        description="sd3: timestep density and loss weighting of the SD3 paper (Esser et al. 2024), as diffusers' "
        "SD3 training defines them: `logit_normal` (density from logit_mean / logit_std, unweighted), `mode` "
        "(mode density with `mode_scale`, unweighted), `sigma_sqrt` (uniform, weight sigma^-2), `cosmap` "
        "(uniform, CosMap weight), `none` (uniform, unweighted). null = the family's default (timestep_sampling, "
        "unweighted). Set it or timestep_sampling, not both.",
    )
    mode_scale: Float = Field(
        1.29,
        description="`weighting_scheme: mode`: the density's scale s (1.29 in the SD3 paper; -1 to 2/(pi-2) "
        "keeps the mapping monotonic).",
        ge=-1,
        le=2 / (math.pi - 2),
    )
    mask_min_weight: Float = Field(
        0.0,
        description="Items with a loss mask (`datasets[].mask_path`): the loss weight where the mask is black; "
        "the weight is `mask_min_weight + (1 - mask_min_weight) x mask`, so 0 ignores masked-out areas.",
        ge=0,
        le=1,
    )

    @model_validator(mode="after")
    def _check_weighting(self) -> ObjectiveConfig:
        if self.weighting_scheme is not None and self.timestep_sampling is not None:
            raise ValueError(
                f"set weighting_scheme ({self.weighting_scheme!r}) or timestep_sampling "
                f"({self.timestep_sampling!r}), not both: the weighting scheme picks the timestep density too"
            )
        return self

    @model_validator(mode="after")
    def _check_range(self) -> ObjectiveConfig:
        if self.min_timestep >= self.max_timestep:
            raise ValueError(f"min_timestep ({self.min_timestep}) must be below max_timestep ({self.max_timestep})")
        return self


class ProfileConfig(_Section):
    skip: Int = Field(
        2, description="Optimizer steps trained before the profiler records (the first steps are slower: "
        "allocation, compilation).", ge=0, le=MAX_STEPS,
    )
    steps: Int = Field(0, description="Optimizer steps the profiler records (0: no profiling).", ge=0, le=1_000)


class TextEncoderTrainConfig(_Section):
    encoders: list[Text] = Field(
        [],
        description="Text encoders to train a LoRA on beside the denoiser's, by pipeline name (`text_encoder`; "
        "SDXL also `text_encoder_2`); empty: none (every embedding is cached). A trained encoder's captions are "
        "cached as token ids and encoded at every step; the others stay cached. Families `sd`, `sdxl` and "
        "`flux` (its CLIP-L; T5 stays cached); train.mode lora (kind lora), zero_stage 0-2, one pipeline stage.",
    )
    lr: Float | None = Field(None, description="Their learning rate; null: train.lr.", gt=0)
    rank: Int | None = Field(None, description="Their LoRA rank; null: train.lora.rank.", ge=1, le=4096)
    alpha: Float | None = Field(None, description="Their LoRA alpha; null: train.lora.alpha.", gt=0)
    targets: list[Text] = Field(
        ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
        description="Module names to adapt in each encoder (CLIP's attention and MLP, as kohya's LoRA does).",
        min_length=1,
    )

    @field_validator("encoders")
    @classmethod
    def _unique_encoders(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"names an encoder twice: {value}")
        return value


class TrainConfig(_Section):
    epochs: Int = Field(10, description="Passes over the training data.", ge=1, le=MAX_EPOCHS)
    max_steps: Int | None = Field(
        None, description="Stop after this many optimizer steps (overrides epochs).", ge=1, le=MAX_STEPS
    )
    batch_size: Int = Field(4, description="Micro-batch size per process.", ge=1, le=MAX_BATCH)
    grad_accum: Int = Field(1, description="Gradient accumulation steps.", ge=1, le=MAX_BATCH)
    lr: Float = Field(1e-3, description="Peak learning rate.", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: Int = Field(0, description="Linear warmup steps.", ge=0, le=MAX_STEPS)
    weight_decay: Float = Field(0.0, description="Weight decay (decoupled for the AdamW variants).", ge=0)
    optimizer: Text = Field(
        "adamw",
        description="`adamw`, `adamw_kahan` / `adamw_stochastic` (precision bf16, zero_stage 1-3: the trained "
        "weights are kept in bf16 with no fp32 master copy, saving 4 bytes per trained parameter; Kahan "
        "summation or stochastic rounding keeps small updates), `adafactor`, or any `torch.optim` class name "
        "(e.g. `SGD`, `RAdam`).",
    )
    optimizer_args: dict[Text, Any] = Field(
        {}, description="Extra keyword arguments for the optimizer (e.g. `{betas: [0.9, 0.99]}`)."
    )
    grad_clip: Float = Field(1.0, description="Gradient norm clip (0 disables).", ge=0)
    caption_dropout: Float = Field(
        0.0,
        description="Probability of training an item on the empty caption (the cached empty-caption "
        "embedding), which keeps classifier-free guidance working.",
        ge=0,
        lt=1,
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Training precision: `auto` (bf16 on CUDA, fp32 on CPU), fp32, bf16 (CPU and GPU; DeepSpeed keeps "
        "float32 master copies of the trained weights), fp16 (GPU only, dynamic loss scaling).",
    )
    base_weights: Literal["auto", "fp8", "int8", "nf4"] = Field(
        "auto",
        description="Storage of the frozen denoiser weights during LoRA training: `auto` = the training precision; "
        "`fp8` = float8_e4m3fn, cast to the training precision layer by layer for each forward (diffusers' "
        "layerwise casting; norms, embeddings and the LoRA stay in 16/32 bits). Half the weight memory of bf16. "
        "`int8` = torchao's int8 weight-only quantisation of the frozen Linear weights (a scale per output "
        "channel, dequantised in each matmul; the same layers kept as fp8 keeps), on CPU and GPU. `nf4` = QLoRA's "
        "4-bit NormalFloat of the same layers (torchao's NF4Tensor: an absmax scale per 64 weights, those scales "
        "in int8; dequantised in each matmul), about a quarter of bf16's weight memory, on CPU and GPU.",
    )
    attention_backend: Text = Field(
        "native",
        description="diffusers attention backend for the denoiser: `native` (torch SDPA), `flash`, `sage`, "
        "`xformers`, `_native_cudnn`, ... (a name from diffusers' AttentionBackendName). All but `native`, "
        "`_native_math` and `flex` need CUDA and, for some, their package.",
    )
    compile: Bool = Field(
        False,
        description="Regional compilation: torch.compile each repeated block of the denoiser (diffusers' "
        "`compile_repeated_blocks`) rather than the whole model; the first steps are slower.",
    )
    activation_checkpointing: Bool = Field(
        False, description="Recompute block activations in the backward pass: less memory, about 30% more compute."
    )
    checkpoint_fraction: Float = Field(
        1.0, description="With activation_checkpointing: the share of the denoiser's blocks checkpointed, the first "
        "ones in forward order (e.g. 0.5); the others keep their activations: faster, more memory. 1: every block. "
        "Single-process and data-parallel training (pipeline stages checkpoint every layer).", gt=0, le=1,
    )
    activation_offload: Bool = Field(
        False,
        description="Keep the activations the backward pass needs in CPU memory (pinned on CUDA) rather than on "
        "the GPU, each copied back when the backward pass reaches it. With activation_checkpointing these are "
        "the blocks' inputs (each comes back for its block's recomputation), so the GPU holds one block's "
        "activations at a time; without it, every saved tensor. Costs their size in system RAM and two "
        "host-device copies of each per step; the losses are the same. One pipeline stage.",
    )
    block_swap: Int = Field(
        0,
        description="Block swap for one GPU: the frozen weights of the denoiser's last N repeated blocks stay in "
        "CPU memory and each block is copied to the GPU for its forward and for its recomputation in the backward "
        "pass (0: off; more than the block count: every block). Costs their size in (pinned) system RAM and one "
        "transfer per block per forward and per recomputation. Needs activation_checkpointing, LoRA, ZeRO 0-2, "
        "one pipeline stage.",
        ge=0,
        le=100_000,
    )
    zero_stage: Int = Field(0, description="DeepSpeed ZeRO stage.", ge=0, le=3)
    count_flops: Bool = Field(
        True, description="Log model FLOPs per step, TFLOPS per device and MFU (`metrics.jsonl`, TensorBoard): "
        "counted with torch's FLOP formulas on the first step of each batch shape, then reused.",
    )
    peak_tflops: Float | None = Field(
        None, description="The device's dense peak TFLOPS at the training precision, for MFU; null = from the "
        "table of known GPUs in diffpipe/training/flops.py (no MFU on an unknown device or on CPU).", gt=0,
    )
    profile: ProfileConfig = Field(
        default_factory=ProfileConfig, description="Profile a window of steps, e.g. `{skip: 2, steps: 3}`: a "
        "torch profiler trace (TensorBoard plugin format) and a per-operator summary under `train/profile`.",
    )
    pipeline_stages: Int = Field(
        1,
        description="Pipeline parallel: split the denoiser's layers over this many processes (the process count "
        "must be a multiple: data parallel across the rest). ZeRO 0 or 1, LoRA only.",
        ge=1,
        le=1024,
    )
    pipeline_split: list[Annotated[Int, Field(ge=1, le=1_000_000)]] | None = Field(
        None,
        description="Manual pipeline split: the first layer index of each stage after the first; null = balance "
        "the parameter count, frozen weights included.",
    )
    offload_optimizer: Bool = Field(False, description="ZeRO 1-3: keep optimizer states in CPU memory.")
    offload_params: Bool = Field(False, description="ZeRO 3: keep parameters in CPU memory.")
    seed: Seed = Field(42, description="Seed for noise, timesteps and data order.")
    save_every_epochs: Int = Field(1, description="Save a LoRA every N epochs (0: only at the end).", ge=0, le=MAX_EPOCHS)
    checkpoint_every_steps: Int = Field(
        0, description="Full checkpoint every N steps (0: only at the end).", ge=0, le=MAX_STEPS
    )
    checkpoint_every_minutes: Float = Field(
        0, description="Also a full checkpoint every N minutes of training (0: off).", ge=0
    )
    keep_checkpoints: Int = Field(3, description="Keep only the newest K full checkpoints (0: keep all).", ge=0, le=10_000)
    max_nonfinite_steps: Int = Field(
        5, description="Optimizer steps whose loss or gradients are not finite (NaN, inf) are skipped with a "
        "warning; this many in a row stop the run with an error (exit 1). Weights that are not finite are never "
        "saved.", ge=1, le=MAX_STEPS,
    )
    mode: Literal["lora", "full"] = Field(
        "lora",
        description="`lora`: train a LoRA on the frozen denoiser; `full`: fine-tune every denoiser weight "
        "(written to `train/denoiser/` as a diffusers model; no LoRA, no per-epoch saves).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings.")
    text_encoder: TextEncoderTrainConfig = Field(
        default_factory=TextEncoderTrainConfig, description="LoRA on the text encoders too (SD 1.x/2.x, SDXL, Flux's CLIP-L)."
    )
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig, description="Timestep sampling, loss and loss weighting."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Eval loss at fixed timesteps and noise.")
    ema: EmaConfig = Field(default_factory=EmaConfig, description="Exponential moving average of the weights.")
    sample_every_steps: Int = Field(
        0, description="Render the `sample` prompts from the in-training weights every N steps (0: off).", ge=0,
        le=MAX_STEPS,
    )
    sample_every_epochs: Int = Field(
        0, description="Render the `sample` prompts every N epochs (0: off); PNGs under `train/samples/`.", ge=0,
        le=MAX_EPOCHS,
    )
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"],
        description="Where rank 0 logs the numeric fields of each `metrics.jsonl` row (as `train/<field>`, "
        "`eval/<name>`), the in-training sample grids and the resolved config: `tensorboard` "
        "(`train/tensorboard/`), `wandb` (`train/wandb/`; `WANDB_MODE=offline` needs no account), `mlflow` (file "
        "store `train/mlruns/`, or the server `MLFLOW_TRACKING_URI` names). wandb and mlflow are optional "
        "packages: `pip install 'diffpipe[trackers]'`; a missing one stops `diffpipe train` and `diffpipe run` "
        "before any work, naming it. Empty: `metrics.jsonl` only.",
        max_length=3,
    )
    tracker_project: Text = Field(
        "diffpipe", description="W&B project and MLflow experiment the run logs to (TensorBoard ignores it)."
    )
    run_name: Text | None = Field(
        None, description="Name of the run in W&B and MLflow; null: the name of `output_dir`'s folder."
    )

    @field_validator("trackers")
    @classmethod
    def _unique_trackers(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"train.trackers names a tracker twice: {value}")
        return value

    @model_validator(mode="after")
    def _check_base_weights(self) -> TrainConfig:
        if self.base_weights != "auto" and self.mode == "full":
            raise ValueError(f"train.base_weights: {self.base_weights} stores frozen weights in 8 or 4 bits; "
                             "train.mode full trains every weight: use train.mode lora or base_weights auto")
        if self.base_weights != "auto" and self.pipeline_stages > 1:
            raise ValueError(f"train.base_weights: {self.base_weights} needs train.pipeline_stages: 1")
        if self.base_weights in ("int8", "nf4") and (self.block_swap or self.zero_stage == 3):
            # Both move or partition the frozen weights; torchao's tensors through them are untested.
            raise ValueError(f"train.base_weights: {self.base_weights} does not combine with block_swap or "
                             "zero_stage 3 yet; use base_weights fp8 with them")
        return self

    @model_validator(mode="after")
    def _check_ema(self) -> TrainConfig:
        if self.ema.enabled and (self.mode != "lora" or self.zero_stage == 3 or self.pipeline_stages > 1):
            raise ValueError("train.ema needs train.mode lora, train.zero_stage 0-2 and train.pipeline_stages: 1 "
                             "(the average is kept beside whole LoRA weights on every process)")
        return self

    @model_validator(mode="after")
    def _check_text_encoder(self) -> TrainConfig:
        if not self.text_encoder.encoders:
            return self
        if self.mode != "lora" or self.lora.kind != "lora":
            raise ValueError("train.text_encoder needs train.mode lora with train.lora.kind lora (the stock "
                             "pipelines load a text encoder's LoRA, not its DoRA, LoKr or LoHa)")
        if self.zero_stage == 3 or self.pipeline_stages > 1:
            raise ValueError("train.text_encoder needs train.zero_stage 0-2 and train.pipeline_stages: 1")
        return self

    @model_validator(mode="after")
    def _check_block_swap(self) -> TrainConfig:
        if not self.block_swap:
            return self
        if not self.activation_checkpointing:
            raise ValueError("train.block_swap needs train.activation_checkpointing: true (without recomputation "
                             "autograd keeps every block's weights on the GPU until the backward pass)")
        if self.mode != "lora":
            raise ValueError("train.block_swap moves frozen weights: it needs train.mode lora")
        if self.zero_stage == 3:
            raise ValueError("train.block_swap works with train.zero_stage 0-2 (ZeRO-3 partitions the weights; "
                             "use train.offload_params there)")
        if self.pipeline_stages > 1:
            raise ValueError("train.block_swap needs train.pipeline_stages: 1")
        return self

    @model_validator(mode="after")
    def _check_activation_offload(self) -> TrainConfig:
        if self.activation_offload and self.pipeline_stages > 1:
            raise ValueError("train.activation_offload needs train.pipeline_stages: 1 (DeepSpeed's pipeline engine "
                             "runs the forward and backward passes itself)")
        return self

    @model_validator(mode="after")
    def _check_pipeline(self) -> TrainConfig:
        if self.pipeline_stages > 1:
            if self.zero_stage > 1:
                raise ValueError("train.pipeline_stages > 1 works with train.zero_stage 0 or 1")
            if self.mode != "lora" or self.sample_every_steps or self.sample_every_epochs:
                raise ValueError("train.pipeline_stages > 1 needs train.mode lora and no sampling during training")
        return self

    @model_validator(mode="after")
    def _check_sampling(self) -> TrainConfig:
        if (self.sample_every_steps or self.sample_every_epochs) and self.zero_stage == 3:
            raise ValueError("sampling during training (train.sample_every_*) needs train.zero_stage below 3")
        return self

    @model_validator(mode="after")
    def _check_checkpoint_fraction(self) -> TrainConfig:
        if self.checkpoint_fraction < 1 and self.pipeline_stages > 1:
            raise ValueError("train.checkpoint_fraction below 1 needs train.pipeline_stages: 1 (pipeline stages "
                             "checkpoint every layer)")
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> TrainConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("train.offload_params needs train.zero_stage 3")
        if self.optimizer in BF16_OPTIMIZERS and (self.zero_stage == 0 or self.offload_optimizer):
            raise ValueError(f"train.optimizer {self.optimizer}: the weights stay in bf16 without fp32 master "
                             "copies, which DeepSpeed supports with train.zero_stage 1, 2 or 3 and no "
                             "offload_optimizer; set zero_stage: 1")
        return self


#: Optimizers that step bf16 weights themselves (diffpipe.training.optim.AdamWBF16).
BF16_OPTIMIZERS = ("adamw_kahan", "adamw_stochastic")

ExportFormat = Literal["diffusers", "peft", "comfyui", "kohya", "merged"]


class ExportConfig(_Section):
    formats: list[ExportFormat] = Field(
        ["diffusers"],
        description="Export formats to write: `diffusers`, `peft`, `comfyui`, `kohya`, `merged` (the workflow "
        "always adds the one samples read: `diffusers`, or `peft` for LoKr/LoHa, whose default is `[peft]`).",
        min_length=1,
    )


class SampleConfig(_Section):
    prompts: list[str] = Field(
        ["a red circle"], description="Prompts rendered with the trained LoRA.", min_length=1, max_length=10_000
    )
    steps: Int = Field(10, description="Inference steps.", ge=1, le=10_000)
    guidance_scale: Float = Field(5.0, description="Classifier-free guidance scale.", ge=0)
    seed: Seed = Field(0, description="Seed of the sampling noise.")
    width: Int = Field(64, description="Sample width in pixels.", gt=0, le=MAX_SIDE)
    height: Int = Field(64, description="Sample height in pixels.", gt=0, le=MAX_SIDE)
    frames: Int = Field(
        5, description="Frames per sample clip for video families (snapped to the model's frame rule); "
        "image families ignore it.", ge=1, le=MAX_FRAMES,
    )
    images: list[PathText | list[PathText]] | None = Field(
        None, description="One conditioning image per prompt (file paths), for image-conditioned models "
        "(Wan 2.1 I2V: the first frame of each sample clip); a list of paths for a prompt's several reference "
        "images (Qwen-Image-Edit `variant: 2509 | 2511`); null: text only.",
    )
    videos: list[PathText] | None = Field(
        None, description="One input clip per prompt (file paths), for video-to-video models (SkyReels V2 "
        "`variant: df-v2v`: each sample continues its clip's last `model.prefix_frames` frames); null: none.",
    )
    last_images: list[PathText] | None = Field(
        None, description="One last frame per prompt (file paths), for first-and-last-frame models (Wan "
        "`variant: 2.1-flf2v`, with `images` as the first frames); null: none.",
    )
    offload: Literal["auto", "none", "group"] = Field(
        "auto", description="Where samples keep the pipeline's weights on a GPU machine: `none` = all on the "
        "GPU; `group` = in CPU memory, each block brought to the GPU for its forward (diffusers' group "
        "offloading: slower, fits a pipeline larger than the card, such as Wan 2.2 A14B's or Ideogram 4's two "
        "transformers); `auto` = `none` when the weights take under 80% of the free GPU memory, else `group`. "
        "`diffpipe sample` places every component; the in-training sampler (`train.sample_every_*`) the "
        "frozen ones (text encoders, VAE), beside the training model. Without a GPU the pipeline runs on the "
        "CPU (`group` still applies its hooks there).",
    )

    @model_validator(mode="after")
    def _one_image_per_prompt(self) -> SampleConfig:
        for key in ("images", "last_images", "videos"):
            paths = getattr(self, key)
            if paths is not None and len(paths) != len(self.prompts):
                raise ValueError(
                    f"sample.{key} has {len(paths)} path(s) for {len(self.prompts)} prompt(s); give one per prompt"
                )
        if self.last_images is not None and self.images is None:
            raise ValueError("sample.last_images needs sample.images: a clip's first frames beside its last ones")
        return self


#: Grid axes of ``diffpipe bench`` and the config key each one sets (``data`` axes shape the synthetic batches).
BENCH_AXES: dict[str, str] = {
    "batch_size": "train.batch_size",
    "precision": "train.precision",
    "base_weights": "train.base_weights",
    "activation_checkpointing": "train.activation_checkpointing",
    "compile": "train.compile",
    "attention_backend": "train.attention_backend",
    "zero_stage": "train.zero_stage",
    "resolution": "data.resolution",
    "frames": "data.frames",
}
GridValue = Annotated[bool, Strict()] | Annotated[int, Strict()] | Float | Text


class BenchConfig(_Section):
    grid: dict[Text, Annotated[list[GridValue], Field(min_length=1, max_length=1_000)]] = Field(
        {}, description="Axes of the sweep, each a list of values; every combination is one point. Axes: "
        + ", ".join(f"`{a}`" for a in BENCH_AXES) + ", or any `train.` key (e.g. `train.grad_accum`). "
        "`diffpipe bench --grid KEY=V1,V2` adds or replaces an axis.",
    )
    warmup_steps: Int = Field(2, description="Steps each point trains before measuring (not counted).", ge=0,
                              le=10_000)
    steps: Int = Field(5, description="Measured steps per point.", ge=1, le=100_000)
    data: Literal["synthetic", "cache"] = Field(
        "synthetic", description="What points train on: `synthetic` = random latents (and one encoded caption) "
        "of a square bucket at each resolution, no cache needed; `cache` = the run's caches.",
    )
    memory_limit_mb: Int | None = Field(
        None, description="Cap on each point's address space (RLIMIT_AS) in MiB, so a CPU point that needs more "
        "fails as `oom` instead of swapping; null = no cap. On a GPU the device's memory is the cap.", ge=64,
        le=1 << 30,
    )
    timeout_minutes: Float = Field(30.0, description="A point running longer is stopped and recorded as "
                                   "`timeout`.", gt=0)
    convergence_precisions: list[Literal["fp32", "bf16", "fp16", "fp8"]] = Field(
        ["fp32", "bf16", "fp8"], description="`diffpipe bench --convergence`: the precisions compared (`fp8` = "
        "fp8 base weights, computing in bf16).", min_length=1,
    )
    convergence_steps: Int = Field(50, description="`diffpipe bench --convergence`: steps per precision.", ge=1,
                                   le=1_000_000)

    @field_validator("grid")
    @classmethod
    def _known_axes(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key in grid:
            if key not in BENCH_AXES and not key.startswith("train."):
                raise ValueError(f"unknown axis {key!r}; axes: {', '.join(BENCH_AXES)} or a `train.` key")
        return grid


class Config(_Section):
    output_dir: PathText = Field("runs/demo", description="Folder that receives every output of the run.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Which model to fine-tune.")
    datasets: list[DatasetConfig] = Field(..., description="Training datasets.", min_length=1)
    validation: ValidationConfig = Field(default_factory=ValidationConfig, description="Dataset checks.")
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Latent and text-embedding caches.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Training.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="LoRA export.")
    sample: SampleConfig = Field(default_factory=SampleConfig, description="Sample images.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="`diffpipe bench`: speed and memory sweeps.")

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> Config:
        names = [d.name for d in self.datasets]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"datasets: duplicate name(s) {dupes}")
        return self

    @model_validator(mode="after")
    def _same_references(self) -> Config:
        # Each bucket's control latents are one array, so every item has the same number of references.
        counts = {d.name: d.references for d in self.datasets if d.references}
        if len(set(counts.values())) > 1:
            raise ValueError(f"datasets: every dataset with control images needs the same number of references; "
                             f"they have {counts}")
        return self

    @model_validator(mode="after")
    def _base_targets(self) -> Config:
        for i, d in enumerate(self.datasets):
            if d.prior_target == "base" and d.role != "regularization":
                raise ValueError(f"datasets[{i}].prior_target base needs datasets[{i}].role: regularization")
            if d.prior_target == "base" and (self.train.mode != "lora" or self.train.pipeline_stages > 1):
                raise ValueError(f"datasets[{i}].prior_target base (the base model's prediction: the LoRA "
                                 "switched off) needs train.mode lora and train.pipeline_stages: 1")
            if d.prior_target == "base" and self.train.text_encoder.encoders:
                # Its prediction would see the trained encoders' embeddings, not the base model's.
                raise ValueError(f"datasets[{i}].prior_target base needs train.text_encoder.encoders empty (the "
                                 "base prediction is taken on the text the trained encoders give); use "
                                 "prior_target: data")
        return self

    @model_validator(mode="after")
    def _trained_text_keeps_its_dtype(self) -> Config:
        if self.model.text_encoder_weights == "fp8" and self.train.text_encoder.encoders:
            raise ValueError(f"model.text_encoder_weights fp8 stores the text encoders in float8, and "
                             f"train.text_encoder.encoders {self.train.text_encoder.encoders} trains them: use "
                             "text_encoder_weights auto to train a text encoder")
        return self

    @model_validator(mode="after")
    def _export_holds_the_lora_kind(self) -> Config:
        """A format that cannot hold ``train.lora.kind`` is a config error, before training
        (``diffpipe.export.api`` says why per format); LoKr/LoHa default to the peft export."""
        kind, formats = self.train.lora.kind, self.export.formats
        cannot = {"lokr": {"diffusers"}, "loha": {"diffusers"}, "dora": {"comfyui", "kohya"}}.get(kind, set())
        if kind in ("lokr", "loha") and "formats" not in self.export.model_fields_set:
            object.__setattr__(self.export, "formats", ["peft"])
        elif bad := sorted(cannot & set(formats)):
            raise ValueError(f"export.formats {bad}: cannot hold a train.lora.kind {kind} adapter exactly "
                             "(docs/formats.md, LoRA variants); drop them")
        return self

    @model_validator(mode="after")
    def _separate_folders(self, info: ValidationInfo) -> Config:
        """output_dir, cache.dir and the dataset folders must not overlap (see diffpipe.config_paths)."""
        base = Path((info.context or {}).get("base") or ".").absolute()
        if problems := config_paths.folder_problems(self, base):
            raise ValueError("\n  ".join(problems))
        return self


def _key(loc: tuple[int | str, ...]) -> str:
    """``("datasets", 0, "weight")`` -> ``datasets[0].weight``."""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}" if key else str(part)
    return key


_HINTS = {
    "float_type": "write a number; YAML reads 1e-4 and 1.0e5 as text: write 1.0e-4 and 1.0e+5",
    "int_type": "write a whole number, without quotes, a dot or an exponent (1000000, not 1e6)",
    "bool_type": "write true or false",
}


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        key = _key(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "string_pattern_mismatch":
            msg = "must be a path: not empty, not only spaces, no NUL character"
        if "input" in e and not isinstance(e["input"], dict):
            shown = repr(e["input"])
            msg += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        if isinstance(e.get("input"), str) and e["type"] in _HINTS:
            msg += f"; {_HINTS[e['type']]}"
        lines.append(f"  {key}: {msg}" if key else f"  {msg}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any], source: str = "<dict>", *, base: str | Path | None = None) -> Config:
    """Validate a config mapping; raises ConfigError naming every bad key.

    ``base``: the folder relative paths start from (``diffpipe run --workdir``); default the working folder.
    """
    try:
        return Config.model_validate(data, context={"base": base})
    except ValidationError as err:
        raise ConfigError(_format_error(err, source)) from None


def load_yaml(source: str | Path) -> Any:
    """Read user YAML safely: a ``Path`` is a file to read, a ``str`` is YAML text.

    No Python objects are built (a safe loader); a key given twice in a mapping, an
    alias bomb or a recursive alias is a ConfigError naming the key or line and the file.
    """
    name = f"config file {source}" if isinstance(source, Path) else "YAML text"
    if isinstance(source, Path):
        try:
            source = source.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{name} not found") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"{name} cannot be read: {err}") from None
    try:
        return yamlload.load(source)
    except yamlload.RefusedError as err:
        raise ConfigError(f"{name}: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{name} is not valid YAML: {err}") from None


def load_config(path: str | Path, *, base: str | Path | None = None) -> Config:
    """Read and validate a YAML config file (relative paths in it start at ``base``, default the working folder)."""
    path = Path(path)
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    return parse_config(data, str(path), base=base)


def json_schema() -> dict[str, Any]:
    """The JSON schema Snakemake validates the YAML config with."""
    schema = Config.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def _rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is None and getattr(ann, "__origin__", None) is list:
            (arg,) = ann.__args__
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.append((key, "(required)" if field.is_required() else "", field.description or ""))
                rows.extend(_rows(arg, f"{key}[].") )
                continue
        if sub is not None:
            rows.extend(_rows(sub, f"{key}."))
            continue
        default = "(required)" if field.is_required() else f"`{field.get_default(call_default_factory=True)!r}`"
        rows.append((key, default, field.description or ""))
    return rows


def reference_markdown() -> str:
    """The config reference table of docs/configuration.md, generated from the models (drift-tested)."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, desc in _rows(Config, ""):
        lines.append(f"| `{key}` | {default} | {desc.replace('|', '/')} |")
    return "\n".join(lines)
