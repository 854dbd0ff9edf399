"""Family ``cogvideox``: CogVideoX text-to-video (expert DiT), v-prediction DDPM, T5.

Components and names follow ``CogVideoXPipeline``: ``vae``
(AutoencoderKLCogVideoX: 8x spatial, 4x temporal compression, so clips have
``4k+1`` frames; latents times ``scaling_factor``, as the pipeline divides
before decoding), ``text_encoder`` (T5EncoderModel, sequence output, padded
to 226 tokens) + ``tokenizer``, ``transformer``
(CogVideoXTransformer3DModel, frames-first ``[B,F,C,h,w]``; 3-D rotary
positions computed as the pipeline computes them when the model uses them),
``scheduler`` (CogVideoXDDIMScheduler / CogVideoXDPMScheduler). Training is
the DDPM objective CogVideoX was trained with: integer steps drawn uniformly,
``x_t = sqrt(a) x0 + sqrt(1 - a) noise`` on the scheduler's own
``alphas_cumprod`` (scaled-linear betas, SNR shift ``snr_shift_scale``,
zero terminal SNR), the target its ``prediction_type`` (``v_prediction``:
``v = sqrt(a) noise - sqrt(1 - a) x0``); Min-SNR weighting on request. Clips
are resampled to 8 fps (CogVideoX 1.0's rate; 49 frames = 6 s). CogVideoX 1.5
(temporal patches of 2) takes ``8k+5`` frames, an even latent count.

Default LoRA targets: the attention projections (``attn1.to_q``, ``attn1.to_k``,
``attn1.to_v``, ``attn1.to_out.0``) and feed-forward linears (``ff.net.0.proj``,
``ff.net.2``) of every block. Samples decode an odd latent frame count best
(9, 17, ... 49 frames): the VAE doubles every latent frame after the first
of an odd count.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline, CogVideoXTransformer3DModel
from diffusers.models.embeddings import get_3d_rotary_pos_embed
from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

from diffpipe.config import SampleConfig
from diffpipe.families.cogvideox import flavors
from diffpipe.families.cogvideox.layers import cogvideox_layers
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import targets
from diffpipe.models._draws import ddpm_parts
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models

MAX_LENGTH = 226  # CogVideoXPipeline's max_sequence_length (the transformer's max_text_seq_length)


class CogVideoXFamily(video.T5TextFamily, Family):
    vae_per_frame = False
    prompt_tokens = (video.TINY_LENGTH, MAX_LENGTH)
    models = Models(AutoencoderKLCogVideoX, CogVideoXTransformer3DModel, CogVideoXDDIMScheduler, CogVideoXPipeline,
                    flavors)
    is_video = True
    fps = 8.0
    default_lora_targets: ClassVar[list[str]] = [*targets.attention("attn1"), *targets.feed_forward()]

    # -- configs and geometry ------------------------------------------------------
    @property
    def frame_rule(self) -> tuple[int, int]:
        """``(4, 1)``; with temporal patches ``p_t`` the latent count must divide by it: ``(4 p_t, 4 p_t - 3)``."""
        ratio = int(self._vae_config.get("temporal_compression_ratio", 4))
        pt = self._denoiser_config.get("patch_size_t") or 1
        return ratio * pt, 1 + ratio * (pt - 1)

    @property
    def prediction_type(self) -> str:
        return self._scheduler_config.get("prediction_type", "v_prediction")

    @cached_property
    def _alphas_cumprod(self) -> torch.Tensor:
        return self.inference_scheduler().alphas_cumprod.clone()

    # -- components --------------------------------------------------------------

    def inference_scheduler(self):
        c = self._scheduler_config
        return getattr(diffusers, c.get("_class_name", "CogVideoXDDIMScheduler")).from_config(c)

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: video.T5Text, captions: list[str]) -> dict[str, torch.Tensor]:
        return {"prompt_embeds": video.t5_embeds(encoders, captions, masked_encoder=False)[0]}

    # -- training ------------------------------------------------------------------
    def rotary_embeddings(self, frames: int, h: int, w: int, device, config=None):
        """``CogVideoXPipeline._prepare_rotary_positional_embeddings`` for a ``frames x h x w`` latent.

        ``(cos, sin)``, or None for a model with sin-cos positions; ``config``: the transformer's.
        """
        c = config or self._denoiser_config
        if not c.get("use_rotary_positional_embeddings", False):
            return None
        p, pt = int(c["patch_size"]), c.get("patch_size_t")
        grid = (h // p, w // p)
        base_w, base_h = int(c.get("sample_width", 90)) // p, int(c.get("sample_height", 60)) // p
        head = int(c.get("attention_head_dim", 64))
        if pt is None:  # CogVideoX 1.0
            crops = get_resize_crop_region_for_grid(grid, base_w, base_h)
            return get_3d_rotary_pos_embed(
                embed_dim=head, crops_coords=crops, grid_size=grid, temporal_size=frames, device=device
            )
        return get_3d_rotary_pos_embed(
            embed_dim=head,
            crops_coords=None,
            grid_size=grid,
            temporal_size=(frames + pt - 1) // pt,
            grid_type="slice",
            max_size=(base_h, base_w),
            device=device,
        )

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """DDPM inputs laid out as the model reads them (``[B,F,C,h,w]``), the text, the steps and the
        rotary embedding (None for sin-cos positions); Min-SNR ``weights``."""
        o = objective
        c = self._denoiser_config
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise, default="uniform")
        _, _, f, h, w = x0.shape
        pt = c.get("patch_size_t")
        if pt and f % pt:
            raise ValueError(
                f"family 'cogvideox': {f} latent frames do not divide into temporal patches of {pt}; "
                f"use clips of {self.frame_rule[0]}k+{self.frame_rule[1]} frames"
            )
        noisy, steps, target, weights = ddpm_parts(o, x0, noise, t, self._alphas_cumprod, self.prediction_type)
        inputs = {  # the model reads [B,F,C,h,w]
            "hidden_states": noisy.transpose(1, 2).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
            "timestep": steps,
            "image_rotary_emb": self.rotary_embeddings(f, h, w, x0.device, c),
        }
        return Prepared(inputs, target.transpose(1, 2), weights, self.loss_mask(mask, x0, o, lambda m: m.transpose(1, 2)))

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(noisy, prompt_embeds, steps, rope cos, rope sin)``, empty rope tensors for sin-cos positions."""
        i = prepared.inputs
        empty = torch.empty(0, device=i["hidden_states"].device)
        rope = i["image_rotary_emb"] or (empty, empty)
        return (i["hidden_states"], i["encoder_hidden_states"], i["timestep"], *rope)

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {
            **super().sample_kwargs(cfg),
            "max_sequence_length": self.max_sequence_length,
        }

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``).

        Input tuple ``(noisy [B,F,C,h,w], prompt_embeds, steps, rope cos, rope sin)`` (empty
        rope tensors for sin-cos positions); output ``(prediction [B,F,C,h,w],)``.
        """
        return cogvideox_layers(common.unwrap(denoiser))
