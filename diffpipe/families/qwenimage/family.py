"""Family ``qwenimage``: Qwen-Image (MMDiT, 20B), Qwen2.5-VL text, a Wan-style video VAE.

Components and names follow ``QwenImagePipeline``: ``vae``
(AutoencoderKLQwenImage: 5-D latents ``[B, C, F, h, w]``, normalised by
per-channel ``latents_mean`` / ``latents_std``), ``text_encoder``
(Qwen2_5_VLForConditionalGeneration: last hidden states of the chat
template, its first 34 tokens dropped) + ``tokenizer``, ``transformer``
(QwenImageTransformer2DModel on 2x2-packed latents), ``scheduler`` (flow
matching, resolution-dependent shift). Prompts have different lengths:
the cache pads every one to ``max_sequence_length`` with zeros and stores
the mask (``prompt_embeds_mask``); the transformer masks the padding, so
the result equals the pipeline's per-batch padding.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from diffpipe.config import SampleConfig
from diffpipe.families.qwenimage import flavors
from diffpipe.families.qwenimage.layers import ROUTED, qwen_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.llm_tokenizers import llm_tokenizer

# The pipeline's prompt template and how many leading tokens it drops.
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 34
MAX_LENGTH = 512  # tokens kept per prompt (the pipeline allows up to 1024)


def tiny_qwen_tokenizer(max_length: int) -> PreTrainedTokenizerBase:
    return llm_tokenizer(max_length, bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                         add_bos=False)


def tiny_qwen_vl(tok: PreTrainedTokenizerBase, seed: int, component: str,
                 **text_overrides) -> Qwen2_5_VLForConditionalGeneration:
    text = {**flavors.TINY_TEXT, **text_overrides, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
    config = Qwen2_5_VLConfig(text_config=text,
                              vision_config=flavors.TINY_VISION, vocab_size=len(tok))
    with common.seeded(seed, component):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


class QwenImageFamily(Family):
    models = Models(AutoencoderKLQwenImage, QwenImageTransformer2DModel, FlowMatchEulerDiscreteScheduler,
                    QwenImagePipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        "tokenizer": Tokenizer(AutoTokenizer, lambda: tiny_qwen_tokenizer(flavors.TINY_LENGTH + DROP)),
        "text_encoder": TextEncoder(Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig,
                                    lambda tok, seed: tiny_qwen_vl(tok, seed, "qwenimage.text_encoder")),
    }
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    prompt_drop = DROP
    #: Qwen-Image uses "true" CFG (a negative prompt); its guidance_scale is for guidance-distilled models.
    guidance_arg: ClassVar[str | None] = "true_cfg_scale"
    #: diffusers' Qwen-Image LoRA examples: attention of both streams and
    #: the image-stream MLP of every block.
    default_lora_targets: ClassVar[list[str]] = [*targets.attention(), *targets.added_projections(), *targets.feed_forward("img_mlp")]
    token_routing = ROUTED

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift((x0.shape[-2] // 2) * (x0.shape[-1] // 2))

    def text_settings(self) -> dict[str, Any]:
        return {**super().text_settings(), "template": TEMPLATE}

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        # Each frame is an image of its own, through the VAE's frame axis. Inverse of the pipeline's
        # decode: ``latents * std + mean``.
        latents = common.vae_latents(vae, pixels, frame_axis=True)
        mean, std = common.latent_stats(vae, latents)
        return (latents - mean) / std

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # QwenImagePipeline._get_qwen_prompt_embeds, then padded to a fixed length.
        tok = encoders.tokenizer([TEMPLATE.format(c) for c in captions], max_length=encoders.max_sequence_length
                                 + DROP, padding=True, truncation=True, return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        mask = tok.attention_mask.to(device)
        with torch.no_grad():
            hidden = encoders.text_encoder(input_ids=tok.input_ids.to(device), attention_mask=mask,
                                           output_hidden_states=True).hidden_states[-1]
        length = encoders.max_sequence_length
        embeds = hidden.new_zeros(len(captions), length, hidden.shape[-1], dtype=torch.float32)
        keep = torch.zeros(len(captions), length)
        for i, row in enumerate(hidden):
            kept = row[mask[i].bool()][DROP:][:length]
            embeds[i, : len(kept)] = kept.float()
            keep[i, : len(kept)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": keep}

    def token_limits(self, encoders: TextBundle) -> dict[str, int]:
        return {"qwen": encoders.max_sequence_length}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        ids = encoders.tokenizer([TEMPLATE.format(c) for c in captions]).input_ids
        return {"qwen": [len(x) - DROP for x in ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Packed noisy latents, sigma, text and its mask, and each item's packed grid ``img_shapes``."""
        f = self.flow_draw(latents, generator, objective, t, noise, QwenImagePipeline._pack_latents)
        device = f.x0.device
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": f.sigma.to(dtype),  # the pipeline passes timestep / 1000
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_hidden_states_mask": text["prompt_embeds_mask"].to(device=device, dtype=torch.long),
            "img_shapes": [[(1, *f.grid)]] * f.x0.shape[0],
        }
        return self.flow_prepared(f, inputs, mask, objective)

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(packed_noisy, sigma, prompt_embeds, prompt_embeds_mask, fhw)``: ``img_shapes`` as one tensor."""
        i = prepared.inputs
        fhw = torch.tensor(i["img_shapes"][0][0], device=i["hidden_states"].device)
        return (i["hidden_states"], i["timestep"], i["encoder_hidden_states"], i["encoder_hidden_states_mask"], fhw)

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "negative_prompt": " ", "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output.

        Input tuple ``(packed_noisy, sigma, prompt_embeds, prompt_embeds_mask, fhw)``, ``fhw`` the
        packed grid ``(1, h/2, w/2)``; output ``(packed prediction,)``.
        """
        return qwen_layers(common.unwrap(denoiser))
