"""Family ``ltxvideo``: LTX-Video text-to-video (DiT on a 32x-compressed latent), flow matching, T5.

Components and names follow ``LTXPipeline``: ``vae`` (AutoencoderKLLTXVideo:
causal 3-D VAE, 32x spatial and 8x temporal compression at full size, so clips
have ``8k+1`` frames; latents normalised by the VAE's ``latents_mean`` /
``latents_std`` buffers and ``scaling_factor`` exactly as the pipeline's
``_normalize_latents``), ``text_encoder`` (T5EncoderModel, sequence output;
the padding mask is cached as ``prompt_attention_mask``) + ``tokenizer``,
``transformer`` (LTXVideoTransformer3DModel on latents packed into tokens by
the pipeline's own ``_pack_latents``, fed ``timestep = sigma * 1000``, rotary
positions scaled by ``(temporal compression / frame rate, spatial, spatial)``),
``scheduler`` (FlowMatchEulerDiscreteScheduler with a resolution-dependent
shift: training shifts ``t`` by ``exp(mu)`` for the clip's token count, as the
pipeline's sampling does). Clips are resampled to 25 fps (``LTXPipeline``'s
default ``frame_rate``, also fed to the rotary positions).

Default LoRA targets: the self- and cross-attention projections (``to_q``,
``to_k``, ``to_v``, ``to_out.0``) and the feed-forward linears
(``ff.net.0.proj``, ``ff.net.2``) of every transformer block. Samples need
sides that are multiples of 32 (``LTXPipeline.check_inputs``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel

from diffpipe.config import SampleConfig
from diffpipe.families.ltxvideo import flavors
from diffpipe.families.ltxvideo.layers import ltx_layers
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models

MAX_LENGTH = 128  # LTXPipeline's default max_sequence_length


class LTXGeometry:
    """What LTX-Video and LTX-2 share: a causal VAE whose config gives its compression (so clips have
    ``temporal k + 1`` frames), latents normalised as the pipeline's ``_normalize_latents``."""

    @property
    def compression(self) -> tuple[int, int]:
        """``(temporal, spatial)`` compression of the VAE, computed as the VAE computes it."""
        c = self._vae_config
        scalings = sum(bool(x) for x in c.get("spatio_temporal_scaling", (True, True, True, False)))
        temporal = c.get("temporal_compression_ratio") or c.get("patch_size_t", 1) * 2**scalings
        spatial = c.get("spatial_compression_ratio") or c.get("patch_size", 4) * 2**scalings
        return int(temporal), int(spatial)

    @property
    def frame_rule(self) -> tuple[int, int]:
        return self.compression[0], 1  # one key frame plus groups of 8 (full size)

    @property
    def pixel_multiple(self) -> int:
        return self.compression[1] * int(self._denoiser_config.get("patch_size", 1))

    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        latents = common.vae_latents(vae, pixels, per_frame=False)
        return self.pipeline_class._normalize_latents(
            latents, vae.latents_mean.float(), vae.latents_std.float(), vae.config.scaling_factor
        )


class LTXVideoFamily(LTXGeometry, video.T5TextFamily, Family):
    prompt_tokens = (video.TINY_LENGTH, MAX_LENGTH)
    models = Models(AutoencoderKLLTXVideo, LTXVideoTransformer3DModel, FlowMatchEulerDiscreteScheduler, LTXPipeline,
                    flavors)
    is_video = True
    fps = 25.0
    default_lora_targets: ClassVar[list[str]] = [*targets.attention(""), *targets.feed_forward()]

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: video.T5Text, captions: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = video.t5_embeds(encoders, captions, masked_encoder=False)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Packed flow-matching inputs, the text and its mask, the packed grid and the rope scale.

        The grid and scale are plain numbers (from shapes, not tensors): the loss also runs on the
        meta device (estimate); :meth:`layer_inputs` makes them tensors.
        """
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        _, _, f, h, w = x0.shape
        sigma = obj.shift_timesteps(t, o.shift or self.timestep_shift(f * h * w))
        c = self._denoiser_config
        p, pt = int(c.get("patch_size", 1)), int(c.get("patch_size_t", 1))

        def pack(x: torch.Tensor) -> torch.Tensor:
            return LTXPipeline._pack_latents(x, p, pt)

        temporal, spatial = self.compression
        device = x0.device
        inputs = {
            "hidden_states": pack(obj.flow_interpolate(x0, noise, sigma)).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "timestep": sigma * self._scheduler_config.get("num_train_timesteps", 1000),  # the scheduler's
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device),
            "num_frames": f // pt,
            "height": h // p,
            "width": w // p,
            "rope_interpolation_scale": (temporal / self.fps, spatial, spatial),
        }
        return Prepared(inputs, pack(obj.flow_target(x0, noise)), mask=self.loss_mask(mask, x0, o, pack))

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(packed noisy, prompt_embeds, sigma * 1000, text mask, (F, h, w), rope scale)``."""
        i = prepared.inputs
        device = i["hidden_states"].device
        return (i["hidden_states"], i["encoder_hidden_states"], i["timestep"], i["encoder_attention_mask"],
                torch.tensor([i["num_frames"], i["height"], i["width"]], device=device),
                torch.tensor(i["rope_interpolation_scale"], device=device))

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {
            **super().sample_kwargs(cfg),
            "frame_rate": int(self.fps),
            "max_sequence_length": self.load_tokenizers().max_sequence_length,
        }

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per transformer block, output (``layers.py``).

        Input tuple ``(packed noisy, prompt_embeds, sigma * 1000, text mask, (F, h, w), rope scale)``;
        output ``(packed prediction,)``.
        """
        return ltx_layers(common.unwrap(denoiser))
