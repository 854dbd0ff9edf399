"""Family ``hunyuanvideo15``: HunyuanVideo 1.5 text-to-video (8.3B DiT), flow matching, Qwen2.5-VL + ByT5.

Components and names follow ``HunyuanVideo15Pipeline``: ``vae`` (AutoencoderKLHunyuanVideo15: 16x spatial and
4x temporal compression at full size, so clips have ``4k+1`` frames; latents times ``scaling_factor``, as the
pipeline's decode divides them), ``text_encoder`` (Qwen2.5-VL's language model: each caption after the
pipeline's system message in the chat template, the hidden states two layers from the top, the template's
first 108 tokens cropped, padded to ``tokenizer_max_length`` with a mask) + ``tokenizer``, ``text_encoder_2``
(ByT5 on the text in quotes, the glyph text; zeros when a caption quotes nothing) + ``tokenizer_2``,
``transformer`` (HunyuanVideo15Transformer3DModel), ``scheduler`` (flow matching with its ``shift``, 7 for
the 480p model), and the ``guider`` (classifier-free guidance at sampling: the folder's own). Text is encoded
by the pipeline's own ``encode_prompt`` on a pipeline of the text components alone, so the cache equals what
sampling computes.

Text-to-video, as the pipeline runs it: the transformer reads the noisy latents stacked with zero condition
latents and a zero mask (``prepare_cond_latents_and_mask``) and zero image embeddings (its text-to-video
switch), at ``timestep = sigma x 1000``, and predicts the velocity ``noise - x0``. Clips are resampled to
24 fps. The image-to-video pipeline (a first frame in the condition latents and SigLIP image embeddings) is
not this family yet.

diffusers 0.42.1's ``HunyuanVideo15Pipeline`` has no LoRA loader: the diffusers-format file loads through
the transformer's own PEFT mixin (:class:`~diffpipe.models.base.TransformerLoRA`, the model card's line).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
from transformers import (
    AutoTokenizer,
    ByT5Tokenizer,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    T5Config,
    T5EncoderModel,
)

from diffpipe.families.hunyuanvideo15 import flavors
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared, TransformerLoRA
from diffpipe.models.components import Models, TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.llm_tokenizers import tiny_qwen3_tokenizer

MAX_LENGTH = 1000  # the pipeline's tokenizer_max_length: prompt tokens after the cropped template
CROP = 108  # the pipeline's prompt_template_encode_start_idx: the template's tokens before the prompt
GLYPH_LENGTH = 256  # the pipeline's tokenizer_2_max_length (ByT5 bytes of the quoted text)


def _tiny_qwen() -> Any:
    return tiny_qwen3_tokenizer(flavors.TINY_LENGTH + CROP)


@functools.cache
def _stand_in_vae() -> AutoencoderKLHunyuanVideo15:
    """A tiny VAE for pipelines that only encode text: the pipeline's constructor reads a VAE's config when
    one is given at all (None fails there), and ``encode_prompt`` never touches it."""
    return AutoencoderKLHunyuanVideo15(**flavors.TINY_VAE)


def _text_only(**parts: Any) -> HunyuanVideo15Pipeline:
    """The pipeline holding only ``parts`` of its text side (the rest None; a stand-in VAE)."""
    names = ("transformer", "scheduler", "guider", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    return HunyuanVideo15Pipeline(vae=_stand_in_vae(), **{**dict.fromkeys(names), **parts})


@functools.cache
def _bare_pipeline() -> HunyuanVideo15Pipeline:
    """The pipeline without components: its fixed settings (system message, image token count) as it sets them."""
    return _text_only()


class HunyuanVideo15Family(TransformerLoRA, Family):
    vae_per_frame = False
    #: Classifier-free guidance lives in the guider component: the pipeline takes no guidance scale.
    guidance_arg: ClassVar[str | None] = None
    models = Models(AutoencoderKLHunyuanVideo15, HunyuanVideo15Transformer3DModel, FlowMatchEulerDiscreteScheduler,
                    HunyuanVideo15Pipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        "tokenizer": Tokenizer(AutoTokenizer, _tiny_qwen, "qwen"),
        "text_encoder": TextEncoder(Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig, common.tiny_text_model(
            Qwen2_5_VLTextModel, Qwen2_5_VLTextConfig, flavors.TINY_TEXT, "hunyuanvideo15.text_encoder")),
        "tokenizer_2": Tokenizer(ByT5Tokenizer, ByT5Tokenizer),
        "text_encoder_2": TextEncoder(T5EncoderModel, T5Config, common.tiny_text_model(
            T5EncoderModel, T5Config, flavors.TINY_BYT5, "hunyuanvideo15.text_encoder_2", common.T5_IDS)),
    }
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    prompt_drop = CROP
    is_video = True
    fps = 24.0
    #: Attention of both streams and their feed-forwards in every (double-stream) block.
    default_lora_targets: ClassVar[list[str]] = targets.dual_stream()

    # -- configs and geometry ------------------------------------------------------
    @property
    def frame_rule(self) -> tuple[int, int]:
        return int(self._vae_config.get("temporal_compression_ratio", 4)), 1

    def _lengths(self, pipe: HunyuanVideo15Pipeline) -> HunyuanVideo15Pipeline:
        """The pipeline with the prompt length the caches keep (its own, 1000, unless the tokenizer's is lower)."""
        pipe.tokenizer_max_length = self.max_sequence_length
        return pipe

    def text_pipeline(self, encoders: Any) -> HunyuanVideo15Pipeline:
        return self._lengths(_text_only(**encoders.parts))

    def load_pipeline(self) -> HunyuanVideo15Pipeline:
        """The stock pipeline; classifier-free guidance is its ``guider`` component: the folder's own, and
        none for the tiny flavor (sampling without it)."""
        guider = (ClassifierFreeGuidance.from_pretrained(self.cfg.path, subfolder="guider")
                  if self.cfg.flavor != "tiny" and (Path(self.cfg.path) / "guider").is_dir()
                  else ClassifierFreeGuidance(enabled=False))
        return self._lengths(HunyuanVideo15Pipeline(
            vae=self.load_vae(), transformer=self.load_denoiser(), scheduler=self.inference_scheduler(),
            guider=guider, **self.load_text_encoders().parts))

    # -- encoding ------------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """One clip at a time: the VAE's mid-block attention builds its causal mask as ``[B, L, L]``, which
        broadcasts against its one-head ``[B, 1, L, C]`` queries only for ``B = 1`` (diffusers 0.42.1)."""
        encode = super().encode_pixels
        return torch.cat([encode(vae, pixels[i : i + 1]) for i in range(pixels.shape[0])])

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        pipe = self.text_pipeline(encoders)
        with torch.no_grad():
            pe, mask, pe2, mask2 = pipe.encode_prompt(prompt=list(captions), device=pipe._execution_device,
                                                        dtype=torch.float32, batch_size=len(captions))
        return {"prompt_embeds": pe.float(), "prompt_embeds_mask": mask.float(),
                "prompt_embeds_2": pe2.float(), "prompt_embeds_mask_2": mask2.float()}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        # The Qwen tokens the pipeline keeps: the templated prompt's, less the cropped template prefix.
        chats = format_text_input(list(captions), _bare_pipeline().system_message)
        ids = [encoders.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in chats]
        return {"qwen": [len(getattr(x, "input_ids", x)) - CROP for x in ids]}

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs as the pipeline's text-to-video call: the noisy clip stacked with zero condition
        latents and a zero mask, ``sigma x 1000``, both text encoders' states and masks (the zero image
        embeddings are added in :meth:`predict`)."""
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        sigma = obj.shift_timesteps(t, o.shift or self.shift_for(x0))
        device, (b, _, f, h, w) = x0.device, x0.shape
        noisy = obj.flow_interpolate(x0, noise, sigma)
        inputs = {
            "hidden_states": torch.cat([noisy, torch.zeros_like(noisy), noisy.new_zeros(b, 1, f, h, w)], dim=1).to(dtype),
            "timestep": (sigma * self._scheduler_config.get("num_train_timesteps", 1000)).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_attention_mask": text["prompt_embeds_mask"].to(device=device, dtype=dtype),
            "encoder_hidden_states_2": text["prompt_embeds_2"].to(device=device, dtype=dtype),
            "encoder_attention_mask_2": text["prompt_embeds_mask_2"].to(device=device, dtype=dtype),
        }
        return Prepared(inputs, obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    def image_embeds(self, denoiser: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        """The pipeline's text-to-video image embeddings: zeros, its ``vision_num_semantic_tokens`` at the width of
        the denoiser's own image projection (the estimate runs a published one)."""
        width = common.unwrap(denoiser).config.image_embed_dim
        return hidden_states.new_zeros(hidden_states.shape[0], _bare_pipeline().vision_num_semantic_tokens, width)

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        inputs = prepared.inputs
        return denoiser(**inputs, image_embeds=self.image_embeds(denoiser, inputs["hidden_states"]),
                        return_dict=False)[0]
