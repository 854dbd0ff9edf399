"""Family ``zimage``: Z-Image (Turbo), a single-stream DiT over text and image tokens, Qwen3 text, flow matching.

Components and names follow ``ZImagePipeline``: ``vae`` (FLUX.1's AutoencoderKL: 16 channels, factor 8,
scaling and shift), ``text_encoder`` (Qwen3Model: the penultimate hidden states of the caption in the
tokenizer's chat template, as one user turn with the assistant turn opened) + ``tokenizer``,
``transformer`` (ZImageTransformer2DModel), ``scheduler`` (flow matching). The transformer takes lists:
each image ``[C, 1, H, W]`` and each caption's embeddings at its own length; the cache pads them to
``max_sequence_length`` with a mask and ``prepare`` cuts each back to its tokens. Time runs the other way
(the transformer sees ``1 - sigma``) and it predicts ``x0 - noise``: the pipeline steps with ``-pred``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoTokenizer, PreTrainedTokenizerBase, Qwen3Config, Qwen3Model

from diffpipe.config import SampleConfig
from diffpipe.families.zimage import flavors
from diffpipe.families.zimage.layers import zimage_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import tiny_qwen3_tokenizer

MAX_LENGTH = 512  # ZImagePipeline's default max_sequence_length

def chat_prompts(tokenizer: PreTrainedTokenizerBase, captions: list[str]) -> list[str]:
    """``ZImagePipeline._encode_prompt``'s text: each caption as one user turn, the assistant turn opened."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=True) for c in captions]


class ZImageFamily(Family):
    vae_shift = True
    models = Models(AutoencoderKL, ZImageTransformer2DModel, FlowMatchEulerDiscreteScheduler, ZImagePipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: tiny_qwen3_tokenizer(flavors.TINY_LENGTH), Qwen3Model, Qwen3Config, flavors.TINY_QWEN3,
        "zimage.text_encoder", stream="qwen3")
    patch = 2  # the pipeline's patch side (the config lists all_patch_size)
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: The attention projections and the SwiGLU feed-forward of every block (refiners included).
    default_lora_targets: ClassVar[list[str]] = [
        *targets.attention("attention"), "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"]

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift((x0.shape[-2] // 2) * (x0.shape[-1] // 2))

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # ZImagePipeline._encode_prompt, padded to a fixed length (padding zeroed) with the token mask.
        tok = encoders.tokenizer(chat_prompts(encoders.tokenizer, captions), padding="max_length",
                                 max_length=encoders.max_sequence_length, truncation=True, return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        mask = tok.attention_mask.to(device).bool()
        with torch.no_grad():
            hidden = encoders.text_encoder(input_ids=tok.input_ids.to(device), attention_mask=mask,
                                           output_hidden_states=True).hidden_states[-2]
        return {"prompt_embeds": hidden.float() * mask[..., None], "prompt_embeds_mask": mask.float()}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        return {"qwen3": [len(ids) for ids in encoders.tokenizer(chat_prompts(encoders.tokenizer, captions)).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """The transformer's lists: each noisy image ``[C, 1, h, w]``, each caption at its length; ``1 - sigma``.

        The target is ``x0 - noise``: the pipeline steps with ``-pred`` as the velocity ``noise - x0``.
        """
        f = self.flow_draw(latents, generator, objective, t, noise)
        device = f.x0.device
        embeds = text["prompt_embeds"].to(device=device, dtype=dtype)
        if embeds.device.type == "meta":  # memory estimates: every caption at full length
            captions = list(embeds.unbind(0))
        else:
            keep = text["prompt_embeds_mask"].to(device).bool()
            captions = [e[k] for e, k in zip(embeds, keep, strict=True)]
        inputs = {
            "x": list(f.noisy.to(dtype).unsqueeze(2).unbind(0)),
            "t": (1 - f.sigma).to(dtype),
            "cap_feats": captions,
        }
        return Prepared(inputs, -f.target, mask=self.loss_mask(mask, f.x0, objective))

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward's per-image outputs ``[C, 1, h, w]`` stacked to ``[B, C, h, w]``."""
        return torch.stack(denoiser(**prepared.inputs, return_dict=False)[0]).squeeze(2)

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(noisy [B, C, h, w], t, captions zero-padded [B, L, D], caption mask [B, L])``."""
        i = prepared.inputs
        keep = [torch.ones(len(c), dtype=torch.long, device=c.device) for c in i["cap_feats"]]
        return (torch.stack(i["x"]).squeeze(2), i["t"], pad_sequence(i["cap_feats"], batch_first=True),
                pad_sequence(keep, batch_first=True))

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (with the image and caption refiners), one layer per block, output.

        Input tuple ``(noisy, 1 - sigma, captions, caption mask)``; output ``(prediction [B, C, h, w],)``.
        Captions of any length mix in a micro-batch: the unified sequence is padded per sample and masked.
        """
        return zimage_layers(common.unwrap(denoiser))
