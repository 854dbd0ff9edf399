"""Family ``helios``: Helios (Base), a long-video model generating 33-frame chunks after a history of latents.

``HeliosPipeline`` runs Wan 2.1's parts: the UMT5 text encoder (captions encoded exactly as Wan's),
the causal 3-D VAE (latents normalised by its per-channel statistics), and
``HeliosTransformer3DModel``, Wan's 14B transformer with three more patch embeddings that read a
history of earlier latents (long: 16 frames at a coarse patch, mid: 2, short: the first frame's latent
and the last one) beside the chunk being denoised. It samples chunk by chunk: each chunk is 9 latent
frames (33 video frames), denoised from noise with the history of the chunks before it.

What is trained: the first chunk of every video, as the pipeline generates it when it starts from text:
every history latent is zero (the first frame's too), with the pipeline's frame indices for the history
and the chunk, the history at timestep 0. Each clip is that chunk: its latent frames after the history
indices, noised at one level (``sigma x 1000``), the target the velocity ``noise - x0``. Later chunks,
whose history holds earlier latents of the same video, are not trained (each chunk is encoded by the VAE
on its own at sampling; the cache encodes a clip at once). The LoRA applies to every chunk the pipeline
generates. Helios-Mid and -Distilled (the pyramid pipeline) are not this family.

The shift is the pipeline's: with ``use_dynamic_shifting`` its sigmas are shifted by ``exp(mu)``, ``mu``
from the token count of a 9-latent-frame chunk at the clip's size; without it, the pipeline passes its own
unshifted sigmas.
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import HeliosPipeline, HeliosScheduler, HeliosTransformer3DModel
from diffusers.pipelines.helios.pipeline_helios import calculate_shift

from diffpipe.families.helios.flavors import TINY_SCHEDULER, TINY_TRANSFORMER
from diffpipe.families.helios.layers import helios_layers
from diffpipe.families.wan.family import WanFamily, WanVariant
from diffpipe.families.wan.flavors import TINY_VAE
from diffpipe.models import _common as common
from diffpipe.models.base import Prepared

#: The pipeline's defaults: history windows (long, mid, the last frame), latent frames per chunk.
HISTORY_SIZES = (16, 2, 1)
CHUNK_LATENT_FRAMES = 9

VARIANTS = {"base": WanVariant(TINY_VAE, TINY_TRANSFORMER, 1.0, seed_prefix="helios")}


def first_chunk_history(batch: int, channels: int, frames: int, height: int, width: int, *,
                        dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """The transformer's history inputs for a video's first chunk of ``frames`` latent frames, as
    ``HeliosPipeline`` builds them starting from text (``keep_first_frame``): zero latents, and the frame
    indices ``[prefix | long | mid | last | chunk]`` split as it splits them."""
    long, mid, last = HISTORY_SIZES
    indices = torch.arange(1 + long + mid + last + frames, device=device)
    prefix, i_long, i_mid, i_last, i_chunk = indices.split([1, long, mid, last, frames])

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(batch, channels, n, height, width, dtype=dtype, device=device)

    return {
        "indices_hidden_states": i_chunk[None],
        "indices_latents_history_short": torch.cat([prefix, i_last])[None],
        "indices_latents_history_mid": i_mid[None],
        "indices_latents_history_long": i_long[None],
        "latents_history_short": zeros(1 + last),
        "latents_history_mid": zeros(mid),
        "latents_history_long": zeros(long),
    }


class HeliosFamily(WanFamily):
    fps = 24.0
    variants: ClassVar[tuple[str, ...]] = ()
    variant_table = VARIANTS
    transformer_cls = HeliosTransformer3DModel
    model_label = "Helios"
    extra_single_files = ()
    pipeline_class = HeliosPipeline
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (the chunk, its history windows and the timestep modulation), one layer per block,
        output (``layers.py``). Input tuple: ``prepared.inputs`` in order (Wan's, then the history's)."""
        return helios_layers(common.unwrap(denoiser))

    @staticmethod
    def detect_variant(path: str | Path) -> str | None:
        return None  # one kind of checkpoint

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:  # read once: every training step's shift reads it
        if self.cfg.flavor == "tiny":
            return dict(TINY_SCHEDULER)
        return dict(HeliosScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    def inference_scheduler(self) -> HeliosScheduler:
        return getattr(diffusers, self._scheduler_config.get("_class_name", "HeliosScheduler")).from_config(
            self._scheduler_config)

    @property
    def flow_shift(self) -> float:
        return 1.0  # the pipeline passes its own sigmas: a fixed ``shift`` in the config is never applied

    @cached_property
    def _transformer_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return dict(self.spec.transformer)
        return dict(HeliosTransformer3DModel.load_config(self.cfg.path, subfolder="transformer"))

    def chunk_shift(self, height: int, width: int) -> float:
        """The pipeline's shift for a chunk on a ``height x width`` latent grid (see the module docstring)."""
        c = self._scheduler_config
        if not c.get("use_dynamic_shifting"):
            return 1.0
        _, ph, pw = self._transformer_config.get("patch_size", (1, 2, 2))
        tokens = CHUNK_LATENT_FRAMES * height * width // (ph * pw)
        mu = calculate_shift(tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        return math.exp(mu) if c.get("time_shift_type", "exponential") == "exponential" else mu

    def _clip_sigmas(self, o, x0: torch.Tensor, generator: torch.Generator, t: torch.Tensor | None) -> torch.Tensor:
        return self._sigmas(o, x0.shape[0], generator, t, shift=self.chunk_shift(*x0.shape[-2:]))

    def load_pipeline(self) -> HeliosPipeline:
        enc = self.load_text_encoders()
        return HeliosPipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, vae=self.load_vae(),
                              scheduler=self.inference_scheduler(), transformer=self._load_transformer("transformer"))

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None,
                control_embeds: torch.Tensor | None = None) -> Prepared:
        """Wan's text-to-video inputs plus the first chunk's zero history and frame indices."""
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype)
        b, c, f, h, w = p.inputs["hidden_states"].shape
        history = first_chunk_history(b, c, f, h, w, dtype=dtype, device=p.inputs["hidden_states"].device)
        return Prepared({**p.inputs, **history}, p.target, weights=p.weights, mask=p.mask, extra=p.extra)
