"""Training inputs: the one path (:meth:`TrainingInputs.prepare`) that draws a batch's timesteps and
noise and builds the denoiser's inputs, target, weights and loss mask, used alike by the loss, evaluation
and pipeline-parallel training; the flow-matching draws and shifts image families share; the loss."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from diffpipe.config import ObjectiveConfig
from diffpipe.config.base import ConfigError
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models._draws import draw_image
from diffpipe.models.casting import adapters_disabled
from diffpipe.models.family.records import FlowDraw, Prepared
from diffpipe.models.routing import RoutedStack, TokenRoute, routed


class TrainingInputs(ABC):
    """Inputs, prediction and loss of a training step (a part of :class:`~diffpipe.models.base.Family`)."""

    #: The homogeneous block stack ``train.token_routing`` routes tokens around (None: the family has none,
    #: and a config asking for routing is refused). Not inherited (:attr:`routed_stack`): a family built on
    #: another's class (Chroma on FLUX.1's) routes only once its own folder declares it, checked by its tests.
    token_routing: ClassVar[RoutedStack | None] = None

    @property
    def routed_stack(self) -> RoutedStack | None:
        """This family's own :attr:`token_routing` declaration (None when only a base class declares one)."""
        return type(self).__dict__.get("token_routing")

    def check_token_routing(self, routing: Any) -> None:
        """A clear config error when ``train.token_routing`` (``routing``, None: off) asks this family for
        routing it cannot do."""
        if routing is not None and self.routed_stack is None:
            raise ConfigError(f"train.token_routing: model family {self.name!r} has no homogeneous block stack "
                              "declared for token routing (flux, qwenimage and wan have one); remove "
                              "train.token_routing")

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
        # Deferred (start-up): FluxPipeline's module loads image processors; only size-shifting families need it.
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
        route: TokenRoute | None = None,
        **aux: Any,
    ) -> torch.Tensor:
        """Per-sample training loss ``[B]`` (float32): :meth:`prepare`, :meth:`predict`, the shared loss.

        ``objective`` (``train.objective``) picks the timestep sampling, limits,
        loss and weighting; None = the family's defaults with MSE. ``t`` and
        ``noise`` fix the draws (evaluation, see :meth:`prepare`).

        ``mask`` (``[B, 1, F', h, w]`` in [0, 1], or None) weights the loss per
        latent element: the per-sample loss is ``sum(w l) / sum(w)`` with ``w``
        from :meth:`loss_mask`. ``base_target`` (``[B]`` bool, or None): the items whose target is the base
        model's prediction (:meth:`preserved_target`). ``route`` (training steps only): the prediction routes a
        share of the image tokens around the family's :attr:`token_routing` blocks. ``aux``: the family's extra inputs (``control``, ``sizes``, ...).
        """
        o = objective or ObjectiveConfig()
        # No denoiser: a caller checking the inputs alone (the errors prepare raises).
        dtype = torch.float32 if denoiser is None else common.param_dtype(denoiser)
        text = self.text_from_ids(denoiser, text)
        p = self.prepare(latents, text, generator, objective=o, t=t, noise=noise, mask=mask, dtype=dtype, **aux)
        target = p.target if base_target is None else self.preserved_target(denoiser, p, base_target)
        with routed(denoiser, self.routed_stack, route):
            prediction = self.predict(denoiser, p)
        return obj.per_sample_loss(prediction, target, p.weights, kind=o.loss, huber_c=o.huber_c,
                               mask=p.mask)

    def preserved_target(self, denoiser: torch.nn.Module, prepared: Prepared, which: torch.Tensor) -> torch.Tensor:
        """Output preservation (``datasets[].prior_target: base``): the target of the items ``which``
        (``[B]`` bool) is the base model's prediction on the same inputs, the LoRA switched off and
        no gradient taken; the others keep ``prepared.target``."""
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
        return common.single_frame(control, self.name).to(latents.device).float()

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
        m = mask.to(device=x0.device, dtype=torch.float32)
        if x0.ndim == 4 and m.ndim == 5:  # image families drop the frame axis
            m = m[:, :, 0]
        floor = (objective or ObjectiveConfig()).mask_min_weight
        w = obj.mask_weights(m, floor).expand(x0.shape).contiguous()
        return pack(w) if pack is not None else w

    def estimate_controls(self, latents: torch.Tensor, denoiser: torch.nn.Module,
                          references: int = 1) -> dict[str, torch.Tensor]:
        """The control arguments of ``loss`` a memory estimate passes (``uses_control`` families): each of the
        datasets' ``references`` reference images the size of the target, as conditioning latents."""
        return {"control": latents.clone() if references == 1 else torch.cat([latents] * references, dim=2)}


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
