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

Variants (``model.variant``; a local folder's is read from it):

- ``2.1``: Wan 2.1 T2V (16-channel VAE, 8x spatial).
- ``2.2-5b``: Wan 2.2 TI2V-5B used text-to-video: the 48-channel VAE with 16x
  spatial compression (2x2 patchified inside the VAE) and ``expand_timesteps``:
  the transformer gets one timestep per latent token (``[B, seq]``).
- ``2.2-5b-i2v``: Wan 2.2 TI2V-5B's image-conditioned mode (the same
  weights; a TI2V-5B folder is accepted): each item's control image (its
  first frame) is cached as its one-frame latents; the transformer gets them
  as the clean first latent frame with timestep 0 on its tokens, as
  ``WanImageToVideoPipeline`` with ``expand_timesteps`` does, and the loss
  leaves that frame out (the pipeline keeps the image's latents there).
  One-frame items (images) therefore add no loss in this mode.
- ``2.2-a14b``: Wan 2.2 T2V-A14B, two experts: ``transformer`` denoises while
  the scheduler timestep is at or above ``boundary_ratio x 1000`` (high
  noise), ``transformer_2`` below it (low noise). ``model.expert`` picks the
  one trained (``high`` or ``low``); its timesteps are drawn only from its
  own range, so the LoRA learns exactly what the pipeline will ask of it.
  The LoRA file keeps diffusers' ``transformer.`` keys either way; the low
  expert's loads with ``pipe.load_lora_weights(file, load_into_transformer_2=True)``.
  ``both`` trains a LoRA on each in one run (:mod:`diffpipe.families.wan.experts`):
  timesteps are drawn over the whole schedule and each sample goes to the
  expert the pipeline would use at its timestep; export writes the low
  expert's LoRA beside the high one's with a ``_low_noise`` suffix.
- ``2.2-i2v-a14b``: Wan 2.2 I2V-A14B: the two experts of ``2.2-a14b``
  (boundary 0.9) conditioned on a first frame as ``2.1-i2v`` is, through the
  condition latents alone: no image encoder, no image key/value projections
  (``WanImageToVideoPipeline`` passes no image embedding when the transformer
  has no ``image_dim``). ``model.expert`` as for ``2.2-a14b``.
- ``2.1-flf2v``: Wan 2.1 FLF2V (first and last frame to video): ``2.1-i2v``'s
  conditioning from two frames, as ``WanImageToVideoPipeline(image=..., last_image=...)``
  builds it: the condition latents hold the first frame, black frames and the
  last frame, the mask marks both, and the image embedder reads both frames'
  CLIP states with its position embedding over the pair. Each item's control
  is its first frame (a control image or ``control_from_first_frame``) and
  its own last frame (``datasets[].control_from_last_frame``, required).
- ``2.1-i2v``: Wan 2.1 I2V in ``WanImageToVideoPipeline``: each item's control
  image (a control image, or its own first frame with
  ``datasets[].control_from_first_frame``) is cached as the VAE latents of
  that frame followed by black frames (``control``) and its CLIP vision
  embedding (``control_embeds``); the loss feeds the 36-channel transformer
  exactly what the pipeline builds (:mod:`diffpipe.families.wan.i2v`). Its
  transformer splits the text off the image tokens at 512, so the tiny
  flavor's prompts are 512 tokens long too.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
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
from diffpipe.families.wan.experts import WanExperts
from diffpipe.families.wan.flavors import TINY_LENGTH, TINY_TRANSFORMER, TINY_UMT5, TINY_VAE, TINY_VAE_22
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import DenoiserPart, Family, Prepared
from diffpipe.models.components import TextBundle, TextEncoder, TextPart, Tokenizer
from diffpipe.models.tokenizers import t5_tokenizer
from diffpipe.paths import LOW_NOISE_SUFFIX
from diffpipe.utils import digest

MAX_LENGTH = 512  # WanPipeline's default max_sequence_length
DEFAULT_BOUNDARY = 0.875  # Wan 2.2 T2V-A14B's boundary_ratio
I2V_BOUNDARY = 0.9  # Wan 2.2 I2V-A14B's
CLIP_TOKENS = 257  # Wan 2.1 I2V's CLIP vision states per image (ViT-H/14 at 224 px: 16 x 16 patches + class)
EXPERT_ATTR = {"high": "transformer", "low": "transformer_2", "both": "transformer"}
#: ``model.expert: both``: each expert's export (the low one's names end in ``_low_noise``).
BOTH_PARTS = (
    DenoiserPart("transformer", label="high-noise expert"),
    DenoiserPart(
        "transformer_2",
        suffix=LOW_NOISE_SUFFIX,
        load_kwargs={"load_into_transformer_2": True},
        label="low-noise expert",
    ),
)


@dataclass(frozen=True)
class WanVariant:
    """What tells one Wan version from another, and its tiny flavor."""

    vae: dict[str, Any]
    transformer: dict[str, Any]
    #: The published scheduler's flow shift (the tiny flavor's scheduler uses it).
    flow_shift: float
    #: One timestep per latent token (Wan 2.2 TI2V-5B).
    expand_timesteps: bool = False
    #: Two experts split at this fraction of the schedule (Wan 2.2 A14B); None: one transformer.
    boundary_ratio: float | None = None
    seed_prefix: str = "wan"
    #: Conditioned on a first frame (its condition latents beside the noisy ones: Wan 2.1 and 2.2 I2V).
    image_to_video: bool = False
    #: ... and on its CLIP vision embedding (Wan 2.1 I2V; Wan 2.2 I2V-A14B has no image encoder).
    image_embeds: bool = False
    #: ... and on a last frame too (Wan 2.1 FLF2V: ``last_image``).
    last_frame: bool = False
    #: The tiny flavor's prompt length.
    text_length: int = TINY_LENGTH
    #: Another variant whose weights this one trains in another mode (a folder detected as it is accepted).
    weights_of: str | None = None


_TI2V_5B = WanVariant(
    TINY_VAE_22,
    {**TINY_TRANSFORMER, "in_channels": 48, "out_channels": 48},
    5.0,
    expand_timesteps=True,
    seed_prefix="wan2.2-5b",
)

VARIANTS: dict[str, WanVariant] = {
    "2.1": WanVariant(TINY_VAE, TINY_TRANSFORMER, 3.0),
    "2.2-5b": _TI2V_5B,
    # TI2V-5B's image-conditioned mode: the first latent frame is the image's clean latents at timestep 0.
    "2.2-5b-i2v": dataclasses.replace(_TI2V_5B, image_to_video=True, weights_of="2.2-5b"),
    "2.2-a14b": WanVariant(
        TINY_VAE, TINY_TRANSFORMER, 12.0, boundary_ratio=DEFAULT_BOUNDARY, seed_prefix="wan2.2-a14b"
    ),
    # 16 noisy + 4 mask + 16 condition channels in; image tokens through extra key/value projections.
    "2.1-i2v": WanVariant(
        TINY_VAE,
        {
            **TINY_TRANSFORMER,
            "in_channels": 36,
            "image_dim": wan_i2v.TINY_CLIP_VISION["hidden_size"],
            "added_kv_proj_dim": TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"],
        },
        3.0,
        seed_prefix="wan2.1-i2v",
        image_to_video=True,
        image_embeds=True,
        text_length=MAX_LENGTH,
    ),
    # 2.1-i2v's transformer whose image embedder takes the first and last frames' CLIP states, with a
    # position embedding over the pair (two tiny CLIP sequences of 17 tokens).
    "2.1-flf2v": WanVariant(
        TINY_VAE,
        {
            **TINY_TRANSFORMER,
            "in_channels": 36,
            "image_dim": wan_i2v.TINY_CLIP_VISION["hidden_size"],
            "added_kv_proj_dim": TINY_TRANSFORMER["num_attention_heads"] * TINY_TRANSFORMER["attention_head_dim"],
            "pos_embed_seq_len": 2 * wan_i2v.TINY_CLIP_TOKENS,
        },
        5.0,
        seed_prefix="wan2.1-flf2v",
        image_to_video=True,
        image_embeds=True,
        last_frame=True,
        text_length=MAX_LENGTH,
    ),
    # 16 noisy + 4 mask + 16 condition channels in, no image embedder; two experts.
    "2.2-i2v-a14b": WanVariant(
        TINY_VAE,
        {**TINY_TRANSFORMER, "in_channels": 36},
        5.0,
        boundary_ratio=I2V_BOUNDARY,
        seed_prefix="wan2.2-i2v-a14b",
        image_to_video=True,
    ),
}
#: What a variant's transformer is conditioned on (:meth:`WanFamily.sizes`).
_CONDITIONING = ("image_to_video", "image_embeds", "last_frame", "expand_timesteps")
#: The variants with two experts (``model.expert``).
EXPERT_VARIANTS = tuple(name for name, v in VARIANTS.items() if v.boundary_ratio is not None)


_tiny_umt5 = common.tiny_text_model(UMT5EncoderModel, UMT5Config, TINY_UMT5, "wan.text_encoder", common.T5_IDS)

def detect_variant(path: str | Path) -> str:
    """The Wan version of a diffusers folder: a ``transformer_2`` means A14B (I2V when its transformer
    reads 36 channels), an ``image_encoder`` 2.1 I2V (FLF2V when the image embedder has a position
    embedding over two images), a 48-channel VAE TI2V-5B."""
    path = Path(path)
    index_file = path / "model_index.json"
    index = json.loads(index_file.read_text()) if index_file.is_file() else {}
    second = index.get("transformer_2")
    if (isinstance(second, list) and second and second[0]) or (path / "transformer_2" / "config.json").is_file():
        channels = WanTransformer3DModel.load_config(path, subfolder="transformer").get("in_channels")
        return "2.2-i2v-a14b" if channels == 36 else "2.2-a14b"
    encoder = index.get("image_encoder")
    if (isinstance(encoder, list) and encoder and encoder[0]) or (path / "image_encoder" / "config.json").is_file():
        pairs = WanTransformer3DModel.load_config(path, subfolder="transformer").get("pos_embed_seq_len")
        return "2.1-flf2v" if pairs else "2.1-i2v"
    if index.get("expand_timesteps") or AutoencoderKLWan.load_config(path, subfolder="vae").get("z_dim") == 48:
        return "2.2-5b"
    return "2.1"


def unshift_timesteps(sigma: float, shift: float) -> float:
    """Inverse of ``objectives.shift_timesteps``: the fraction ``t`` whose shifted value is ``sigma``."""
    return sigma / (shift - (shift - 1) * sigma)


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
        given = control.shape[2]
        if self.expand_timesteps:  # TI2V-5B: the image alone, as a one-frame clip
            return {"control": self.encode_pixels(vae, control[:, :, :1])}
        if given != (2 if self.spec.last_frame else 1):
            raise ValueError(
                f"{self.model_label} {self.variant} conditions on {'a first and a last frame' if self.spec.last_frame else 'one image'}"
                f", got {given} control frame(s): datasets[].control_from_last_frame must be "
                f"{str(self.spec.last_frame).lower()}"
            )
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
        """The trained expert's timestep range ``[lo, hi)`` as fractions before the shift ((0, 1): all).

        The pipeline switches experts where ``sigma * 1000 >= boundary_ratio * 1000``, with
        ``sigma`` the shifted fraction, so the boundary maps back through the inverse shift.
        """
        if self.expert in (None, "both"):  # both: each drawn timestep picks its expert
            return 0.0, 1.0
        cut = unshift_timesteps(self.boundary_ratio, shift)
        return (cut, 1.0) if self.expert == "high" else (0.0, cut)

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
        sigma = obj.shift_timesteps(t.float(), shift)
        if self.expert == "high":  # rounding must never hand the other expert's steps to this one
            sigma = sigma.clamp(min=self.boundary_ratio)
        elif self.expert == "low":
            sigma = sigma.clamp(max=float(torch.nextafter(torch.tensor(self.boundary_ratio), torch.tensor(0.0))))
        return sigma

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
            raise ValueError(
                f"model.variant {self.variant} needs a control image per item (its conditioning first frame): set "
                "datasets[].control_path / control_column, or control_from_first_frame: true"
                + (" (and control_from_last_frame: true)" if self.spec.last_frame else "")
            )
        o = objective
        x0, sigma, noise = self._draw(latents, generator, t, noise, o)
        noisy = obj.flow_interpolate(x0, noise, sigma)
        weights = self.loss_mask(mask, x0, o)
        first_clean = self.spec.image_to_video and self.expand_timesteps
        if first_clean:  # TI2V-5B: the clean first frame replaces the noisy one; nothing to learn there
            keep = wan_i2v.noisy_frames(x0)
            noisy = (1 - keep) * control.to(x0.device).float() + keep * noisy
            weights = keep.expand(x0.shape) * (1 if weights is None else weights)
        elif self.spec.image_to_video:
            noisy = wan_i2v.transformer_input(
                noisy, control.to(x0.device).float(), self.frame_rule[0], last=self.spec.last_frame
            )
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
        return all(getattr(theirs, k) == getattr(self.spec, k) for k in _CONDITIONING)

    def estimate_controls(self, latents: torch.Tensor, denoiser: torch.nn.Module,
                          references: int = 1) -> dict[str, torch.Tensor]:
        """Condition latents like the target and, for an image embedder, CLIP states of its width: 257 tokens
        (CLIP ViT-H/14 at 224 px) a frame, or the pair its position embedding covers (FLF2V)."""
        out = super().estimate_controls(latents, denoiser, references)
        config = common.unwrap(denoiser).config
        if config.get("image_dim"):
            pairs = config.get("pos_embed_seq_len")
            shape = (2, pairs // 2) if pairs else (CLIP_TOKENS,)
            out["control_embeds"] = latents.new_zeros(latents.shape[0], *shape, config["image_dim"])
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
        from diffpipe.families.wan.layers import wan_layers

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
        if self.spec.image_to_video and not cfg.images:
            raise ValueError(f"sample.images: {self.model_label} {self.variant} (image-to-video) samples start from an image; "
                             "give one per sample.prompts")
        if self.spec.last_frame and not cfg.last_images:
            raise ValueError(f"sample.last_images: {self.model_label} {self.variant} samples end on a given last frame; give one "
                             "per sample.prompts")
        return {
            **super().sample_kwargs(cfg),
            "max_sequence_length": self.max_sequence_length,
        }
