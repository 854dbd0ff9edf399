"""What a run measures of itself: the eval loss (``train.eval``) and the profiler window (``train.profile``)."""

from __future__ import annotations

from pydantic import Field, model_validator

from diffpipe.config.base import MAX_STEPS, Int, Quantile, Section, Seed


class EvalConfig(Section):
    every_steps: Int = Field(
        0, description="Eval loss every N optimizer steps (0: only before and after training).", ge=0, le=MAX_STEPS
    )
    quantiles: list[Quantile] = Field(
        [0.1, 0.3, 0.5, 0.7, 0.9],
        description="Timestep quantiles the eval loss is measured at (empty: no eval).",
    )
    max_items: Int = Field(
        16, description="Eval items (the `eval` split, else a fixed subset of training items).", ge=1, le=100_000
    )
    seed: Seed = Field(0, description="Seed of the fixed eval noise.")

    @model_validator(mode="after")
    def _check_quantiles(self) -> EvalConfig:
        if any(not 0 < q < 1 for q in self.quantiles):
            raise ValueError(f"train.eval.quantiles must lie strictly between 0 and 1, got {self.quantiles}")
        return self


class ProfileConfig(Section):
    skip: Int = Field(
        2, description="Optimizer steps trained before the profiler records (the first steps are slower: "
        "allocation, compilation).", ge=0, le=MAX_STEPS,
    )
    steps: Int = Field(0, description="Optimizer steps the profiler records (0: no profiling).", ge=0, le=1_000)
