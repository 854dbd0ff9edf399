"""Family ``krea2``: Krea 2 (Base, Turbo), a single-stream DiT with a text-fusion stage, Qwen3-VL text.

Components and names follow ``Krea2Pipeline``: ``vae`` (the Qwen-Image VAE, latents normalised by its
per-channel mean and std as the pipeline undoes them), ``text_encoder`` (Qwen3VLModel: twelve of its
hidden-state layers per token, from the pipeline's own ``get_text_hidden_states``: the caption inside its
fixed-length template, a mask over the real tokens) + ``tokenizer``, ``transformer``
(Krea2Transformer2DModel on 2x2-packed latents, ``sigma`` as its timestep, the pipeline's 3-axis
positions), ``scheduler`` (flow matching with the resolution-dependent shift). It predicts the velocity
``noise - x0``. LoRAs trained on Base load into Turbo (same architecture).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    Krea2Pipeline,
    Krea2Transformer2DModel,
)
from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLModel

from diffpipe.config import SampleConfig
from diffpipe.families.krea2 import flavors
from diffpipe.families.krea2.layers import krea2_layers
from diffpipe.families.qwenimage.family import QwenImageFamily, tiny_qwen_tokenizer
from diffpipe.models import _common as common
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder

MAX_LENGTH = 512  # Krea2Pipeline's default max_sequence_length
_PACKING = SimpleNamespace(patch_size=2)  # what Krea2Pipeline._pack_latents reads of the pipeline


def _pack(x: torch.Tensor, b: int, c: int, h: int, w: int) -> torch.Tensor:
    return Krea2Pipeline._pack_latents(_PACKING, x, b, c, h, w)


class Krea2Family(Family):
    models = Models(AutoencoderKLQwenImage, Krea2Transformer2DModel, FlowMatchEulerDiscreteScheduler, Krea2Pipeline,
                    flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: tiny_qwen_tokenizer(flavors.TINY_LENGTH), Qwen3VLModel, Qwen3VLConfig,
        flavors.TINY_TEXT, "krea2.text_encoder",
        ids=("pad", "eos"), vision=flavors.TINY_VISION, stream="qwen3-vl")
    patch = 2  # the pipeline packs 2x2 latents into a token
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: Attention (q, k, v, output and its gate) and SwiGLU feed-forward of every block, text-fusion blocks
    #: included.
    default_lora_targets: ClassVar[list[str]] = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.to_gate", "ff.gate", "ff.up", "ff.down"]

    encode_pixels = QwenImageFamily.encode_pixels  # the same VAE, normalised as its pipelines undo it

    def shift_for(self, x0: torch.Tensor) -> float:
        return self.timestep_shift((x0.shape[-2] // 2) * (x0.shape[-1] // 2))

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.text_pipeline(encoders)
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            hidden, mask = pipe.get_text_hidden_states(list(captions), encoders.max_sequence_length, device)
        return {"prompt_embeds": hidden.float(), "prompt_embeds_mask": mask.float()}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        """The caption's share of the fixed-length block: the template prefix and caption, less the tokens
        the pipeline cuts off the front, plus the suffix it appends (what must fit ``max_sequence_length``)."""
        pipe = self.text_pipeline(encoders)
        extra = pipe.prompt_template_encode_num_suffix_tokens - pipe.prompt_template_encode_start_idx
        ids = encoders.tokenizer([pipe.prompt_template_encode_prefix + c for c in captions]).input_ids
        return {"qwen3-vl": [len(i) + extra for i in ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Packed noisy tokens, ``sigma``, the twelve-layer caption states with their mask and the pipeline's
        positions (text at the origin, image tokens on their grid); the packed target ``noise - x0``."""
        f = self.flow_draw(latents, generator, objective, t, noise, _pack)
        device = f.x0.device
        embeds = text["prompt_embeds"].to(device=device, dtype=dtype)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "encoder_hidden_states": embeds,
            "timestep": f.sigma.to(dtype),
            "position_ids": Krea2Pipeline.prepare_position_ids(embeds.shape[1], *f.grid, device),
            "encoder_attention_mask": text["prompt_embeds_mask"].to(device).bool(),
        }
        return self.flow_prepared(f, inputs, mask, objective)

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (the text-fusion stage, input projections, positions), one layer per block, output.
        Input tuple ``(packed noisy, caption states, sigma, positions, caption mask)``."""
        return krea2_layers(common.unwrap(denoiser))
