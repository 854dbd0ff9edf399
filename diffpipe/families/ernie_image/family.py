"""Family ``ernie-image``: ERNIE-Image (and Turbo), a single-stream DiT over image and text tokens.

Components and names follow ``ErnieImagePipeline``: ``vae`` (FLUX.2's AutoencoderKLFlux2: the latent
mode patchified 2x2 and normalised by the VAE's batch-norm statistics with the epsilon the pipeline's
decode uses), ``text_encoder`` (Mistral3Model: each caption's penultimate hidden states at its own
length, as ``encode_prompt``; the cache pads them to ``max_sequence_length`` with a mask) +
``tokenizer``, ``transformer`` (ErnieImageTransformer2DModel: unpacked latents, ``sigma x 1000``, the
captions with their lengths), ``scheduler`` (flow matching). It predicts the velocity ``noise - x0``.
The optional prompt enhancer (``pe``) is not loaded: it rewrites prompts at sampling only.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLFlux2,
    ErnieImagePipeline,
    ErnieImageTransformer2DModel,
    FlowMatchEulerDiscreteScheduler,
)
from transformers import AutoTokenizer, Mistral3Config, Mistral3Model

from diffpipe.config import SampleConfig
from diffpipe.families.ernie_image import flavors
from diffpipe.families.ernie_image.layers import ernie_layers
from diffpipe.families.flux2_klein.family import TinyBatchNormVae, bn_normalised
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

#: The cache's caption length (longer captions are flagged by validation; the pipeline itself truncates at
#: the tokenizer's limit).
MAX_LENGTH = 512
#: The batch-norm epsilon ``ErnieImagePipeline`` un-normalises with (it does not read the VAE config's).
BN_EPS = 1e-5


def _tiny_tokenizer() -> Any:
    return llm_tokenizer(flavors.TINY_LENGTH, bos="<s>", eos="</s>", pad="<pad>")


class ErnieImageFamily(TinyBatchNormVae, Family):
    models = Models(AutoencoderKLFlux2, ErnieImageTransformer2DModel, FlowMatchEulerDiscreteScheduler,
                    ErnieImagePipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, _tiny_tokenizer, Mistral3Model, Mistral3Config, flavors.TINY_TEXT, "ernie-image.text_encoder",
        vision=flavors.TINY_VISION, stream="mistral")
    patch = 2  # the latents are patchified 2x2 before the transformer (whose patch_size is 1)
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    pipeline_extras: ClassVar[dict[str, Any]] = {"pe": None, "pe_tokenizer": None}
    #: The attention projections and the gated feed-forward of every layer.
    default_lora_targets: ClassVar[list[str]] = [
        *targets.attention("self_attention"), "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2"]

    def load_denoiser(self) -> ErnieImageTransformer2DModel:
        tr = super().load_denoiser()
        if self.cfg.flavor == "tiny":
            # The constructor zero-initialises the shared modulation and the output layer (gates at zero: no
            # block would take part, no LoRA get a gradient); a trained model's are not zero.
            with common.seeded(self.cfg.seed, "ernie-image.transformer.modulation"), torch.no_grad():
                for p in (*tr.adaLN_modulation[-1].parameters(), *tr.final_linear.parameters()):
                    p.normal_(0.0, 0.1)
        return tr

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift(x0.shape[-2] * x0.shape[-1])

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """The inverse of the pipeline's decode: patchified, normalised latents ``[B, 4C, 1, h/2, w/2]``."""
        return bn_normalised(vae, common.vae_latents(vae, pixels)[:, :, 0], BN_EPS)[:, :, None]

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        """``ErnieImagePipeline.encode_prompt`` per caption (penultimate hidden states at the caption's own
        length), zero-padded to ``max_sequence_length`` with the token mask."""
        tok, encoder = encoders.tokenizer, encoders.text_encoder
        device = next(encoder.parameters()).device
        length = encoders.max_sequence_length
        embeds = torch.zeros(len(captions), length, encoder.config.text_config.hidden_size)
        mask = torch.zeros(len(captions), length)
        for i, caption in enumerate(captions):
            ids = tok(caption, add_special_tokens=True, truncation=True, max_length=length)["input_ids"] or [
                tok.bos_token_id if tok.bos_token_id is not None else 0]
            with torch.no_grad():
                hidden = encoder(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
            embeds[i, : len(ids)] = hidden.hidden_states[-2][0].float().cpu()
            mask[i, : len(ids)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Unpacked noisy latents, ``sigma x 1000``, the captions cut to the batch's longest with their
        lengths (the transformer masks the rest); the target ``noise - x0``."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        device = f.x0.device
        lens = text["prompt_embeds_mask"].to(device).sum(1).long()
        longest = int(lens.max()) if lens.device.type != "meta" else text["prompt_embeds"].shape[1]
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": (f.sigma * 1000).to(dtype),
            "text_bth": text["prompt_embeds"][:, :longest].to(device=device, dtype=dtype),
            "text_lens": lens,
        }
        return self.flow_prepared(f, inputs, mask, objective)

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "use_pe": False}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (image and text tokens, positions, mask, the shared modulation), one layer per block,
        output. Input tuple ``(noisy latents, sigma x 1000, captions, caption lengths)``."""
        return ernie_layers(common.unwrap(denoiser))
