"""Wan 2.2 A14B's two experts trained in one run (``model.expert: both``).

:class:`WanExperts` holds the pipeline's ``transformer`` (high noise) and
``transformer_2`` (low noise) under those names and sends each sample to the
expert ``WanPipeline`` would call at its timestep (``timestep >= boundary_ratio
x 1000``: ``transformer``). It is called like one transformer, so the family's
loss, the DeepSpeed engine and the evaluator need no change, and its PEFT
state holds both LoRAs with ``transformer.`` / ``transformer_2.`` keys (split
per expert on export).

The timestep range each expert owns (:func:`expert_range`, :func:`keep_in_expert`) is what a run
training one of them (``high`` or ``low``) draws its noise levels from.
"""

from __future__ import annotations

from typing import Any

import peft
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from diffpipe.models.base import DenoiserPart
from diffpipe.paths import LOW_NOISE_SUFFIX

EXPERTS = ("transformer", "transformer_2")  # high noise first, as the pipeline checks them
#: ``model.expert`` -> the pipeline attribute of the transformer it trains.
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


def unshift_timesteps(sigma: float, shift: float) -> float:
    """Inverse of ``objectives.shift_timesteps``: the fraction ``t`` whose shifted value is ``sigma``."""
    return sigma / (shift - (shift - 1) * sigma)


def expert_range(expert: str | None, boundary_ratio: float | None, shift: float) -> tuple[float, float]:
    """The trained expert's timestep range ``[lo, hi)`` as fractions before the shift ((0, 1): all).

    The pipeline switches experts where ``sigma * 1000 >= boundary_ratio * 1000``, with
    ``sigma`` the shifted fraction, so the boundary maps back through the inverse shift.
    """
    if expert in (None, "both"):  # both: each drawn timestep picks its expert
        return 0.0, 1.0
    cut = unshift_timesteps(boundary_ratio, shift)
    return (cut, 1.0) if expert == "high" else (0.0, cut)


def keep_in_expert(sigma: torch.Tensor, expert: str | None, boundary_ratio: float | None) -> torch.Tensor:
    """Shifted fractions held on the trained expert's side of the boundary: rounding must never hand the
    other expert's steps to this one (``high``: ``>= boundary``; ``low``: ``< boundary``)."""
    if expert == "high":
        return sigma.clamp(min=boundary_ratio)
    if expert == "low":
        return sigma.clamp(max=float(torch.nextafter(torch.tensor(boundary_ratio), torch.tensor(0.0))))
    return sigma


class WanExperts(torch.nn.Module):
    """Both experts; ``forward`` routes each sample by its timestep."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module, boundary_timestep: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self):
        """The experts share one architecture: the high-noise expert's config stands for both."""
        return self.transformer.config

    def experts(self) -> list[torch.nn.Module]:
        return [getattr(self, name) for name in EXPERTS]

    def add_adapter(self, config: peft.LoraConfig, adapter_name: str = "default") -> None:
        """The same LoRA config on each expert (each gets its own weights)."""
        for expert in self.experts():
            expert.add_adapter(config, adapter_name)
        # PEFT's state-dict helpers read the adapter config from the module they are handed.
        self.peft_config = self.transformer.peft_config

    def enable_gradient_checkpointing(self) -> None:
        for expert in self.experts():
            expert.enable_gradient_checkpointing()

    def route(self, timestep: torch.Tensor) -> torch.Tensor:
        """``[B]`` True where the high-noise expert (``transformer``) takes the sample, as ``WanPipeline`` decides."""
        return timestep.reshape(timestep.shape[0], -1)[:, 0] >= self.boundary_timestep

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        return_dict: bool = True,
        **kwargs: Any,
    ):
        high = self.route(timestep)
        outs, order = [], []
        for expert, chosen in zip(self.experts(), (high, ~high), strict=True):
            idx = chosen.nonzero().squeeze(1)
            if idx.numel() == 0:
                # The transformer cannot run on an empty batch; this expert's LoRA simply gets no
                # gradient this micro-batch (DeepSpeed fills unused gradients with zeros below ZeRO-3).
                continue

            def take(x, idx=idx):
                return x.index_select(0, idx) if torch.is_tensor(x) else x

            out = expert(
                take(hidden_states),
                take(timestep),
                take(encoder_hidden_states),
                return_dict=False,
                **{k: take(v) for k, v in kwargs.items()},
            )[0]
            outs.append(out)
            order.append(idx)
        # Back into the batch's order (an index_select keeps the autograd graph to each expert).
        sample = torch.cat(outs).index_select(0, torch.argsort(torch.cat(order)))
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)
