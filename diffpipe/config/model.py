"""``model``: which model to fine-tune (family, flavor, weights and their dtypes, version within a family)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from diffpipe.config.base import MAX_FRAMES, Bool, Float, Int, LoadDtype, PathText, Section, Seed, Text


class BaseLora(Section):
    path: PathText = Field(
        description="A LoRA file in any format `diffpipe import-lora` reads (diffusers, kohya, ComfyUI, LoKr/LoHa, "
        "or a PEFT folder), or `org/name/file.safetensors` of a Hugging Face repository (when no such local file "
        "exists).",
    )
    scale: Float = Field(1.0, description="Strength the LoRA is folded into the frozen base at (its own alpha "
                         "included, as `set_adapters(..., adapter_weights=[scale])` applies it).")


class ModelConfig(Section):
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
    base_loras: list[BaseLora] = Field(
        [],
        description="LoRAs folded into the frozen denoiser before the trained LoRA goes in: a training adapter "
        "that de-distills a few-step base (Z-Image Turbo, FLUX.1-schnell), a speed LoRA (Lightning, LightX2V), or "
        "a LoRA to train a second concept on. Present in training, eval and samples; left out of the exported "
        "LoRA unless `export.include_base_loras` (the model card lists them: load them beside it). Each "
        "`[{path, scale}]`; their content and scale are part of the train, export and sample digests. A text "
        "encoder's part (families whose text encoders take a LoRA: sd, sdxl, flux) is folded into that frozen "
        "encoder wherever it loads, and only such a LoRA enters the text cache keys and the plan and cache "
        "digests (a denoiser-only one recaches nothing).",
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
