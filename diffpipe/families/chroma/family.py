"""Family ``chroma``: Chroma (a Flux.1-schnell derivative), T5 text with an attention mask.

Components and names follow ``ChromaPipeline``: ``vae`` (Flux's),
``text_encoder`` (T5EncoderModel) + ``tokenizer``, ``transformer``
(ChromaTransformer2DModel: Flux blocks, modulation from a small
"approximator" network instead of CLIP pooled text and guidance),
``scheduler``. Unlike Flux, Chroma masks the T5 padding: every token but
the first pad is masked, in the encoder and in the transformer, so the mask
is cached next to the embeddings (``prompt_attention_mask``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers import ChromaPipeline, ChromaTransformer2DModel, FluxPipeline
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

from diffpipe.families.chroma.flavors import TINY_TRANSFORMER
from diffpipe.families.chroma.layers import chroma_layers
from diffpipe.families.flux.family import TINY_T5, TINY_T5_LENGTH, FluxFamily
from diffpipe.models import _common as common
from diffpipe.models.base import Prepared
from diffpipe.models.components import Model, TextBundle, TextPart, one_text_encoder
from diffpipe.models.tokenizers import t5_tokenizer


class ChromaFamily(FluxFamily):
    pipeline_class = ChromaPipeline
    trainable_text_encoders: ClassVar[dict[str, str]] = {}  # its one T5 encoder stays cached
    #: Flux's targets (the blocks are Flux's), which also hit the single blocks' q/k/v.
    default_lora_targets: ClassVar[list[str]] = FluxFamily.default_lora_targets
    denoiser_model = Model(ChromaTransformer2DModel, TINY_TRANSFORMER)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        T5TokenizerFast, lambda: t5_tokenizer(TINY_T5_LENGTH), T5EncoderModel, T5Config, TINY_T5,
        "chroma.text_encoder", common.T5_IDS, stream="t5")

    prompt_tokens = (TINY_T5_LENGTH, 512)  # ChromaPipeline's default max_sequence_length
    prompt_tokenizer = "tokenizer"

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly ChromaPipeline._get_t5_prompt_embeds.
        tok = encoders.tokenizer(captions, padding="max_length", max_length=encoders.max_sequence_length,
                                 truncation=True, return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        mask = tok.attention_mask.to(device)
        with torch.no_grad():
            embeds = encoders.text_encoder(tok.input_ids.to(device), output_hidden_states=False,
                                           attention_mask=mask)[0]
        # Every token up to and including the first pad is attended to.
        positions = torch.arange(mask.shape[1], device=device).unsqueeze(0)
        keep = (positions <= mask.sum(dim=1, keepdim=True)).float()
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": keep}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flux's packed inputs without guidance or pooled text, with the text-and-image attention mask."""
        f = self.flow_draw(latents, generator, objective, t, noise, FluxPipeline._pack_latents)
        device, b, (h, w) = f.x0.device, f.x0.shape[0], f.grid
        embeds = text["prompt_embeds"].to(device=device, dtype=dtype)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": f.sigma.to(dtype),
            "encoder_hidden_states": embeds,
            "txt_ids": torch.zeros(embeds.shape[1], 3, device=device, dtype=dtype),
            "img_ids": FluxPipeline._prepare_latent_image_ids(b, h, w, device, dtype),
            # ChromaPipeline._prepare_attention_mask: text mask, then every image token.
            "attention_mask": torch.cat([text["prompt_attention_mask"].to(device=device, dtype=dtype),
                                         torch.ones(b, h * w, device=device, dtype=dtype)], dim=1),
        }
        return self.flow_prepared(f, inputs, mask, objective)

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per double and single block, output.

        Input tuple ``(packed_noisy, sigma, prompt_embeds, txt_ids, img_ids, attention_mask)``
        (the mask over text and image tokens); output ``(packed prediction,)``.
        """
        return chroma_layers(common.unwrap(denoiser))
