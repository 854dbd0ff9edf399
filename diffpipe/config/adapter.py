"""The trained adapters: ``train.lora``, ``train.text_encoder`` and the weights' average ``train.ema``."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from diffpipe.config.base import MAX_STEPS, Float, Int, OnceEach, PathText, Section, Text

LoraKind = Literal["lora", "dora", "lokr", "loha"]


class LoraConfig(Section):
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


class TextEncoderTrainConfig(Section):
    encoders: Annotated[list[Text], OnceEach] = Field(
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


class EmaConfig(Section):
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
