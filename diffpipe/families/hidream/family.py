"""Family ``hidream``: HiDream-I1 (sparse mixture-of-experts DiT), four text encoders.

Components and names follow ``HiDreamImagePipeline``: ``vae``,
``text_encoder`` / ``text_encoder_2`` (CLIP-L / CLIP-G with projection:
pooled outputs, concatenated) with ``tokenizer`` / ``tokenizer_2``,
``text_encoder_3`` (T5) + ``tokenizer_3``, ``text_encoder_4`` (Llama 3.1:
every layer's hidden states) + ``tokenizer_4``, ``transformer``
(HiDreamImageTransformer2DModel), ``scheduler``. Text is encoded by the
pipeline's own ``encode_prompt`` on a pipeline holding only the text
components, so the cache equals what sampling computes. The Llama states are
cached batch-first (``[B, layers, L, D]``). The model predicts ``x0 - noise``
at the scheduler's timestep (``sigma * 1000``), as the pipeline's ``-noise_pred``
shows.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
)
from transformers import (
    AutoTokenizer,
    CLIPTextModelWithProjection,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from diffpipe.config import SampleConfig
from diffpipe.families.hidream import flavors
from diffpipe.families.hidream.layers import hidream_layers
from diffpipe.models import _common as common
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextEncoder, TextPart, Tokenizer, clip_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer
from diffpipe.models.tokenizers import t5_tokenizer

MAX_LENGTH = 128  # the pipeline's default max_sequence_length


def unpatchify(patches: torch.Tensor, shape: torch.Size, p: int) -> torch.Tensor:
    """``[B, C, S, p*p]`` (the transformer's training-mode output) -> ``[B, C, H, W]``.

    Patches are row-major over the ``H/p x W/p`` grid, each ``(p1, p2)``; padding beyond the grid is dropped.
    """
    b, c, h, w = shape
    ph, pw = h // p, w // p
    x = patches[:, :, : ph * pw].reshape(b, c, ph, pw, p, p)
    return x.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)


_tiny_t5 = common.tiny_text_model(T5EncoderModel, T5Config, flavors.TINY_T5, "hidream.text_encoder_3", common.T5_IDS)

_tiny_llama = common.tiny_text_model(LlamaForCausalLM, LlamaConfig, flavors.TINY_LLAMA, "hidream.text_encoder_4")

class HiDreamFamily(Family):
    vae_shift = True
    models = Models(AutoencoderKL, HiDreamImageTransformer2DModel, FlowMatchEulerDiscreteScheduler,
                    HiDreamImagePipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        **clip_text_encoder("hidream.text_encoder", "text_encoder", cls=CLIPTextModelWithProjection),
        **clip_text_encoder("hidream.text_encoder_2", cls=CLIPTextModelWithProjection),
        "tokenizer_3": Tokenizer(T5TokenizerFast, lambda: t5_tokenizer(flavors.TINY_LENGTH)),
        "text_encoder_3": TextEncoder(T5EncoderModel, T5Config, _tiny_t5),
        "tokenizer_4": Tokenizer(AutoTokenizer, lambda: llm_tokenizer(flavors.TINY_LENGTH, bos="<|begin_of_text|>",
                                                                      eos="<|eot_id|>")),
        "text_encoder_4": TextEncoder(LlamaForCausalLM, LlamaConfig, _tiny_llama),
    }
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    prompt_tokenizer = "tokenizer_3"
    #: Attention of both streams and the shared expert of every MoE feed-forward
    #: (the routed experts are left alone, as in diffusers' HiDream LoRA example).
    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t",
                                                 "to_out_t", "shared_experts.w1", "shared_experts.w2",
                                                 "shared_experts.w3"]

    def load_pipeline(self) -> HiDreamImagePipeline:
        pipe = super().load_pipeline()
        if self.cfg.flavor == "tiny":
            # The pipeline renders every size rescaled to the area of a default_sample_size square
            # (1024 px for the real model); the tiny model's is 64 px, within its max_resolution.
            pipe.default_sample_size = 32
        return pipe

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # The pipeline's own encode_prompt, on a pipeline of the text components alone.
        pipe = HiDreamImagePipeline(scheduler=None, vae=None, transformer=None, **encoders.parts)
        with torch.no_grad():
            t5, _, llama, _, pooled, _ = pipe.encode_prompt(
                prompt=list(captions), do_classifier_free_guidance=False,
                max_sequence_length=encoders.max_sequence_length)
        return {"prompt_embeds_t5": t5.float(), "prompt_embeds_llama3": llama.transpose(0, 1).float(),
                "pooled_prompt_embeds": pooled.float()}

    def token_limits(self, encoders: TextBundle) -> dict[str, int]:
        msl = encoders.max_sequence_length
        return {"clip_l": min(msl, 218), "clip_g": min(msl, 218), "t5": min(msl, encoders.tokenizer_3.model_max_length),
                "llama": min(msl, encoders.tokenizer_4.model_max_length)}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        c = list(captions)
        return {name: [len(x) for x in getattr(encoders, f"tokenizer{s}")(c).input_ids]
                for name, s in (("clip_l", ""), ("clip_g", "_2"), ("t5", "_3"), ("llama", "_4"))}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with the four text encoders' embeddings (Llama's ``[layers, B, L, D]``)."""
        f = self.flow_draw(latents, generator, objective, t, noise)
        device = f.x0.device
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timesteps": (f.sigma * 1000).to(dtype),
            "encoder_hidden_states_t5": text["prompt_embeds_t5"].to(device=device, dtype=dtype),
            "encoder_hidden_states_llama3": text["prompt_embeds_llama3"].to(device=device, dtype=dtype).transpose(0, 1),
            "pooled_embeds": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
        }
        return Prepared(inputs, -f.target, mask=self.loss_mask(mask, f.x0, objective))

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward in the image layout (train mode returns patches ``[B, C, S, p*p]``, S padded)."""
        pred = super().predict(denoiser, prepared)
        if pred.shape != prepared.target.shape:
            pred = unpatchify(pred, prepared.target.shape, common.unwrap(denoiser).config.patch_size)
        return pred

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per double and single block, output.

        Input tuple ``(noisy, sigma * 1000, prompt_embeds_t5, llama [layers, B, L, D], pooled)``;
        output ``(prediction [B, C, H, W],)`` (the image layout in train mode too).
        """
        return hidream_layers(common.unwrap(denoiser))
