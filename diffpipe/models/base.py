"""The model-family interface every family implements, and the registry.

A family knows how to build or load its components, encode media and text
for the caches, prepare a batch's training inputs from cached tensors (one
path, :meth:`Family.prepare`, for the loss, evaluation and pipeline-parallel
training), and which stock diffusers pipeline samples and loads its LoRAs. Each family lives in its
own folder under ``diffpipe/families/`` (see ``diffpipe.models.spec``).

Tensor conventions (every family):
- pixels: float32 ``[B, 3, F, H, W]`` in [-1, 1] (F = 1 for images);
- latents: ``[B, C, F', h, w]``, already normalised (scaling/shift applied),
  exactly what the denoiser is trained on (``F' = F`` for image VAEs,
  ``(F - 1) / 4 + 1`` for a video VAE with 4x temporal compression);
- text: ``dict[str, Tensor]`` named like the family pipeline's arguments
  (``prompt_embeds``, ``pooled_prompt_embeds``, ...), each ``[B, ...]``;
- mask: ``[B, 1, F', h, w]`` loss weights in [0, 1] on the latent grid
  (datasets with ``mask_path``), applied through :meth:`Family.loss_mask`;
- control: ``[B, C, F_c, h, w]`` conditioning latents of each item's control
  image, passed only to families with ``uses_control``.
"""

from __future__ import annotations

import json
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from diffpipe.config import ModelConfig, ObjectiveConfig, SampleConfig
from diffpipe.data.cache.frames import snap_frames
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models._draws import draw_image
from diffpipe.models.spec import Absent

if TYPE_CHECKING:
    from diffpipe.models.spec import Published


@dataclass(frozen=True)
class DenoiserPart:
    """One pipeline component a run trains a LoRA on, and how its exported LoRA loads back.

    A run trains one part, except Wan 2.2 A14B with ``model.expert: both``: its trained
    module then holds each part as a submodule named ``attr``, so the adapter's keys
    start with ``<attr>.``, and export writes one LoRA per part.
    """

    #: The stock pipeline's attribute (``transformer_2``).
    attr: str
    #: Added to every export name of this part (``pytorch_lora_weights_low_noise.safetensors``); "" for the first.
    suffix: str = ""
    #: Extra ``load_lora_weights`` arguments that route its diffusers file into ``attr``.
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    #: What the model card calls it ("low-noise expert").
    label: str = ""


