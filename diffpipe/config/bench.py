"""``bench``: the grid of ``diffpipe bench`` speed and memory sweeps."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, Strict, field_validator

from diffpipe.config.base import Float, Int, Section, Text

#: Grid axes of ``diffpipe bench`` and the config key each one sets (``data`` axes shape the synthetic batches).
BENCH_AXES: dict[str, str] = {
    "batch_size": "train.batch_size",
    "precision": "train.precision",
    "base_weights": "train.base_weights",
    "activation_checkpointing": "train.activation_checkpointing",
    "compile": "train.compile",
    "attention_backend": "train.attention_backend",
    "zero_stage": "train.zero_stage",
    "resolution": "data.resolution",
    "frames": "data.frames",
}
GridValue = Annotated[bool, Strict()] | Annotated[int, Strict()] | Float | Text


class BenchConfig(Section):
    grid: dict[Text, Annotated[list[GridValue], Field(min_length=1, max_length=1_000)]] = Field(
        {}, description="Axes of the sweep, each a list of values; every combination is one point. Axes: "
        + ", ".join(f"`{a}`" for a in BENCH_AXES) + ", or any `train.` key (e.g. `train.grad_accum`). "
        "`diffpipe bench --grid KEY=V1,V2` adds or replaces an axis.",
    )
    warmup_steps: Int = Field(2, description="Steps each point trains before measuring (not counted).", ge=0,
                              le=10_000)
    steps: Int = Field(5, description="Measured steps per point.", ge=1, le=100_000)
    data: Literal["synthetic", "cache"] = Field(
        "synthetic", description="What points train on: `synthetic` = random latents (and one encoded caption) "
        "of a square bucket at each resolution, no cache needed; `cache` = the run's caches.",
    )
    memory_limit_mb: Int | None = Field(
        None, description="Cap on each point's address space (RLIMIT_AS) in MiB, so a CPU point that needs more "
        "fails as `oom` instead of swapping; null = no cap. On a GPU the device's memory is the cap.", ge=64,
        le=1 << 30,
    )
    timeout_minutes: Float = Field(30.0, description="A point running longer is stopped and recorded as "
                                   "`timeout`.", gt=0)
    convergence_precisions: list[Literal["fp32", "bf16", "fp16", "fp8"]] = Field(
        ["fp32", "bf16", "fp8"], description="`diffpipe bench --convergence`: the precisions compared (`fp8` = "
        "fp8 base weights, computing in bf16).", min_length=1,
    )
    convergence_optimizers: list[Literal["adamw", "adamw8bit", "adamw4bit", "adamw-in-backward",
                                         "adamw8bit-in-backward", "adamw4bit-in-backward"]] = Field(
        ["adamw"], description="`diffpipe bench --convergence`: the optimizers compared at each precision (`adamw`: "
        "float32 moments; `adamw8bit` / `adamw4bit`: torchao's quantised moments; `-in-backward`: stepped in the "
        "backward pass, which needs train.mode full, grad_clip 0 and grad_accum 1).", min_length=1,
    )
    convergence_steps: Int = Field(50, description="`diffpipe bench --convergence`: steps per precision.", ge=1,
                                   le=1_000_000)

    @field_validator("grid")
    @classmethod
    def _known_axes(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key in grid:
            if key not in BENCH_AXES and not key.startswith("train."):
                raise ValueError(f"unknown axis {key!r}; axes: {', '.join(BENCH_AXES)} or a `train.` key")
        return grid
