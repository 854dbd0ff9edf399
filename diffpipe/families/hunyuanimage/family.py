"""Family ``hunyuanimage``: HunyuanImage 2.1 (17B), Qwen2.5-VL text plus a ByT5 glyph encoder.

Components and names follow ``HunyuanImagePipeline``: ``vae``
(AutoencoderKLHunyuanImage, 32x spatial compression at full size),
``text_encoder`` (Qwen2.5-VL: the chat template's hidden states two layers
from the top, its first 34 tokens dropped, padded to a fixed length with a
mask) + ``tokenizer``, ``text_encoder_2`` (ByT5 for text in quotes, the glyph
text; zeros when the caption quotes nothing) + ``tokenizer_2``,
``transformer`` (HunyuanImageTransformer2DModel), ``scheduler``. Text is
encoded by the pipeline's own ``encode_prompt`` on a pipeline of the text
components alone, so the cache equals what sampling computes. Flow matching,
velocity ``noise - x0`` at the scheduler's timestep (``sigma * 1000``).

diffusers 0.42.1's ``HunyuanImagePipeline`` has no LoRA loader (no ``load_lora_weights``): the
diffusers-format file loads through the transformer's own PEFT mixin, ``pipe.transformer.load_lora_adapter(
file, prefix="transformer")`` (:class:`~diffpipe.models.base.TransformerLoRA`, the model card's line).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanImage,
    FlowMatchEulerDiscreteScheduler,
    HunyuanImagePipeline,
    HunyuanImageTransformer2DModel,
)
from diffusers.guiders import AdaptiveProjectedMixGuidance
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    T5Config,
    T5EncoderModel,
)

from diffpipe.config import SampleConfig
from diffpipe.families.hunyuanimage import flavors
from diffpipe.families.qwenimage.family import tiny_qwen_tokenizer, tiny_qwen_vl
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared, TransformerLoRA
from diffpipe.models.components import Models
from diffpipe.models.tokenizers import tokenizer_fingerprint
from diffpipe.utils import digest

# The tiny tokenizer spells the template out by characters: the pipeline's
# 1000-token budget is cut to fit, and the glyph budget too.
TINY_LENGTH, TINY_GLYPH_LENGTH = 160, 16
_TEXT_PARTS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2")


@dataclass
class HunyuanText:
    tokenizer: PreTrainedTokenizerBase
    text_encoder: Qwen2_5_VLForConditionalGeneration
    tokenizer_2: ByT5Tokenizer
    text_encoder_2: T5EncoderModel
    max_lengths: tuple[int, int] | None  # (Qwen, glyph) tokens; None: the pipeline's own

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> HunyuanText:
        self.text_encoder.to(device=device, dtype=dtype)
        self.text_encoder_2.to(device=device, dtype=dtype)
        return self

    def pipeline(self, **components) -> HunyuanImagePipeline:
        pipe = HunyuanImagePipeline(**{name: getattr(self, name) for name in _TEXT_PARTS},
                                    **{"scheduler": None, "vae": None, "transformer": None, **components})
        if self.max_lengths:
            pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = self.max_lengths
        return pipe


class HunyuanImageFamily(TransformerLoRA, Family):
    models = Models(AutoencoderKLHunyuanImage, HunyuanImageTransformer2DModel, FlowMatchEulerDiscreteScheduler,
                    HunyuanImagePipeline, flavors)
    #: Attention of both streams and the feed-forwards of the double blocks (Flux-like blocks).
    default_lora_targets: ClassVar[list[str]] = targets.dual_stream()
    #: The distilled model's embedded guidance (the base's CFG strength lives in its guider component).
    guidance_arg: ClassVar[str | None] = "distilled_guidance_scale"

    # -- components ------------------------------------------------------------

    def load_tokenizers(self) -> HunyuanText:
        if self.cfg.flavor == "tiny":
            return HunyuanText(tiny_qwen_tokenizer(TINY_LENGTH + 34), None, ByT5Tokenizer(), None,
                               (TINY_LENGTH, TINY_GLYPH_LENGTH))
        p = self.cfg.path
        tok = AutoTokenizer.from_pretrained(p, subfolder="tokenizer")
        lengths = None if tok.model_max_length > 1034 else (tok.model_max_length - 34, TINY_GLYPH_LENGTH)
        return HunyuanText(tok, None, ByT5Tokenizer.from_pretrained(p, subfolder="tokenizer_2"), None, lengths)

    def load_text_encoders(self) -> HunyuanText:
        e = self.load_tokenizers()
        if self.cfg.flavor == "tiny":
            e.text_encoder = tiny_qwen_vl(e.tokenizer, self.cfg.seed, f"{self.name}.text_encoder",
                                          num_hidden_layers=3)
            config = T5Config(**flavors.TINY_BYT5, vocab_size=len(e.tokenizer_2),
                              pad_token_id=e.tokenizer_2.pad_token_id,
                              eos_token_id=e.tokenizer_2.eos_token_id,
                              decoder_start_token_id=e.tokenizer_2.pad_token_id)
            with common.seeded(self.cfg.seed, f"{self.name}.text_encoder_2"):
                e.text_encoder_2 = T5EncoderModel(config).eval()
            return self.stored_text(e)
        e.text_encoder = common.pretrained_text_encoder(Qwen2_5_VLForConditionalGeneration, self.cfg, "text_encoder")
        e.text_encoder_2 = common.pretrained_text_encoder(T5EncoderModel, self.cfg, "text_encoder_2")
        return self.stored_text(e)

    def load_pipeline(self) -> HunyuanImagePipeline:
        # Classifier-free guidance is a pipeline component here (the ``guider``): the folder's own
        # when it has one; none for the tiny flavor (sampling without CFG).
        guiders = {}
        if self.cfg.flavor != "tiny":
            for name in ("guider", "ocr_guider"):
                if (Path(self.cfg.path) / name).is_dir():
                    guiders[name] = AdaptiveProjectedMixGuidance.from_pretrained(self.cfg.path, subfolder=name)
        return self.load_text_encoders().pipeline(
            scheduler=self.inference_scheduler(), vae=self.load_vae(), transformer=self.load_denoiser(), **guiders)

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        # No guidance_scale argument: CFG strength lives in the guider component.
        kwargs = super().sample_kwargs(cfg)
        if self.cfg.flavor == "tiny":
            kwargs.pop("distilled_guidance_scale")
        return kwargs

    # -- identities ------------------------------------------------------------
    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity((self.name, self.cfg.seed, "text"),
                                        lambda: self._text_identity(self.load_text_encoders()))
        p, tok = self.cfg.path, self.load_tokenizers()
        return digest({
            "tokenizer": tokenizer_fingerprint(tok.tokenizer),
            "tokenizer_2": type(tok.tokenizer_2).__name__,  # byte-level: no vocabulary to hash
            "text_encoder": common.transformers_folder_identity(
                Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, p, "text_encoder", variant=self.cfg.weight_variant),
            "text_encoder_2": common.transformers_folder_identity(T5EncoderModel, T5Config, p, "text_encoder_2", variant=self.cfg.weight_variant),
            "max_lengths": tok.max_lengths,
        })

    @staticmethod
    def _text_identity(e: HunyuanText) -> str:
        return digest({"tokenizer": tokenizer_fingerprint(e.tokenizer), "tokenizer_2": type(e.tokenizer_2).__name__,
                       "text_encoder": common.module_identity(e.text_encoder),
                       "text_encoder_2": common.module_identity(e.text_encoder_2), "max_lengths": e.max_lengths})

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: HunyuanText, captions: list[str]) -> dict[str, torch.Tensor]:
        pipe = encoders.pipeline()
        with torch.no_grad():
            pe, mask, pe2, mask2 = pipe.encode_prompt(prompt=list(captions), device=pipe._execution_device,
                                                        batch_size=len(captions))
        return {"prompt_embeds": pe.float(), "prompt_embeds_mask": mask.float(),
                "prompt_embeds_2": pe2.float(), "prompt_embeds_mask_2": mask2.float()}

    def token_limits(self, encoders: HunyuanText) -> dict[str, int]:
        return {"qwen": encoders.pipeline().tokenizer_max_length}

    def count_tokens(self, encoders: HunyuanText, captions: list[str]) -> dict[str, list[int]]:
        template = encoders.pipeline().prompt_template_encode
        return {"qwen": [len(x) - 34 for x in encoders.tokenizer([template.format(c) for c in captions]).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with both text encoders' embeddings and masks, and the guidance (1000)."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        device, b = f.x0.device, f.x0.shape[0]
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": (f.sigma * 1000).to(dtype),
            "guidance": torch.full((b,), 1000.0, device=device, dtype=dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_embeds_mask"].to(device=device, dtype=torch.long),
            "encoder_hidden_states_2": text["prompt_embeds_2"].to(device=device, dtype=dtype),
            "encoder_attention_mask_2": text["prompt_embeds_mask_2"].to(device=device, dtype=torch.long),
        }
        return self.flow_prepared(f, inputs, mask, objective)
