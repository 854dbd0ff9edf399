"""Family ``hunyuanvideo``: HunyuanVideo text-to-video (dual/single-stream DiT), flow matching, Llama + CLIP.

Components and names follow ``HunyuanVideoPipeline``: ``vae``
(AutoencoderKLHunyuanVideo: 8x spatial, 4x temporal compression, so clips
have ``4k+1`` frames; latents times ``scaling_factor``), ``text_encoder``
(a Llama model: the hidden states two layers from the top of the prompt put
in the pipeline's video-description template, the template's tokens cropped
off, padded with a mask) + ``tokenizer``, ``text_encoder_2`` (CLIP, pooled
output) + ``tokenizer_2``, ``transformer`` (HunyuanVideoTransformer3DModel,
fed ``timestep = sigma * 1000`` and the distilled guidance ``train_guidance *
1000`` through its guidance embedding), ``scheduler``
(FlowMatchEulerDiscreteScheduler; training shifts ``t`` by its ``shift``, 7
for HunyuanVideo). Text is encoded by the pipeline's own ``encode_prompt``
on a pipeline of the text components alone, so the cache equals what
sampling computes. Clips are resampled to 24 fps (HunyuanVideo's rate).

The template's ``crop_start`` (its token count before the prompt; the
pipeline's default, 95, is the count for HunyuanVideo's Llama tokenizer) is
measured with the folder's tokenizer and passed to the pipeline when
encoding and sampling: the tiny flavor's tokenizers, built by our code
(``llm_tokenizers``, ``tokenizers``), spell the template by characters.
Prompts keep up to 256 tokens (the pipeline's default), fewer if the
tokenizer's ``model_max_length`` is lower (the tiny flavor's 64).

Default LoRA targets: attention of both streams (``attn.to_q``, ``attn.to_k``,
``attn.to_v``, ``attn.to_out.0``, ``attn.add_q_proj``, ``attn.add_k_proj``,
``attn.add_v_proj``, ``attn.to_add_out``), the feed-forward linears of both
streams (``ff.net.0.proj``, ``ff.net.2``, ``ff_context.net.0.proj``,
``ff_context.net.2``) and the single-stream blocks' MLP input (``proj_mlp``);
the names also reach the text token refiner's attention and MLP.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaModel,
    PreTrainedTokenizerBase,
)

from diffpipe.config import SampleConfig
from diffpipe.families.hunyuanvideo import flavors
from diffpipe.families.hunyuanvideo.layers import hunyuan_video_layers
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextEncoder, TextPart, Tokenizer, clip_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

MAX_LENGTH = 256  # HunyuanVideoPipeline's default max_sequence_length
_LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>")


def tiny_llama_tokenizer() -> PreTrainedTokenizerBase:
    return llm_tokenizer(flavors.TINY_LENGTH, bos="<|begin_of_text|>", eos="<|eot_id|>", extra=_LLAMA_SPECIALS)


def template_for(tokenizer: PreTrainedTokenizerBase) -> dict[str, Any]:
    """The pipeline's template with ``crop_start`` measured by ``tokenizer`` (the tokens before the prompt)."""
    prefix = DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]
    return {"template": DEFAULT_PROMPT_TEMPLATE["template"], "crop_start": len(tokenizer(prefix).input_ids)}


_tiny_llama = common.tiny_text_model(LlamaModel, LlamaConfig, flavors.TINY_LLAMA, "hunyuanvideo.text_encoder")

class HunyuanVideoFamily(Family):
    vae_per_frame = False
    models = Models(AutoencoderKLHunyuanVideo, HunyuanVideoTransformer3DModel, FlowMatchEulerDiscreteScheduler,
                    HunyuanVideoPipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        "tokenizer": Tokenizer(AutoTokenizer, tiny_llama_tokenizer),
        "text_encoder": TextEncoder(LlamaModel, LlamaConfig, _tiny_llama),
        **clip_text_encoder("hunyuanvideo.text_encoder_2"),
    }
    is_video = True
    fps = 24.0
    default_lora_targets: ClassVar[list[str]] = [*targets.dual_stream(), "proj_mlp"]
    #: Distilled guidance fed to the guidance embedding while training (1.0, as LoRAs on it commonly use).
    train_guidance: ClassVar[float] = 1.0

    # -- configs and geometry ------------------------------------------------------
    @property
    def frame_rule(self) -> tuple[int, int]:
        return int(self._vae_config.get("temporal_compression_ratio", 4)), 1

    @property
    def flow_shift(self) -> float:
        return float(self._scheduler_config.get("shift", 1.0))

    @cached_property
    def _text_settings(self) -> dict[str, Any]:
        tok = self.load_tokenizer()  # measured once: a folder's tokenizer loads in about a second
        return {"max_sequence_length": min(MAX_LENGTH, int(tok.model_max_length)), "prompt_template": template_for(tok)}

    def text_settings(self) -> dict[str, Any]:
        """Prompt tokens kept after the template, and the template with its measured ``crop_start``."""
        return dict(self._text_settings)

    def load_pipeline(self) -> HunyuanVideoPipeline:
        text = self.load_text_encoders()
        return HunyuanVideoPipeline(vae=self.load_vae(), transformer=self.load_denoiser(),
                                    scheduler=FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config),
                                    **text.parts)

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            embeds, pooled, mask = self.text_pipeline(encoders).encode_prompt(
                prompt=list(captions),
                prompt_template=encoders.prompt_template,
                max_sequence_length=encoders.max_sequence_length,
            )
        return {
            "prompt_embeds": embeds.float(),
            "prompt_attention_mask": mask.float(),
            "pooled_prompt_embeds": pooled.float(),
        }

    def token_limits(self, encoders: TextBundle) -> dict[str, int]:
        return {"llama": encoders.max_sequence_length, "clip": encoders.tokenizer_2.model_max_length}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        # The Llama tokens the pipeline keeps: the templated prompt's, less the cropped template prefix.
        tpl, crop = encoders.prompt_template["template"], encoders.prompt_template["crop_start"]
        templated = encoders.tokenizer([tpl.format(c) for c in captions], verbose=False).input_ids
        return {
            "llama": [len(x) - crop for x in templated],
            "clip": [len(x) for x in encoders.tokenizer_2(list(captions)).input_ids],
        }

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs: noisy clip, ``sigma * 1000``, Llama text and mask, pooled CLIP, guidance x 1000."""
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        sigma = obj.shift_timesteps(t, o.shift or self.flow_shift)
        device, b = x0.device, x0.shape[0]
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "timestep": (sigma * self._scheduler_config.get("num_train_timesteps", 1000)).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device, dtype=dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            "guidance": torch.full((b,), self.train_guidance * 1000.0, device=device, dtype=dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        e = self.load_tokenizers()
        return {
            **super().sample_kwargs(cfg),
            "prompt_template": e.prompt_template,
            "max_sequence_length": e.max_sequence_length,
        }

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per dual- and single-stream block, output (``layers.py``).

        Input tuple ``(noisy, sigma * 1000, prompt_embeds, mask, pooled, guidance * 1000)``; output
        ``(prediction,)``.
        """
        return hunyuan_video_layers(common.unwrap(denoiser))