def split_parts(state_dict: dict[str, torch.Tensor], parts: tuple[DenoiserPart, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """An adapter's tensors per part (``attr -> tensors keyed relative to that part``).

    One part: the state as is. Several: each ``<attr>.`` prefix is taken off; a key that
    names no part is an error (the adapter was not trained on this model's parts).
    """
    if len(parts) == 1:
        return {parts[0].attr: state_dict}
    out: dict[str, dict[str, torch.Tensor]] = {p.attr: {} for p in parts}
    for key, value in state_dict.items():
        attr = key.split(".", 1)[0]
        if attr not in out:
            raise ValueError(f"adapter key {key!r} names no trained part (expected one of {', '.join(out)})")
        out[attr][key.split(".", 1)[1]] = value
    empty = [a for a, sd in out.items() if not sd]
    if empty:
        raise ValueError(f"the adapter has no tensors for {', '.join(empty)}; was it trained with every part?")
    return out


def _folder_family(module: str) -> str | None:
    """The family a class in a family folder belongs to: the folder's name with ``-`` for ``_``
    (``diffpipe.families.flux_kontext.family`` -> ``flux-kontext``), the rule every registry line follows."""
    parts = module.split(".")
    return parts[2].replace("_", "-") if parts[:2] == ["diffpipe", "families"] and len(parts) > 2 else None


def ids_name(encoder: str) -> str:
    """The text cache column of a trained encoder's token ids: ``text_encoder`` -> ``input_ids``,
    ``text_encoder_2`` -> ``input_ids_2``."""
    return "input_ids" + encoder.removeprefix("text_encoder")


@dataclass
class Prepared:
    """One batch's training inputs, built once by :meth:`Family.prepare`.

    The loss forwards the denoiser on ``inputs`` (:meth:`Family.predict`) and compares
    with ``target``; pipeline-parallel training sends ``inputs`` (:meth:`Family.layer_inputs`)
    into the first layer and ``(target, weights)`` to the last stage's loss.
    """

    #: The denoiser's forward keyword arguments, in the order of the first pipeline layer's tuple.
    inputs: dict[str, Any]
    #: What the prediction is compared with, laid out like it (packed into tokens where the family packs).
    target: torch.Tensor
    #: Per-sample loss weights ``[B]`` (Min-SNR, SD3's weighting schemes); None: unweighted.
    weights: torch.Tensor | None = None
    #: Per-element loss weights laid out like ``target`` (:meth:`Family.loss_mask`); None: unmasked.
    mask: torch.Tensor | None = None
    #: What else the family's ``predict`` reads (reference tokens, the latent grid to unpack to, ...).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlowDraw:
    """A flow-matching draw of image latents ``[B, C, h, w]``, packed into tokens where the family packs."""

    x0: torch.Tensor
    sigma: torch.Tensor
    #: ``flow_interpolate(x0, noise, sigma)`` and ``flow_target(x0, noise)``, packed.
    noisy: torch.Tensor
    target: torch.Tensor
    #: The pipeline's packing for this batch's latent shape; None: unpacked.
    pack: Any = None

    @property
    def grid(self) -> tuple[int, int]:
        """Token rows and columns of a 2x2 packing: the latent grid halved."""
        return self.x0.shape[-2] // 2, self.x0.shape[-1] // 2


class Family(ABC):
    """One model family (SD-style UNet, Flux-style transformer, ...)."""

    #: The ``model.family`` name; derived from the registry for a class in a family folder's ``family.py``.
    name: ClassVar[str]
    #: Attribute of the stock pipeline that holds the denoiser, also the LoRA key prefix (``unet`` for UNets).
    denoiser_name: ClassVar[str] = "transformer"
    #: PEFT ``target_modules`` used when the config gives none.
    default_lora_targets: ClassVar[list[str]]
    #: Whether the family trains on clips (its pipeline returns ``frames``; samples are MP4s).
    is_video: ClassVar[bool] = False
    #: Frame rate clips are resampled to before planning their frames.
    fps: ClassVar[float] = 24.0
    #: Frame counts ``step * k + offset`` the VAE accepts, as ``(step, offset)``: 4k+1.
    frame_rule: ClassVar[tuple[int, int]] = (4, 1)
    #: Whether ``loss`` takes ``control`` latents (edit / reference-image families).
    uses_control: ClassVar[bool] = False
    #: How many control (reference) images an item may have (``datasets[].control_path`` as a list): they
    #: reach ``loss`` as the frames of ``control``, ``[B, C, R, h, w]``.
    max_references: ClassVar[int] = 1
    #: Whether each control is a first and a last frame (``datasets[].control_from_last_frame``; Wan FLF2V):
    #: the plan then requires that option of every dataset, and refuses it for every other family.
    uses_last_frame: ClassVar[bool] = False
    #: Whether ``model.first_frame_p`` applies: some items given their first frame, the others text only.
    mixes_first_frame: ClassVar[bool] = False
    #: Whether ``loss`` takes ``sizes``: each item's source size and crop (SDXL's add_time_ids).
    uses_sizes: ClassVar[bool] = False
    #: Whether the text encoder also sees each item's control image (an edit model's
    #: vision-language encoder): the plan then keys text by caption and control image, and
    #: the text cache passes the images to ``encode_text(encoders, captions, images=...)``.
    text_uses_control: ClassVar[bool] = False

    #: The pipeline argument ``sample.images`` are passed as (``image``; ``control_image`` for Flux Control).
    sample_image_arg: ClassVar[str] = "image"
    #: Whether samples continue an input clip (``sample.videos``, the pipeline's ``video``).
    continues_video: ClassVar[bool] = False
    #: Versions ``model.variant`` may name (empty: the family has one).
    variants: ClassVar[tuple[str, ...]] = ()
    #: Subfolders besides ``vae`` and ``denoiser_name`` that ``model.single_files`` may replace.
    extra_single_files: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        if cfg.variant is not None and cfg.variant not in self.variants:
            known = ", ".join(self.variants) or "none"
            raise ValueError(f"model.variant {cfg.variant!r}: family {self.name!r} has variants: {known}")
        if cfg.expert is not None and not self.variants:
            raise ValueError(f"model.expert {cfg.expert!r}: family {self.name!r} has no experts")
        if cfg.first_frame_p is not None and not self.mixes_first_frame:
            raise ValueError(f"model.first_frame_p: family {self.name!r} does not mix image- and text-to-video "
                             "items (ltx2 variant i2v does)")
        allowed = ("vae", self.denoiser_name, *self.extra_single_files)
        for key in cfg.single_files:
            if key not in allowed:
                raise ValueError(
                    f"model.single_files.{key}: family {self.name!r} loads only {', '.join(allowed)} from "
                    "single files (tokenizers and text encoders come from the folder at model.path)"
                )

    @property
    def denoiser_attr(self) -> str:
        """The stock pipeline's attribute (and a local folder's subfolder) holding the trained denoiser.

        ``denoiser_name`` unless a family trains one of several (Wan 2.2 A14B's ``transformer_2``).
        """
        return self.denoiser_name

    @property
    def lora_load_kwargs(self) -> dict[str, Any]:
        """Extra ``load_lora_weights`` arguments that route the exported LoRA into ``denoiser_attr``."""
        return {}

    def load_lora(self, pipe: Any, file: str | Path, **load_kwargs: Any) -> None:
        """Load an exported diffusers-format LoRA into the stock pipeline: its ``load_lora_weights``
        (``load_kwargs``: a part's routing, :attr:`lora_load_kwargs`)."""
        pipe.load_lora_weights(str(file), **load_kwargs)

    @property
    def denoiser_parts(self) -> tuple[DenoiserPart, ...]:
        """The pipeline components one run trains (see :class:`DenoiserPart`): ``denoiser_attr`` alone."""
        return (DenoiserPart(self.denoiser_attr, load_kwargs=self.lora_load_kwargs),)

    # -- identity: content hashes that go into cache keys ------------------
    #: The diffusers VAE class (what a local folder's ``vae/`` is loaded as).
    vae_class: ClassVar[type]

    #: Whether the VAE encodes in float32 under ``model.vae_dtype: auto`` on CUDA (16 bits lose
    #: precision or overflow in it: SD 1.x/SDXL's VAE, Wan's causal 3D VAE).
    vae_needs_fp32: ClassVar[bool] = False

    def vae_identity(self) -> str:
        """The latent cache key part: the VAE's weights and config, and the dtype it encodes in."""
        return common.with_dtype(self.vae_weights_identity(), self.vae_dtype())

    def vae_dtype(self, *, cuda: bool | None = None) -> torch.dtype:
        """The dtype the VAE loads and encodes in (``model.vae_dtype``; ``auto`` minds ``vae_needs_fp32``)."""
        return common.load_dtype(self.cfg, "vae", cuda=cuda, vae_fp32=self.vae_needs_fp32)

    def text_identity(self) -> str:
        """The text cache key part: tokenizers, encoders and the dtype they encode in, and which
        encoders' captions are cached as token ids (``train.text_encoder``)."""
        identity = common.with_dtype(self.encoders_identity(), common.load_dtype(self.cfg, "text_encoder"))
        if self.cfg.text_encoder_weights == "fp8":
            identity = f"{identity}+fp8"
        return f"{identity}+ids:{','.join(self.trained_text)}" if self.trained_text else identity

    # -- text encoders trained beside the denoiser (train.text_encoder) -----
    #: The text encoders (pipeline names) a LoRA may train, each with the prefix of its LoRA's layer names
    #: in kohya and ComfyUI files (``lora_te``); empty: the family caches every embedding.
    trainable_text_encoders: ClassVar[dict[str, str]] = {}
    #: The encoders this run trains (:meth:`with_trained_text`): ``encode_text`` gives their token ids.
    trained_text: tuple[str, ...] = ()

    def with_trained_text(self, names: list[str] | tuple[str, ...]) -> Family:
        """This family with ``names`` (``train.text_encoder.encoders``) trained: their captions are
        cached as token ids (:meth:`encode_text`) and encoded at each step (:meth:`text_from_ids`)."""
        unknown = [n for n in names if n not in self.trainable_text_encoders]
        if unknown:
            can = ", ".join(self.trainable_text_encoders) or "none (every embedding is cached)"
            raise ValueError(f"train.text_encoder.encoders {unknown}: family {self.name!r} trains text encoders: "
                             f"{can}")
        self.trained_text = tuple(names)
        return self

    def embed_ids(self, encoders: Mapping[str, torch.nn.Module], text: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
        """The cached ``text`` (token ids of the trained ``encoders``, embeddings of the others) as
        :meth:`encode_text` returns it without trained encoders, computed with gradients."""
        raise NotImplementedError(f"model family {self.name!r} trains no text encoder")

    def text_from_ids(self, denoiser: torch.nn.Module | None, text: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
        """``text`` for :meth:`prepare`: unchanged, or, when encoders are trained, encoded by the ones
        the training module holds (:class:`diffpipe.training.text_encoders.WithTextEncoders`)."""
        if not self.trained_text:
            return text
        encoders = getattr(common.unwrap(denoiser), "text_encoders", None)
        if encoders is None:
            raise ValueError(f"train.text_encoder.encoders {list(self.trained_text)}: the model holds no "
                             "trained text encoder")
        missing = [k for k in self.id_names() if k not in text]
        if missing:
            raise ValueError(f"train.text_encoder.encoders {list(self.trained_text)}: the text cache holds no "
                             f"token ids ({missing}); rerun `diffpipe plan` and `diffpipe cache` (`diffpipe run` does)")
        return self.embed_ids(encoders, text)

    def id_names(self) -> list[str]:
        """The text cache columns holding the trained encoders' token ids."""
        return [ids_name(n) for n in self.trained_text]

    def vae_weights_identity(self) -> str:
        """Hash of the VAE's config and weights.

        Tiny flavor: the built module's tensors (memoised per process); local:
        the ``vae/`` folder's config and weight files.
        """
        from diffpipe.utils import digest

        if self.cfg.flavor == "tiny":
            return common.memo_identity(
                (self.name, self.cfg.seed, "vae"), lambda: digest(common.module_identity(self.load_vae()))
            )
        return digest(common.diffusers_component_identity(self.vae_class, self.cfg, "vae"))

    def encoders_identity(self) -> str:
        """Hash of the tokenizers' and text encoders' config and weights, and the text settings.

        From the declared ``text_parts``: tiny flavor = the built modules (memoised per process); local =
        the folders' tokenizers and encoder configs and weight files, without loading the weights.
        """
        from diffpipe.models.components import Tokenizer
        from diffpipe.models.tokenizers import tokenizer_fingerprint
        from diffpipe.utils import digest

        parts = self._declared("text_parts")
        if self.cfg.flavor == "tiny":
            def build() -> str:
                bundle = self.load_text_encoders()
                return digest({**{name: tokenizer_fingerprint(bundle.parts[name]) if isinstance(part, Tokenizer)
                                  else common.module_identity(bundle.parts[name]) for name, part in parts.items()},
                               **self.text_settings()})

            # Variants of one family may differ in their text settings (Wan's tiny prompt lengths).
            return common.memo_identity((self.name, self.cfg.seed, "text", digest(self.text_settings())), build)
        path, variant = self.cfg.path, self.cfg.weight_variant
        return digest({**{name: tokenizer_fingerprint(part.cls.from_pretrained(path, subfolder=name))
                          if isinstance(part, Tokenizer)
                          else common.transformers_folder_identity(part.cls, part.config_cls, path, name, variant=variant)
                          for name, part in parts.items()},
                       **self.text_settings()})

    # -- geometry ----------------------------------------------------------
    #: The denoiser's patch side; None: its config's ``patch_size`` (a family that packs 2x2 latents itself,
    #: whatever the config says, sets 2).
    patch: ClassVar[int | None] = None
    #: The least side multiple the stock pipeline accepts (some refuse sides not divisible by 16).
    min_pixel_multiple: ClassVar[int] = 1

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

    # -- components (declared: ``diffpipe.models.components``) ------------------------
    #: The VAE and the denoiser, declared (class, tiny config); families that build them otherwise override
    #: ``load_vae`` / ``load_denoiser``.
    vae_model: ClassVar[Any] = None
    denoiser_model: ClassVar[Any] = None
    #: The VAE, denoiser, scheduler and pipeline declared at once
    #: (:class:`~diffpipe.models.components.Models`, tiny configs by the flavors' shared names).
    models: ClassVar[Any] = None
    #: The scheduler: its class and tiny config (a local folder's ``scheduler/`` config otherwise).
    scheduler_model: ClassVar[Any] = None
    #: The tokenizers and text encoders by the pipeline's argument names, in the order their identities
    #: enter the text cache key.
    text_parts: ClassVar[dict[str, Any]] = {}
    #: The diffusers pipeline class (its ``save_lora_weights`` writes our export); a family whose pipeline
    #: depends on the model (a variant) makes it a property.
    pipeline_class: ClassVar[type]
    #: The class whose ``save_lora_weights`` writes the diffusers file when the pipeline has no LoRA loader
    #: (None: the pipeline's own); :meth:`load_lora` then says how the file loads.
    lora_writer: ClassVar[type | None] = None
    #: Keyword arguments the stock pipeline takes besides its components (``safety_checker=None``, ...).
    pipeline_extras: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Derives what a family class does not spell out: its ``name`` from its folder's registry line,
        its components from ``models``, its ``token_streams`` from its tokenizers' streams."""
        from diffpipe.models.components import Tokenizer

        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = _folder_family(cls.__module__) or getattr(cls, "name", "")
        if cls.__dict__.get("models") is not None:
            for attr, value in cls.models.declared().items():
                setattr(cls, attr, value)
        if cls.__dict__.get("vae_model") is not None and "vae_class" not in cls.__dict__:
            cls.vae_class = cls.vae_model.cls
        parts = cls.__dict__.get("text_parts")
        if isinstance(parts, dict) and "token_streams" not in cls.__dict__:
            streams = {part.stream: (name, part.limit) for name, part in parts.items()
                       if isinstance(part, Tokenizer) and part.stream}
            if streams:
                cls.token_streams = streams

    def _declared(self, what: str) -> Any:
        value = getattr(self, what)
        if not value:
            raise NotImplementedError(f"family {self.name!r} declares no {what} and does not override its loader")
        return value

    def _config(self, what: str, subfolder: str) -> dict[str, Any]:
        """A declared component's config: the tiny one, or the local folder's ``subfolder`` config."""
        model = self._declared(what)
        if self.cfg.flavor == "tiny":
            return dict(model.tiny)
        return dict(model.cls.load_config(self.cfg.path, subfolder=subfolder))

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return self._config("vae_model", "vae")

    @cached_property
    def _denoiser_config(self) -> dict[str, Any]:
        return self._config("denoiser_model", self.denoiser_name)

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        return self._config("scheduler_model", "scheduler")

    def inference_scheduler(self) -> Any:
        """The scheduler the stock pipeline samples with: the declared one, from the family's config."""
        return self._declared("scheduler_model").cls.from_config(self._scheduler_config)

    def _model(self, model: Any, subfolder: str) -> torch.nn.Module:
        dtype = self.vae_dtype() if subfolder == "vae" else None
        return common.component(model.cls, self.cfg, model.seed or self.name, subfolder, model.tiny, dtype)

    def load_vae(self) -> torch.nn.Module:
        """The declared VAE (``vae_model``), in eval mode, in ``model.vae_dtype``."""
        return self._model(self._declared("vae_model"), "vae")

    def load_denoiser(self) -> torch.nn.Module:
        """The declared denoiser (``denoiser_model``) from the ``denoiser_name`` subfolder, in ``model.dtype``."""
        return self._model(self._declared("denoiser_model"), self.denoiser_name)

    def trained_base(self, denoiser: torch.nn.Module) -> torch.nn.Module:
        """The stock denoiser as the adapter is trained on it: itself, or changed in place by a family
        whose LoRA also reshapes the base (Flux Control widens its input layer)."""
        return denoiser

    #: Prompt tokens the text caches keep, as ``(tiny flavor, pipeline's max_sequence_length)``; a local
    #: folder's ``prompt_tokenizer`` lowers the second when its ``model_max_length`` (less ``prompt_drop``
    #: template tokens) is lower. None: the family keeps no fixed prompt length.
    prompt_tokens: ClassVar[tuple[int, int] | None] = None
    prompt_tokenizer: ClassVar[str] = "tokenizer"
    prompt_drop: ClassVar[int] = 0

    @cached_property
    def max_sequence_length(self) -> int:
        """Prompt tokens the caches keep and sampling uses: ``prompt_tokens``' tiny length for the tiny flavor;
        else the pipeline's length, or the folder tokenizer's ``model_max_length`` (less ``prompt_drop``
        template tokens) when that is lower."""
        if self.prompt_tokens is None:
            raise AttributeError(f"{self.name} keeps no fixed prompt length")
        tiny, cap = self.prompt_tokens
        if self.cfg.flavor == "tiny":
            return tiny
        config = Path(self.cfg.path) / self.prompt_tokenizer / "tokenizer_config.json"
        limit = json.loads(config.read_text()).get("model_max_length") if config.is_file() else None
        return cap if limit is None else min(int(limit) - self.prompt_drop, cap)

    def text_settings(self) -> dict[str, Any]:
        """Text settings carried in the bundle and the text cache key (``max_sequence_length``, ...)."""
        return {} if self.prompt_tokens is None else {"max_sequence_length": self.max_sequence_length}

    def _text_bundle(self, *, encoders: bool, only: Collection[str] | None = None) -> Any:
        from diffpipe.models.components import TextBundle, Tokenizer

        parts, out = self._declared("text_parts"), {}
        tiny = self.cfg.flavor == "tiny"
        for name, part in parts.items():
            if isinstance(part, Tokenizer):
                out[name] = self.load_tokenizer(name)
            elif not encoders or (only is not None and name not in only):
                out[name] = None
            elif tiny:
                out[name] = part.tiny(out[part.tokenizer or name.replace("text_encoder", "tokenizer")], self.cfg.seed)
            else:
                out[name] = common.pretrained_text_encoder(part.cls, self.cfg, name)
        return self.stored_text(TextBundle(out, **self.text_settings()))

    def stored_text(self, bundle: Any) -> Any:
        """The bundle with its encoders stored as ``model.text_encoder_weights`` says (fp8: float8 weights,
        computed in ``model.text_encoder_dtype``); every loader of text encoders returns through it."""
        if self.cfg.text_encoder_weights == "fp8":
            from diffpipe.models.casting import enable_fp8_text_encoder

            compute = common.load_dtype(self.cfg, "text_encoder")
            parts = bundle.parts if hasattr(bundle, "parts") else vars(bundle)  # a family's own bundle class
            for part in parts.values():
                if isinstance(part, torch.nn.Module):
                    enable_fp8_text_encoder(part, compute)
        return bundle

    def load_tokenizer(self, name: str = "tokenizer") -> Any:
        """One declared tokenizer: the tiny flavor's, or the folder's subfolder ``name`` (no text settings:
        ``text_settings`` may measure a template with it)."""
        part = self._declared("text_parts")[name]
        return part.tiny() if self.cfg.flavor == "tiny" else part.cls.from_pretrained(self.cfg.path, subfolder=name)

    def load_tokenizers(self) -> Any:
        """What ``token_limits`` and ``count_tokens`` need: the declared tokenizers, no encoder weights."""
        return self._text_bundle(encoders=False)

    def load_text_encoders(self, only: Collection[str] | None = None) -> Any:
        """The declared tokenizers and text encoders (a :class:`~diffpipe.models.components.TextBundle`),
        passed back to ``encode_text``; ``only``: load just these encoders (the others are None: training
        a text encoder never loads FLUX.1's T5-XXL)."""
        return self._text_bundle(encoders=True, only=only)

    def text_pipeline(self, encoders: Any) -> Any:
        """The stock pipeline holding only the text components, to encode captions with its own
        ``encode_prompt`` (so the cache equals what sampling computes)."""
        return self.pipeline_class(vae=None, **{self.denoiser_name: None}, scheduler=None, **encoders.parts)

    def pipeline_prompt(self, encoders: Any, captions: list[str]) -> Any:
        """What the stock pipeline's ``encode_prompt`` returns for ``captions`` without guidance, at the
        bundle's ``max_sequence_length``, on the text encoder's device, without gradients."""
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            return self.text_pipeline(encoders).encode_prompt(
                list(captions), do_classifier_free_guidance=False, device=device,
                max_sequence_length=encoders.max_sequence_length)

    def load_pipeline(self) -> Any:
        """The family's stock diffusers pipeline with every component, on CPU, eval mode."""
        text = self.load_text_encoders()
        return self.pipeline_class(
            vae=self.load_vae(), **{self.denoiser_name: self.load_denoiser()},
            scheduler=self.inference_scheduler(), **text.parts, **self.pipeline_extras,
        )


    # -- encoding for the caches -------------------------------------------
    #: The pipeline decodes ``latents / scaling_factor + shift_factor`` (True) or ``latents / scaling_factor``
    #: (False); the default ``encode_pixels`` is its inverse.
    vae_shift: ClassVar[bool] = False
    #: The VAE encodes each frame as an image (True) or a clip at once (a causal video VAE).
    vae_per_frame: ClassVar[bool] = True

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

    @abstractmethod
    def encode_text(self, encoders: Any, captions: list[str]) -> dict[str, torch.Tensor]:
        """Captions -> embeddings dict (float32), named like the pipeline's arguments."""

    #: Per text encoder, as the dataset checks name it: ``(tokenizer attribute, limit)``, where the limit
    #: is ``"sequence"`` (the configured ``max_sequence_length``) or ``"tokenizer"`` (its
    #: ``model_max_length``). A family with other rules overrides ``token_limits``/``count_tokens``.
    token_streams: ClassVar[dict[str, tuple[str, str]]] = {}

    def caption_prompts(self, captions: list[str]) -> list[str]:
        """The text the pipeline tokenizes for each caption (a family's template or cleaning)."""
        return list(captions)

    def token_limits(self, encoders: Any) -> dict[str, int]:
        """Max tokens per text encoder, e.g. ``{"clip": 77}``."""
        if not self.token_streams:
            raise NotImplementedError(f"{self.name} declares no token_streams and no token_limits")
        return {label: encoders.max_sequence_length if limit == "sequence" else getattr(encoders, tok).model_max_length
                for label, (tok, limit) in self.token_streams.items()}

    def count_tokens(self, encoders: Any, captions: list[str]) -> dict[str, list[int]]:
        """Token count of each caption per encoder, with the real tokenizers."""
        if not self.token_streams:
            raise NotImplementedError(f"{self.name} declares no token_streams and no count_tokens")
        prompts = self.caption_prompts(captions)
        return {label: [len(ids) for ids in getattr(encoders, tok)(prompts).input_ids]
                for label, (tok, _) in self.token_streams.items()}

    # -- training: one input path --------------------------------------------
    def shift_for(self, x0: torch.Tensor) -> float:
        """The flow-matching timestep shift the pipeline's scheduler applies to latents shaped like ``x0``.

        The scheduler config's fixed ``shift`` by default; families whose pipeline shifts by image
        size (FLUX.1, Qwen-Image, CogView4) override it.
        """
        return float(self._scheduler_config.get("shift", 1.0))

    def timestep_shift(self, image_seq_len: int) -> float:
        """The shift the pipeline's scheduler applies at this many latent tokens: the config's fixed ``shift``;
        with ``use_dynamic_shifting``, ``exp(mu)`` (``mu`` for a linear ``time_shift_type``) for ``mu`` linear
        in the token count as FluxPipeline computes it (Qwen-Image's and LTX-Video's pipelines alike)."""
        c = self._scheduler_config
        if not c.get("use_dynamic_shifting", False):
            return float(c.get("shift", 1.0))
        # Imported here: only families whose scheduler shifts by size load FluxPipeline's module.
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        mu = calculate_shift(image_seq_len, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        return math.exp(mu) if c.get("time_shift_type", "exponential") == "exponential" else mu

    def flow_draw(self, latents: torch.Tensor, generator: torch.Generator, objective: ObjectiveConfig,
                  t: torch.Tensor | None, noise: torch.Tensor | None, pack_latents: Any = None, **draw: Any) -> FlowDraw:
        """:meth:`draw_flow` (``draw`` passed on), its noisy latents and target; packed by the pipeline's
        ``pack_latents(x, batch, channels, height, width)`` when given."""
        x0, noise, sigma = self.draw_flow(latents, generator, objective, t, noise, **draw)
        noisy, target = obj.flow_interpolate(x0, noise, sigma), obj.flow_target(x0, noise)
        if pack_latents is None:
            return FlowDraw(x0, sigma, noisy, target)
        b, c, h, w = x0.shape

        def pack(x: torch.Tensor) -> torch.Tensor:
            return pack_latents(x, b, c, h, w)

        return FlowDraw(x0, sigma, pack(noisy), pack(target), pack)

    def flow_prepared(self, flow: FlowDraw, inputs: dict[str, Any], mask: torch.Tensor | None,
                      objective: ObjectiveConfig, **fields: Any) -> Prepared:
        """The prepared batch of a flow draw: its target, and the loss mask laid out (packed) alike."""
        return Prepared(inputs, flow.target, mask=self.loss_mask(mask, flow.x0, objective, flow.pack), **fields)

    def draw_flow(self, latents: torch.Tensor, generator: torch.Generator, objective: ObjectiveConfig,
                  t: torch.Tensor | None, noise: torch.Tensor | None,
                  **draw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An image family's flow-matching draw: ``(x0, noise, sigma)``.

        ``x0`` is the single latent frame (float32); ``t`` and ``noise`` are drawn unless given
        (``draw`` goes to :func:`draw_image`); ``sigma`` is ``t`` shifted by ``objective.shift``
        or else the pipeline's own shift (:meth:`shift_for`).
        """
        x0 = common.single_frame(latents, self.name).float()
        t, noise = draw_image(objective, x0, generator, t, noise, family=self.name, **draw)
        return x0, noise, obj.shift_timesteps(t, objective.shift or self.shift_for(x0))

    @abstractmethod
    def prepare(
        self,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        *,
        objective: ObjectiveConfig,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Prepared:
        """A batch's denoiser inputs, target and weights (see :class:`Prepared`), drawn once.

        The one place a family builds its training inputs: :meth:`loss`, evaluation (through
        ``loss`` and ``pipeline_inputs`` with fixed ``t`` and ``noise``) and pipeline-parallel
        training (:meth:`pipeline_inputs`) all call it, so they see the same draws in the same order.
        ``t`` (fractions in (0, 1), one per sample) and ``noise`` fix the timestep and noise;
        otherwise both are drawn from ``generator``. Inputs are cast to ``dtype`` (the denoiser's).
        Families with ``uses_control`` also take ``control`` (and ``control_embeds``), SDXL ``sizes``.
        """

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The denoiser's prediction laid out like ``prepared.target``: a forward on ``prepared.inputs``.

        A transformer without guidance embedding (``config.guidance_embeds`` false) is given no
        ``guidance``, as the stock pipelines do. Families whose forward needs more of the module
        (its config) or maps its output override it.
        """
        inputs = prepared.inputs
        if "guidance" in inputs and not getattr(common.unwrap(denoiser).config, "guidance_embeds", True):
            inputs = {**inputs, "guidance": None}
        return denoiser(**inputs, return_dict=False)[0]

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """The first pipeline layer's tuple: ``prepared.inputs`` in order."""
        return tuple(prepared.inputs.values())

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
        mask: torch.Tensor | None = None,
        base_target: torch.Tensor | None = None,
        **aux: Any,
    ) -> torch.Tensor:
        """Per-sample training loss ``[B]`` (float32): :meth:`prepare`, :meth:`predict`, the shared loss.

        ``objective`` (``train.objective``) picks the timestep sampling, limits,
        loss and weighting; None = the family's defaults with MSE. ``t`` and
        ``noise`` fix the draws (evaluation, see :meth:`prepare`).

        ``mask`` (``[B, 1, F', h, w]`` in [0, 1], or None) weights the loss per
        latent element: the per-sample loss is ``sum(w l) / sum(w)`` with ``w``
        from :meth:`loss_mask`. ``base_target`` (``[B]`` bool, or None): the items whose target is the base
        model's prediction (:meth:`preserved_target`). ``aux``: the family's extra inputs (``control``, ``sizes``, ...).
        """
        from diffpipe.models.objectives import per_sample_loss

        o = objective or ObjectiveConfig()
        # No denoiser: a caller checking the inputs alone (the errors prepare raises).
        dtype = torch.float32 if denoiser is None else common.param_dtype(denoiser)
        text = self.text_from_ids(denoiser, text)
        p = self.prepare(latents, text, generator, objective=o, t=t, noise=noise, mask=mask, dtype=dtype, **aux)
        target = p.target if base_target is None else self.preserved_target(denoiser, p, base_target)
        return per_sample_loss(self.predict(denoiser, p), target, p.weights, kind=o.loss, huber_c=o.huber_c,
                               mask=p.mask)

    def preserved_target(self, denoiser: torch.nn.Module, prepared: Prepared, which: torch.Tensor) -> torch.Tensor:
        """Output preservation (``datasets[].prior_target: base``): the target of the items ``which``
        (``[B]`` bool) is the base model's prediction on the same inputs, the LoRA switched off and
        no gradient taken; the others keep ``prepared.target``."""
        from diffpipe.models.casting import adapters_disabled

        if not bool(which.any()):
            return prepared.target
        with torch.no_grad(), adapters_disabled(denoiser):
            base = self.predict(denoiser, prepared).to(prepared.target.dtype)
        keep = which.to(base.device).view(-1, *([1] * (base.dim() - 1)))
        return torch.where(keep, base, prepared.target)

    def reference_image(self, control: torch.Tensor | None, latents: torch.Tensor) -> torch.Tensor:
        """An edit family's control latents ``[B,C,1,h,w]`` as ``[B,C,h,w]`` float on the latents' device;
        an error naming the dataset keys when the batch has none."""
        if control is None:
            raise ValueError(
                f"model family {self.name!r} needs control latents for every item: set "
                "datasets[].control_path or control_column"
            )
        from diffpipe.models._common import single_frame

        return single_frame(control, self.name).to(latents.device).float()

    def loss_mask(
        self,
        mask: torch.Tensor | None,
        x0: torch.Tensor,
        objective: ObjectiveConfig | None = None,
        pack: Any = None,
    ) -> torch.Tensor | None:
        """A batch's loss mask laid out like the family's prediction, as weights (None: unmasked).

        ``mask`` ``[B, 1, F', h, w]`` (or ``[B, 1, h, w]``) is broadcast over the
        channels of ``x0`` (the clean latents the target is built from, ``[B,C,h,w]``
        or ``[B,C,F,h,w]``), floored by ``objective.mask_min_weight``, and passed
        through ``pack`` when the family packs its latents into tokens (the same
        function its target goes through). Every family's loss calls this.
        """
        if mask is None:
            return None
        from diffpipe.models.objectives import mask_weights

        m = mask.to(device=x0.device, dtype=torch.float32)
        if x0.ndim == 4 and m.ndim == 5:  # image families drop the frame axis
            m = m[:, :, 0]
        floor = (objective or ObjectiveConfig()).mask_min_weight
        w = mask_weights(m, floor).expand(x0.shape).contiguous()
        return pack(w) if pack is not None else w

    @property
    def published_variants(self) -> tuple[str | None, ...]:
        """The ``Published.variant`` names whose weights this model is (the family's variant, if it has any)."""
        return (getattr(self, "variant", None),)

    def sizes(self, published: Published) -> bool:
        """Whether a memory estimate can size this model's training with ``published``'s denoiser: it takes
        this variant's inputs (a published model of no particular variant, or of this one)."""
        return published.variant is None or published.variant in self.published_variants

    def estimate_controls(self, latents: torch.Tensor, denoiser: torch.nn.Module,
                          references: int = 1) -> dict[str, torch.Tensor]:
        """The control arguments of ``loss`` a memory estimate passes (``uses_control`` families): each of the
        datasets' ``references`` reference images the size of the target, as conditioning latents."""
        return {"control": latents.clone() if references == 1 else torch.cat([latents] * references, dim=2)}

    # -- sampling ----------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        """Keyword arguments for the stock pipeline's ``__call__``."""
        if cfg.last_images and not self.uses_last_frame:
            raise ValueError(f"sample.last_images: {self.name} has no last-frame input (Wan variant 2.1-flf2v has)")
        out = {
            "num_inference_steps": cfg.steps,
            "guidance_scale": cfg.guidance_scale,
            "height": cfg.height,
            "width": cfg.width,
        }
        if self.is_video:  # clips of a frame count the VAE accepts, as PIL frames
            step, offset = self.frame_rule
            out.update(num_frames=max(offset, snap_frames(cfg.frames, step, offset)), output_type="pil")
        return out

    def lora_targets(self, configured: list[str] | None) -> list[str]:
        return list(configured) if configured else list(self.default_lora_targets)

    # -- pipeline parallelism (train.pipeline_stages > 1) ---------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser as layers passing tuples of tensors: embedding, one per block, output.

        Families with layers (their folder's ``layers.py``) override this; the others' spec says why not.
        """
        # The family's folder is imported with its class: its SPEC says why there are no layers.
        folder = sys.modules.get(type(self).__module__.rpartition(".")[0])
        layers = getattr(getattr(folder, "SPEC", None), "layers", None)
        why = f"is {layers.reason}" if isinstance(layers, Absent) else "has no layer list"
        raise ValueError(f"{self.name}: pipeline parallelism {why}; set train.pipeline_stages: 1")

    def pipeline_inputs(
        self,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        objective: ObjectiveConfig | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        **aux: Any,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        """``(first-layer inputs, (target, per-sample weights[, element mask]))`` from :meth:`prepare`, as
        ``loss`` builds them.

        The element mask is the family's own (an image-to-video variant's conditioning frames, weight 0),
        present when :meth:`prepare` sets one, so the last stage's loss leaves out what ``loss`` leaves out.
        Dataset loss masks are refused under pipeline stages.
        """
        p = self.prepare(latents, text, generator, objective=objective or ObjectiveConfig(), t=t, noise=noise,
                         dtype=dtype, **aux)
        weights = torch.ones(p.target.shape[0]) if p.weights is None else p.weights
        labels = (p.target, weights.to(p.target.device))
        return self.layer_inputs(p), labels if p.mask is None else (*labels, p.mask)


class TransformerLoRA:
    """Families whose stock pipeline has no LoRA loader (put before the base family in the bases): a
    single-transformer pipeline's mixin writes the diffusers file (the same ``transformer.`` layout, the
    adapter config in the header), and the transformer's own PEFT mixin loads it
    (``spec.loads_through_transformer`` puts that on the model card)."""

    @property
    def lora_writer(self) -> type:
        from diffusers.loaders import QwenImageLoraLoaderMixin

        return QwenImageLoraLoaderMixin

    def load_lora(self, pipe: Any, file: str | Path, **load_kwargs: Any) -> None:
        """``pipe.transformer.load_lora_adapter``: the diffusers file's ``transformer.`` keys (the scale is
        folded into them, so no alphas)."""
        pipe.transformer.load_lora_adapter(str(file), prefix="transformer", **load_kwargs)


class ReferenceTokens:
    """Edit families (put before the base family in the bases): the control latents become reference tokens
    (``prepared.extra["reference"]``, from :meth:`reference_tokens`) beside the base family's inputs; the
    family's ``predict`` appends them to the sequence and keeps the target tokens' output."""

    def reference_tokens(self, control: torch.Tensor) -> Any:
        """Control latents ``[B, C, h, w]`` -> what ``predict`` appends (tokens and their positions)."""
        raise NotImplementedError

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """The base family's inputs, with the control latents as reference tokens."""
        reference = self.reference_tokens(self.reference_image(control, latents))
        p = super().prepare(latents, text, generator, objective=objective, t=t, noise=noise, mask=mask, dtype=dtype)
        p.extra["reference"] = reference
        return p
