"""Pixels to latents for the caches, and the latent geometry that follows from the VAE and the
denoiser's patches (the side multiple images are bucketed to)."""

from __future__ import annotations

from typing import ClassVar

import torch

from diffpipe.models import _common as common


class Media:
    """The VAE's side of a family (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The pipeline decodes ``latents / scaling_factor + shift_factor`` (True) or ``latents / scaling_factor``
    #: (False); the default ``encode_pixels`` is its inverse.
    vae_shift: ClassVar[bool] = False
    #: The VAE encodes each frame as an image (True) or a clip at once (a causal video VAE).
    vae_per_frame: ClassVar[bool] = True
    #: The denoiser's patch side; None: its config's ``patch_size`` (a family that packs 2x2 latents itself,
    #: whatever the config says, sets 2).
    patch: ClassVar[int | None] = None
    #: The least side multiple the stock pipeline accepts (some refuse sides not divisible by 16).
    min_pixel_multiple: ClassVar[int] = 1

    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """``[B,3,F,H,W]`` in [-1,1] -> normalised latents ``[B,C,F,h,w]`` (float32).

        By default the inverse of the pipeline's decode (``vae_shift``, ``vae_per_frame``);
        a family whose pipeline normalises otherwise (per-channel mean and std) overrides it.
        """
        latents = common.vae_latents(vae, pixels, per_frame=self.vae_per_frame)
        return common.scaled_latents(latents, vae, shift=self.vae_shift)

    def encode_control(self, vae: torch.nn.Module, control: torch.Tensor, *, frames: int) -> dict[str, torch.Tensor]:
        """Control images ``[B,3,1,H,W]`` in [-1,1] -> ``{"control": latents}`` for the cache.

        ``frames`` is the target clip's pixel frame count. A family may add
        ``control_embeds`` (an image encoder's embedding, ``[B, ...]``); both
        reach ``loss`` as its ``control`` and ``control_embeds`` arguments.
        """
        return {"control": self.encode_pixels(vae, control)}

    @property
    def vae_factor(self) -> int:
        """The VAE's spatial downsampling, from its config as the stock pipelines compute it."""
        c = self._vae_config
        if c.get("spatial_compression_ratio"):
            return int(c["spatial_compression_ratio"])
        if "temperal_downsample" in c:  # the Wan-style VAEs (diffusers' spelling)
            return 2 ** len(c["temperal_downsample"])
        return 2 ** (len(c.get("block_out_channels") or c["encoder_block_out_channels"]) - 1)

    @property
    def patch_size(self) -> int:
        """The denoiser's spatial patch side (``patch``, else its config's last ``patch_size`` entry)."""
        if self.patch is not None:
            return self.patch
        size = self._denoiser_config.get("patch_size", 1)
        return int(size[-1] if isinstance(size, (list, tuple)) else size)

    @property
    def pixel_multiple(self) -> int:
        """Image sides must be multiples of this (VAE factor x patch size)."""
        return max(self.vae_factor * self.patch_size, self.min_pixel_multiple)
