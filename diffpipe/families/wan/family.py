"""Family ``wan``: Wan 2.1 and 2.2 text-to-video (3-D DiT), flow matching, UMT5 text.

Components and names follow ``WanPipeline``: ``vae`` (AutoencoderKLWan: causal
3-D VAE, 4x temporal compression, so clips have ``4k+1`` frames; latents
normalised by per-channel ``latents_mean`` / ``latents_std`` exactly as the
pipeline undoes them before decoding), ``text_encoder`` (UMT5EncoderModel;
embeddings past each prompt's length are zeros, padded to
``max_sequence_length``) + ``tokenizer``, ``transformer``
(WanTransformer3DModel, fed ``timestep = sigma * 1000``), ``scheduler``
(UniPC with flow sigmas and ``flow_shift``). Images train as single-frame
clips. Clips are resampled to 16 fps.

Variants (``model.variant``; a local folder's is read from it) are declared in
:mod:`diffpipe.families.wan.variants`: Wan 2.1 T2V (``2.1``), I2V (``2.1-i2v``) and FLF2V
(``2.1-flf2v``), Wan 2.2 TI2V-5B (``2.2-5b``, image-conditioned ``2.2-5b-i2v``) and the A14B
experts (``2.2-a14b``, ``2.2-i2v-a14b``). One class trains them all from the variant's flags;
the image conditioning is :mod:`diffpipe.families.wan.i2v`'s, the experts'
:mod:`diffpipe.families.wan.experts`'.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import diffusers
import torch
from diffusers import (
    AutoencoderKLWan,
    UniPCMultistepScheduler,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel

from diffpipe.config import ObjectiveConfig, SampleConfig
from diffpipe.families.wan import i2v as wan_i2v
from diffpipe.families.wan.experts import BOTH_PARTS, EXPERT_ATTR, WanExperts, expert_range, keep_in_expert
from diffpipe.families.wan.flavors import TINY_UMT5
from diffpipe.families.wan.layers import ROUTED, wan_layers
from diffpipe.families.wan.variants import (  # VARIANTS, WanVariant, detect_variant: also imported from here
    CONDITIONING,
    EXPERT_VARIANTS,
    MAX_LENGTH,
    VARIANTS,
    WanVariant,
    detect_variant,
)
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import DenoiserPart, Family, Prepared
from diffpipe.models.components import TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.tokenizers import t5_tokenizer
from diffpipe.utils import digest

_tiny_umt5 = common.tiny_text_model(UMT5EncoderModel, UMT5Config, TINY_UMT5, "wan.text_encoder", common.T5_IDS)


class WanFamily(Family):
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {"umt5": ("tokenizer", "sequence")}
    vae_class = AutoencoderKLWan
    vae_needs_fp32 = True  # the Wan repos and diffusers examples run this causal 3D VAE in float32
    is_video = True
    fps = 16.0
    extra_single_files = ("transformer_2",)
    variants: ClassVar[tuple[str, ...]] = tuple(VARIANTS)
    #: The versions this family covers (the first is the default) and the transformer class they share;
    #: a family built on Wan's parts (``skyreels-v2``) declares its own.
    variant_table: ClassVar[dict[str, WanVariant]] = VARIANTS
    transformer_cls: ClassVar[type] = WanTransformer3DModel
    #: The model's name in messages.
    model_label: ClassVar[str] = "Wan"
    #: Self- and cross-attention projections and the feed-forward linears of every block
    #: (what Wan LoRA trainers target).
    default_lora_targets: ClassVar[list[str]] = [*targets.attention(""), *targets.feed_forward("ffn")]
    token_routing = ROUTED

    def __init__(self, cfg):
        super().__init__(cfg)
        found = self.detect_variant(cfg.path) if cfg.flavor == "local" else None
        mode_of = self.variant_table[cfg.variant].weights_of if cfg.variant in self.variant_table else None
        if found and cfg.variant and found not in (cfg.variant, mode_of):
            raise ValueError(f"model.variant {cfg.variant!r}: the folder {cfg.path} holds {self.model_label} {found}")
        self.variant = (cfg.variant if found and found == mode_of else found) or cfg.variant or next(
            iter(self.variant_table)
        )
        self.spec = self.variant_table[self.variant]
        #: The I2V variants train on control images (instance attributes: one variant of the family),
        #: FLF2V on a first and a last frame.
        self.uses_control = self.spec.image_to_video
        self.uses_last_frame = self.spec.last_frame
        self.expert: str | None = cfg.expert
        two = self.spec.boundary_ratio is not None
        if two and self.expert is None:
            raise ValueError(
                f"model.expert: Wan 2.2 A14B (variant {self.variant}) has two experts; set `high` (transformer, high-noise "
                "timesteps), `low` (transformer_2, low-noise timesteps) or `both` (a LoRA on each)"
            )
        if not two and self.expert is not None:
            raise ValueError(
                f"model.expert {self.expert!r}: only Wan 2.2 A14B (model.variant: {' or '.join(EXPERT_VARIANTS)}) "
                f"has experts; this model is {self.model_label} {self.variant}"
            )
        if "transformer_2" in cfg.single_files and not two:
            raise ValueError(f"model.single_files.transformer_2: only Wan 2.2 A14B has one; this model is {self.model_label} {self.variant}")

    @staticmethod
    def detect_variant(path: str | Path) -> str | None:
        """The version a local folder holds (None: the configured or default one)."""
        return detect_variant(path)

    # -- what differs between versions ------------------------------------------
    @property
    def denoiser_attr(self) -> str:
        # ``both``: the high-noise expert's folder stands for the (identical) architecture of the two.
        return EXPERT_ATTR[self.expert] if self.expert else "transformer"

    @property
    def denoiser_parts(self) -> tuple[DenoiserPart, ...]:
        return BOTH_PARTS if self.expert == "both" else super().denoiser_parts

    @property
    def lora_load_kwargs(self) -> dict[str, Any]:
        # diffusers' Wan LoRA files always say ``transformer.``; this flag routes one into the low expert.
        return {"load_into_transformer_2": True} if self.expert == "low" else {}

    @cached_property
    def _index(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return {"boundary_ratio": self.spec.boundary_ratio, "expand_timesteps": self.spec.expand_timesteps}
        f = Path(self.cfg.path) / "model_index.json"
        index = json.loads(f.read_text()) if f.is_file() else {}
        return {
            "boundary_ratio": index.get("boundary_ratio", self.spec.boundary_ratio),
            "expand_timesteps": bool(index.get("expand_timesteps", self.spec.expand_timesteps)),
        }

    @property
    def boundary_ratio(self) -> float | None:
        return self._index["boundary_ratio"]

    @property
    def expand_timesteps(self) -> bool:
        return self._index["expand_timesteps"]

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return (
            dict(self.spec.vae)
            if self.cfg.flavor == "tiny"
            else dict(AutoencoderKLWan.load_config(self.cfg.path, subfolder="vae"))
        )

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        if self.cfg.flavor == "tiny":
            return {
                "_class_name": "UniPCMultistepScheduler",
                "num_train_timesteps": 1000,
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "flow_shift": self.spec.flow_shift,
            }
        return dict(UniPCMultistepScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    def _seed(self, component: str) -> str:
        return f"{self.spec.seed_prefix}.{component}"

    @property
    def frame_rule(self) -> tuple[int, int]:
        """``(step, offset)``: the VAE keeps one key frame and compresses time by ``step``."""
        return 2 ** sum(bool(x) for x in self._vae_config["temperal_downsample"]), 1

    @property
    def pixel_multiple(self) -> int:
        c = self._vae_config
        spatial = c.get("scale_factor_spatial") or 2 ** len(c["temperal_downsample"])
        return int(spatial) * 2  # VAE x the 2x2 patches

    @property
    def flow_shift(self) -> float:
        c = self._scheduler_config
        return float(c.get("flow_shift", c.get("shift", 1.0)))

    @property
    def prompt_tokens(self) -> tuple[int, int]:  # type: ignore[override]
        """The variant's tiny length, or the pipeline's 512 (less if the tokenizer says so)."""
        return self.spec.text_length, MAX_LENGTH

    @property
    def text_parts(self) -> dict[str, TextPart]:
        return {"tokenizer": Tokenizer(AutoTokenizer, lambda: t5_tokenizer(self.spec.text_length)),
                "text_encoder": TextEncoder(UMT5EncoderModel, UMT5Config, _tiny_umt5)}

    # -- components ------------------------------------------------------------
    # The VAE and transformers are the variant's (``self.spec``: tiny configs and seed names per
    # version), so they are built here rather than declared; the text side is declared (text_parts).
    def load_vae(self) -> AutoencoderKLWan:
        if self.cfg.flavor == "tiny":
            with common.seeded(self.cfg.seed, self._seed("vae")):
                return AutoencoderKLWan(**self.spec.vae).eval()
        return common.local_component(AutoencoderKLWan, self.cfg, "vae", self.vae_dtype())

    def _load_transformer(self, attr: str) -> WanTransformer3DModel:
        if self.cfg.flavor == "tiny":
            with common.seeded(self.cfg.seed, self._seed(attr)):
                model = self.transformer_cls(**self.spec.transformer).eval()
                image = getattr(model.condition_embedder, "image_embedder", None)  # Helios' has none
                if image is not None and image.pos_embed is not None:
                    # zeros from the constructor: filled so the first and the last frame differ in position
                    torch.nn.init.normal_(image.pos_embed.data, std=0.5)
                return model
        return common.local_component(self.transformer_cls, self.cfg, attr)

    def load_denoiser(self) -> WanTransformer3DModel | WanExperts:
        """The trained transformer: the only one, the expert ``model.expert`` names, or both experts."""
        if self.expert == "both":
            boundary = self.boundary_ratio * self._scheduler_config.get("num_train_timesteps", 1000)
            return WanExperts(self._load_transformer("transformer"), self._load_transformer("transformer_2"), boundary)
        return self._load_transformer(self.denoiser_attr)

    def streamed_denoiser(self) -> tuple[type, str] | None:
        """One expert (or Wan 2.1's one transformer) streams as the plain model of its folder; both experts
        together load whole."""
        return None if self.expert == "both" else (self.transformer_cls, self.denoiser_attr)

    def inference_scheduler(self):
        c = self._scheduler_config
        return getattr(diffusers, c.get("_class_name", "UniPCMultistepScheduler")).from_config(c)

    def load_image_encoder(self):
        """Wan 2.1 I2V's CLIP vision encoder and its image processor."""
        if not self.spec.image_embeds:
            raise ValueError(f"{self.model_label} {self.variant} has no image encoder")
        if self.cfg.flavor == "tiny":
            return wan_i2v.tiny_image_encoder(self.cfg.seed, self.spec.seed_prefix)
        return wan_i2v.load_image_encoder(self.cfg.path, self.cfg.weight_variant)

    @cached_property
    def _image_encoder(self):
        return self.load_image_encoder()

    def load_pipeline(self) -> WanPipeline | WanImageToVideoPipeline:
        enc = self.load_text_encoders()
        two = self.boundary_ratio is not None
        parts = {
            "tokenizer": enc.tokenizer,
            "text_encoder": enc.text_encoder,
            "vae": self.load_vae(),
            "scheduler": self.inference_scheduler(),
            "transformer": self._load_transformer("transformer"),
            "transformer_2": self._load_transformer("transformer_2") if two else None,
            "boundary_ratio": self.boundary_ratio,
            "expand_timesteps": self.expand_timesteps,
        }
        if self.spec.image_embeds:
            encoder, processor = self.load_image_encoder()
            parts.update(image_encoder=encoder, image_processor=processor)
        return self.pipeline_class(**parts)

    @property
    def pipeline_class(self) -> type:
        return WanImageToVideoPipeline if self.spec.image_to_video else WanPipeline

    # -- identities ------------------------------------------------------------
    def vae_weights_identity(self) -> str:
        """The latent cache's identity: the VAE, plus the image encoder that embeds I2V controls."""
        if self.spec.image_embeds:
            return wan_i2v.latent_identity(self)
        if self.cfg.flavor == "tiny":  # the memo key names the variant: its VAE differs
            return common.memo_identity(
                (self.name, self.variant, self.cfg.seed, "vae"), lambda: digest(common.module_identity(self.load_vae()))
            )
        return super().vae_weights_identity()

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        # The causal 3-D VAE encodes a clip at once: [B,3,F,H,W] -> [B,C,(F-1)/4+1,h,w]. Inverse of
        # WanPipeline's decode: ``latents * std + mean``.
        latents = common.vae_latents(vae, pixels, per_frame=False)
        mean, std = common.latent_stats(vae, latents)
        return (latents - mean) / std

    def encode_control(self, vae: torch.nn.Module, control: torch.Tensor, *, frames: int) -> dict[str, torch.Tensor]:
        """I2V: the first frame + black frames (+ the last frame, FLF2V) through the VAE (and, Wan 2.1,
        the frames' CLIP hidden states)."""
        if not self.spec.image_to_video:
            return super().encode_control(vae, control, frames=frames)
        if self.expand_timesteps:  # TI2V-5B: the image alone, as a one-frame clip
            return {"control": self.encode_pixels(vae, control[:, :, :1])}
        wan_i2v.check_control_frames(control.shape[2], last=self.spec.last_frame,
                                     model=f"{self.model_label} {self.variant}")
        out = {"control": self.encode_pixels(vae, wan_i2v.condition_video(control, frames))}
        if self.spec.image_embeds:
            encoder, processor = self._image_encoder
            encoder.to(control.device)
            out["control_embeds"] = wan_i2v.embed_controls(encoder, processor, control)
        return out

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly WanPipeline._get_t5_prompt_embeds: zeros past each prompt's tokens.
        length = encoders.max_sequence_length
        tok = encoders.tokenizer(
            self.caption_prompts(captions),
            padding="max_length",
            max_length=length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            hidden = encoders.text_encoder(tok.input_ids.to(device), tok.attention_mask.to(device)).last_hidden_state
        keep = tok.attention_mask.to(device).gt(0)
        return {"prompt_embeds": (hidden.float() * keep[..., None]).float()}

    def caption_prompts(self, captions: list[str]) -> list[str]:
        return [prompt_clean(c) for c in captions]

    # -- training ----------------------------------------------------------------
    def expert_range(self, shift: float) -> tuple[float, float]:
        """The trained expert's timestep range ``[lo, hi)`` as fractions before the shift ((0, 1): all)."""
        return expert_range(self.expert, self.boundary_ratio, shift)

    def _sigmas(self, o: ObjectiveConfig, b: int, generator: torch.Generator, t: torch.Tensor | None,
                shift: float | None = None) -> torch.Tensor:
        """Shifted training fractions: drawn (or the given ``t``, read as quantiles of the trained range);
        ``shift``: the pipeline's at this clip size (default: the scheduler's fixed ``flow_shift``)."""
        shift = o.shift or shift or self.flow_shift
        lo, hi = self.expert_range(shift)
        if t is None:
            if o.timestep_sampling == "uniform":
                t = obj.sample_uniform(b, generator, device=generator.device)
            else:
                t = obj.sample_logit_normal(b, generator, mean=o.logit_mean, std=o.logit_std, device=generator.device)
            ulo, uhi = max(lo, o.min_timestep), min(hi, o.max_timestep)
            if ulo >= uhi:
                raise ValueError(
                    f"train.objective min_timestep/max_timestep [{o.min_timestep}, {o.max_timestep}] do not "
                    f"overlap the {self.expert} expert's range [{lo:.4f}, {hi:.4f}) (model.expert, boundary_ratio "
                    f"{self.boundary_ratio}, shift {shift}); widen them or train the other expert"
                )
            t = obj.limit_timesteps(t, ulo, uhi)
        elif self.expert in ("high", "low"):
            t = obj.limit_timesteps(t, lo, hi)
        return keep_in_expert(obj.shift_timesteps(t.float(), shift), self.expert, self.boundary_ratio)

    def _clip_sigmas(self, o: ObjectiveConfig, x0: torch.Tensor, generator: torch.Generator,
                     t: torch.Tensor | None) -> torch.Tensor:
        """The noise levels of a batch of clips: one per clip ``[B]`` (a family with per-frame levels overrides)."""
        return self._sigmas(o, x0.shape[0], generator, t)

    def _draw(self, latents, generator, t, noise, o):
        x0 = latents.float()
        if x0.ndim != 5:
            raise ValueError(f"family 'wan' trains on [B,C,F,h,w] latents, got {tuple(x0.shape)}")
        device = x0.device
        # Draw order is fixed (t, then noise) so a seeded generator replays a run.
        sigma = self._clip_sigmas(o, x0, generator, t)
        if noise is None:
            noise = torch.randn(x0.shape, generator=generator, device=generator.device)
        elif noise.ndim == 4:  # an image's noise without its frame axis
            noise = noise[:, :, None]
        return x0, sigma.to(device), noise.to(device).float()

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None,
                control_embeds: torch.Tensor | None = None) -> Prepared:
        """Flow-matching inputs; the I2V variants add their first-frame condition as the pipeline does.

        ``timestep`` is what the pipeline passes, ``sigma x 1000`` per sample (:meth:`predict`
        expands it per latent token under ``expand_timesteps``). ``control`` (condition latents,
        like ``latents``) and ``control_embeds`` (CLIP hidden states) are the cached control of
        each item (I2V only; ``control_embeds`` 2.1-i2v only).
        """
        if self.spec.image_to_video and (control is None or (self.spec.image_embeds and control_embeds is None)):
            raise wan_i2v.missing_control(self.variant, last=self.spec.last_frame)
        o = objective
        x0, sigma, noise = self._draw(latents, generator, t, noise, o)
        noisy = obj.flow_interpolate(x0, noise, sigma)
        weights = self.loss_mask(mask, x0, o)
        first_clean = self.spec.image_to_video and self.expand_timesteps
        if self.spec.image_to_video:
            noisy, weights = wan_i2v.condition(noisy, x0, control, weights, first_clean=first_clean,
                                               temporal=self.frame_rule[0], last=self.spec.last_frame)
        inputs = {
            "hidden_states": noisy.to(dtype),
            "timestep": sigma * self._scheduler_config.get("num_train_timesteps", 1000),
            "encoder_hidden_states": text["prompt_embeds"].to(device=x0.device, dtype=dtype),
        }
        if self.spec.image_embeds:
            inputs["encoder_hidden_states_image"] = wan_i2v.image_states(control_embeds).to(device=x0.device, dtype=dtype)
        return Prepared(inputs, obj.flow_target(x0, noise), mask=weights, extra={"first_clean": first_clean})

    @property
    def published_variants(self) -> tuple[str | None, ...]:
        return (self.variant, self.spec.weights_of)

    def sizes(self, published) -> bool:
        """A published Wan transformer of the same conditioning (first frame, image embedding, last frame, clean
        first latent frame) takes this variant's inputs: T2V-A14B's expert sizes Wan 2.1 T2V 14B, say; and a
        variant that trains other weights in another mode (TI2V-5B's image-conditioned mode) takes those."""
        theirs = self.variant_table.get(published.variant)
        if theirs is None or published.variant in self.published_variants:  # these weights, in any mode
            return True
        return all(getattr(theirs, k) == getattr(self.spec, k) for k in CONDITIONING)

    def estimate_controls(self, latents: torch.Tensor, denoiser: torch.nn.Module,
                          references: int = 1) -> dict[str, torch.Tensor]:
        """Condition latents like the target and, for an image embedder, CLIP states of its width: 257 tokens
        (CLIP ViT-H/14 at 224 px) a frame, or the pair its position embedding covers (FLF2V)."""
        out = super().estimate_controls(latents, denoiser, references)
        embeds = wan_i2v.estimate_embeds(latents, common.unwrap(denoiser).config)
        if embeds is not None:
            out["control_embeds"] = embeds
        return out

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward, with a timestep per latent token under ``expand_timesteps`` (as the pipeline)."""
        inputs = prepared.inputs
        if self.expand_timesteps:
            pt, ph, pw = common.unwrap(denoiser).config.patch_size
            b, _, f, h, w = prepared.target.shape
            per_frame = (h // ph) * (w // pw)
            t = inputs["timestep"][:, None].expand(b, (f // pt) * per_frame)
            if prepared.extra.get("first_clean"):  # the clean first frame's tokens at timestep 0
                t = wan_i2v.first_frame_timesteps(inputs["timestep"], f // pt, per_frame)
            inputs = {**inputs, "timestep": t}
        return denoiser(**inputs, return_dict=False)[0]

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``)."""
        if self.spec.image_to_video:
            raise ValueError(f"{self.name} {self.variant}: pipeline parallelism is not implemented; set "
                             "train.pipeline_stages: 1")
        if self.expert == "both":
            raise ValueError(
                "model.expert both: pipeline parallelism splits one transformer, not two experts chosen per "
                "sample; set train.pipeline_stages: 1 (or train one expert per run)"
            )
        return wan_layers(common.unwrap(denoiser), expand_timesteps=self.expand_timesteps)

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        wan_i2v.check_sample_images(cfg.images, cfg.last_images, first=self.spec.image_to_video,
                                    last=self.spec.last_frame, model=f"{self.model_label} {self.variant}")
        return {
            **super().sample_kwargs(cfg),
            "max_sequence_length": self.max_sequence_length,
        }
