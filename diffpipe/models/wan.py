"""Family ``wan``: Wan 2.1 text-to-video (3-D DiT), flow matching, UMT5 text.

Components and names follow ``WanPipeline``: ``vae`` (AutoencoderKLWan: causal
3-D VAE, 8x spatial and 4x temporal compression, so clips have ``4k+1``
frames; latents normalised by per-channel ``latents_mean`` / ``latents_std``
exactly as the pipeline undoes them before decoding), ``text_encoder``
(UMT5EncoderModel; embeddings past each prompt's length are zeros, padded to
``max_sequence_length``) + ``tokenizer``, ``transformer``
(WanTransformer3DModel, fed ``timestep = sigma * 1000``), ``scheduler``
(Wan 2.1's UniPC with flow sigmas and ``flow_shift``). Images train as
single-frame clips. Clips are resampled to 16 fps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, PreTrainedTokenizerBase, UMT5Config, UMT5EncoderModel

from diffpipe.config import ObjectiveConfig, SampleConfig
from diffpipe.data.frames import snap_frames
from diffpipe.models import _common as common
from diffpipe.models.base import Family, register
from diffpipe.models.tokenizers import t5_tokenizer, tokenizer_fingerprint
from diffpipe.training import objectives as obj
from diffpipe.utils import digest

# -- tiny flavor configs (FIELD_NOTES) ---------------------------------------
TINY_VAE = {"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
            "temperal_downsample": [False, True, True]}
TINY_TRANSFORMER = {"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 12,
                    "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 256, "ffn_dim": 32,
                    "num_layers": 2, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                    "rope_max_seq_len": 32}
TINY_UMT5 = {"d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_heads": 4,
             "relative_attention_num_buckets": 8}
TINY_LENGTH = 32
# Wan2.1-T2V's scheduler: UniPC on flow-matching sigmas shifted by 3.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
                  "flow_shift": 3.0}
MAX_LENGTH = 512  # WanPipeline's default max_sequence_length


@dataclass
class WanText:
    tokenizer: PreTrainedTokenizerBase
    text_encoder: UMT5EncoderModel | None
    max_sequence_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> WanText:
        self.text_encoder.to(device=device, dtype=dtype)
        return self


def _tiny_umt5(tok: PreTrainedTokenizerBase, seed: int) -> UMT5EncoderModel:
    config = UMT5Config(**TINY_UMT5, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                        eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)
    with common.seeded(seed, "wan.text_encoder"):
        return UMT5EncoderModel(config).eval()


@register
class WanFamily(Family):
    name = "wan"
    vae_class = AutoencoderKLWan
    denoiser_name = "transformer"
    is_video = True
    fps = 16.0
    #: Self- and cross-attention projections and the feed-forward linears of every block
    #: (what Wan LoRA trainers target).
    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj",
                                                 "ffn.net.2"]

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return dict(TINY_VAE) if self.cfg.flavor == "tiny" else dict(
            AutoencoderKLWan.load_config(self.cfg.path, subfolder="vae"))

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return {"_class_name": "UniPCMultistepScheduler", **TINY_SCHEDULER}
        return dict(UniPCMultistepScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    @property
    def frame_rule(self) -> tuple[int, int]:
        """``(step, offset)``: the VAE keeps one key frame and compresses time by ``step``."""
        return 2 ** sum(bool(x) for x in self._vae_config["temperal_downsample"]), 1

    @property
    def pixel_multiple(self) -> int:
        return 2 ** len(self._vae_config["temperal_downsample"]) * 2  # VAE x the 2x2 patches

    @property
    def flow_shift(self) -> float:
        c = self._scheduler_config
        return float(c.get("flow_shift", c.get("shift", 1.0)))

    @cached_property
    def max_sequence_length(self) -> int:
        return self.load_tokenizers().max_sequence_length

    # -- components ------------------------------------------------------------
    def load_vae(self) -> AutoencoderKLWan:
        if self.cfg.flavor == "tiny":
            with common.seeded(self.cfg.seed, "wan.vae"):
                return AutoencoderKLWan(**TINY_VAE).eval()
        return AutoencoderKLWan.from_pretrained(self.cfg.path, subfolder="vae").eval()

    def load_tokenizers(self) -> WanText:
        if self.cfg.flavor == "tiny":
            return WanText(t5_tokenizer(TINY_LENGTH), None, TINY_LENGTH)
        tok = AutoTokenizer.from_pretrained(self.cfg.path, subfolder="tokenizer")
        return WanText(tok, None, min(int(tok.model_max_length), MAX_LENGTH))

    def load_text_encoders(self) -> WanText:
        enc = self.load_tokenizers()
        if self.cfg.flavor == "tiny":
            enc.text_encoder = _tiny_umt5(enc.tokenizer, self.cfg.seed)
        else:
            enc.text_encoder = UMT5EncoderModel.from_pretrained(self.cfg.path, subfolder="text_encoder").eval()
        return enc

    def load_denoiser(self) -> WanTransformer3DModel:
        if self.cfg.flavor == "tiny":
            with common.seeded(self.cfg.seed, "wan.transformer"):
                return WanTransformer3DModel(**TINY_TRANSFORMER).eval()
        return WanTransformer3DModel.from_pretrained(self.cfg.path, subfolder="transformer").eval()

    def inference_scheduler(self):
        c = self._scheduler_config
        return getattr(diffusers, c.get("_class_name", "UniPCMultistepScheduler")).from_config(c)

    def load_pipeline(self) -> WanPipeline:
        enc = self.load_text_encoders()
        return WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, vae=self.load_vae(),
                           scheduler=self.inference_scheduler(), transformer=self.load_denoiser())

    @property
    def pipeline_class(self) -> type:
        return WanPipeline

    # -- identities ------------------------------------------------------------
    def text_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity((self.name, self.cfg.seed, "text"),
                                        lambda: self._text_identity(self.load_text_encoders()))
        return digest({
            "tokenizer": tokenizer_fingerprint(self.load_tokenizers().tokenizer),
            "text_encoder": common.transformers_folder_identity(UMT5EncoderModel, UMT5Config, self.cfg.path,
                                                                "text_encoder"),
            "max_sequence_length": self.max_sequence_length,
        })

    @staticmethod
    def _text_identity(enc: WanText) -> str:
        return digest({"tokenizer": tokenizer_fingerprint(enc.tokenizer),
                       "text_encoder": common.module_identity(enc.text_encoder),
                       "max_sequence_length": enc.max_sequence_length})

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        # The causal 3-D VAE encodes a clip at once: [B,3,F,H,W] -> [B,C,(F-1)/4+1,h,w].
        param = next(vae.parameters())
        with torch.no_grad():
            latents = vae.encode(pixels.to(device=param.device, dtype=param.dtype)).latent_dist.mode().float()
        c = vae.config
        mean = torch.tensor(c.latents_mean, device=latents.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(c.latents_std, device=latents.device).view(1, -1, 1, 1, 1)
        # Inverse of WanPipeline's decode: ``latents * std + mean``.
        return (latents - mean) / std

    def encode_text(self, encoders: WanText, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly WanPipeline._get_t5_prompt_embeds: zeros past each prompt's tokens.
        length = encoders.max_sequence_length
        tok = encoders.tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=length,
                                 truncation=True, add_special_tokens=True, return_attention_mask=True,
                                 return_tensors="pt")
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            hidden = encoders.text_encoder(tok.input_ids.to(device), tok.attention_mask.to(device)).last_hidden_state
        keep = tok.attention_mask.to(device).gt(0)
        return {"prompt_embeds": (hidden.float() * keep[..., None]).float()}

    def token_limits(self, encoders: WanText) -> dict[str, int]:
        return {"umt5": encoders.max_sequence_length}

    def count_tokens(self, encoders: WanText, captions: list[str]) -> dict[str, list[int]]:
        return {"umt5": [len(x) for x in encoders.tokenizer([prompt_clean(c) for c in captions]).input_ids]}

    # -- training ----------------------------------------------------------------
    def loss(
        self,
        denoiser: torch.nn.Module,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        *,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        objective: ObjectiveConfig | None = None,
    ) -> torch.Tensor:
        o = objective or ObjectiveConfig()
        x0 = latents.float()
        if x0.ndim != 5:
            raise ValueError(f"family 'wan' trains on [B,C,F,h,w] latents, got {tuple(x0.shape)}")
        device, b = x0.device, x0.shape[0]
        # Draw order is fixed (t, then noise) so a seeded generator replays a run.
        if t is None:
            if o.timestep_sampling == "uniform":
                t = obj.sample_uniform(b, generator, device=generator.device)
            else:
                t = obj.sample_logit_normal(b, generator, mean=o.logit_mean, std=o.logit_std,
                                            device=generator.device)
            t = obj.limit_timesteps(t, o.min_timestep, o.max_timestep)
        if noise is None:
            noise = torch.randn(x0.shape, generator=generator, device=generator.device)
        elif noise.ndim == 4:  # an image's noise without its frame axis
            noise = noise[:, :, None]
        t, noise = t.to(device).float(), noise.to(device).float()

        sigma = obj.shift_timesteps(t, o.shift or self.flow_shift)
        noisy = obj.flow_interpolate(x0, noise, sigma)
        dtype = common.param_dtype(denoiser)
        pred = denoiser(
            hidden_states=noisy.to(dtype),
            # The pipeline passes the scheduler's timesteps: sigma x num_train_timesteps.
            timestep=sigma * self._scheduler_config.get("num_train_timesteps", 1000),
            encoder_hidden_states=text["prompt_embeds"].to(device=device, dtype=dtype),
            return_dict=False,
        )[0]
        return obj.per_sample_loss(pred, obj.flow_target(x0, noise), kind=o.loss, huber_c=o.huber_c)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        step, offset = self.frame_rule
        return {**super().sample_kwargs(cfg), "num_frames": max(offset, snap_frames(cfg.frames, step, offset)),
                "max_sequence_length": self.max_sequence_length, "output_type": "pil"}

