"""``train.objective``: timestep sampling, the loss and its weighting."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from diffpipe.config.base import Float, Section


class ObjectiveConfig(Section):
    loss: Literal["mse", "huber"] = Field(
        "mse", description="`mse`, or `huber`: pseudo-Huber, robust to outlier items (Khrapov et al. 2024)."
    )
    huber_c: Float = Field(0.1, description="Pseudo-Huber constant: quadratic below it, linear above.", gt=0)
    timestep_sampling: Literal["uniform", "logit_normal"] | None = Field(
        None, description="How training timesteps are drawn; null = the family's own (sd: uniform, flux: logit-normal)."
    )
    logit_mean: Float = Field(0.0, description="Logit-normal sampling: mean.")
    logit_std: Float = Field(1.0, description="Logit-normal sampling: standard deviation.", gt=0)
    shift: Float | None = Field(
        None, description="Flow families: fixed timestep shift; null = the model's (resolution-dependent) shift.", gt=0
    )
    min_timestep: Float = Field(0.0, description="Lowest training timestep, as a fraction of the schedule.", ge=0, le=1)
    max_timestep: Float = Field(1.0, description="Highest training timestep, as a fraction of the schedule.", ge=0, le=1)
    min_snr_gamma: Float | None = Field(
        None, description="UNet families: Min-SNR-gamma loss weighting (Hang et al. 2023; 5 is usual); null = off.", gt=0
    )
    offset_noise: Float = Field(
        0.0, description="UNet families: offset noise strength (a per-channel constant added to the noise; 0.05-0.1).",
        ge=0,
    )
    # -- the SD3 paper's timestep densities and loss weightings (sd3) --
    weighting_scheme: Literal["none", "sigma_sqrt", "logit_normal", "mode", "cosmap"] | None = Field(
        None,
        description="sd3: timestep density and loss weighting of the SD3 paper (Esser et al. 2024), as diffusers' "
        "SD3 training defines them: `logit_normal` (density from logit_mean / logit_std, unweighted), `mode` "
        "(mode density with `mode_scale`, unweighted), `sigma_sqrt` (uniform, weight sigma^-2), `cosmap` "
        "(uniform, CosMap weight), `none` (uniform, unweighted). null = the family's default (timestep_sampling, "
        "unweighted). Set it or timestep_sampling, not both.",
    )
    mode_scale: Float = Field(
        1.29,
        description="`weighting_scheme: mode`: the density's scale s (1.29 in the SD3 paper; -1 to 2/(pi-2) "
        "keeps the mapping monotonic).",
        ge=-1,
        le=2 / (math.pi - 2),
    )
    mask_min_weight: Float = Field(
        0.0,
        description="Items with a loss mask (`datasets[].mask_path`): the loss weight where the mask is black; "
        "the weight is `mask_min_weight + (1 - mask_min_weight) x mask`, so 0 ignores masked-out areas.",
        ge=0,
        le=1,
    )

    @model_validator(mode="after")
    def _check_weighting(self) -> ObjectiveConfig:
        if self.weighting_scheme is not None and self.timestep_sampling is not None:
            raise ValueError(
                f"set weighting_scheme ({self.weighting_scheme!r}) or timestep_sampling "
                f"({self.timestep_sampling!r}), not both: the weighting scheme picks the timestep density too"
            )
        return self

    @model_validator(mode="after")
    def _check_range(self) -> ObjectiveConfig:
        if self.min_timestep >= self.max_timestep:
            raise ValueError(f"min_timestep ({self.min_timestep}) must be below max_timestep ({self.max_timestep})")
        return self
