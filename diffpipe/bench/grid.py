"""The points of a ``diffpipe bench`` sweep and the training config each one runs."""

from __future__ import annotations

import itertools
from typing import Any

import yaml

from diffpipe.config import BENCH_AXES, Config, ConfigError
from diffpipe.resolve import parse_config

#: Columns of every point's settings in ``runs_summary.csv`` (the axes, then any ``train.`` keys swept).
SETTINGS = list(BENCH_AXES)


def parse_grid_args(args: list[str]) -> dict[str, list[Any]]:
    """``["batch_size=1,2", "precision=fp32,bf16"]`` -> ``{"batch_size": [1, 2], ...}`` (values read as YAML)."""
    grid: dict[str, list[Any]] = {}
    for arg in args:
        key, sep, values = arg.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ConfigError(f"--grid {arg!r}: write KEY=V1,V2 (e.g. batch_size=1,2,4)")
        if key not in BENCH_AXES and not key.startswith("train."):
            raise ConfigError(f"--grid {arg!r}: unknown axis {key!r}; axes: {', '.join(BENCH_AXES)} or a `train.` key")
        try:
            grid[key] = [yaml.safe_load(v) for v in values.split(",")]
        except yaml.YAMLError as err:
            raise ConfigError(f"--grid {arg!r}: a value is not valid YAML: {err}") from None
    return grid


def points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the axes' values, the first axis varying slowest (one point: ``[{}]``)."""
    keys = list(grid)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(grid[k] for k in keys))]


def _checkpointing(value: Any) -> dict[str, Any]:
    """``on``/``off``/``true``/``false``/1/0, or a fraction of the blocks (``0.5``): the train keys it sets."""
    if isinstance(value, str) and value.lower() in ("on", "off", "true", "false"):
        value = value.lower() in ("on", "true")
    if isinstance(value, bool) or value in (0, 1):
        return {"activation_checkpointing": bool(value), "checkpoint_fraction": 1.0}
    if isinstance(value, float) and 0 < value < 1:
        return {"activation_checkpointing": True, "checkpoint_fraction": value}
    raise ConfigError(f"bench axis activation_checkpointing {value!r}: use off, on or a fraction of the blocks "
                      "in (0, 1)")


def data_shape(cfg: Config, point: dict[str, Any], video: bool) -> tuple[int, int]:
    """(resolution, frames) of a point's synthetic batches: the axes', else the first dataset's."""
    ds = cfg.datasets[0]
    frames = (ds.frame_buckets or [1])[0] if video else 1
    res, frames = point.get("resolution", ds.training_resolutions()[-1]), point.get("frames", frames)
    for name, v in (("resolution", res), ("frames", frames)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"bench axis {name} {v!r}: must be a whole number >= 1")
    if frames > 1 and not video:
        raise ConfigError(f"bench axis frames {frames}: model family {cfg.model.family!r} trains on images")
    return res, frames


def point_config(cfg: Config, point: dict[str, Any], *, output_dir: str, steps: int,
                 profile: bool = False) -> Config:
    """The config a point trains with: the user's, the point's train settings, ``steps`` steps, and no
    eval, sampling or intermediate saves (they would run between the measured steps); ``train.profile``
    kept only with ``profile`` (a run whose speed is not measured)."""
    data = cfg.model_dump(mode="json")
    train = data["train"]
    for key, value in point.items():
        target = BENCH_AXES.get(key, key)
        if not target.startswith("train."):
            continue  # data axes shape the batches, not the config
        if key == "activation_checkpointing":
            train.update(_checkpointing(value))
            continue
        node = data
        *parents, leaf = target.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise ConfigError(f"bench axis {key!r}: {part!r} is not a config section")
            node = node[part]
        if leaf not in node:
            raise ConfigError(f"bench axis {key!r}: no config key {target}")
        node[leaf] = value
    train.update(max_steps=steps, sample_every_steps=0, sample_every_epochs=0, save_every_epochs=0,
                 checkpoint_every_steps=0, checkpoint_every_minutes=0, keep_checkpoints=1)
    if not profile:
        train["profile"] = {"steps": 0}
    train["eval"].update(every_steps=0, quantiles=[])
    data["output_dir"] = output_dir
    return parse_config(data, f"bench point {point}")


def settings(cfg: Config, point: dict[str, Any], shape: tuple[int, int]) -> dict[str, Any]:
    """A point's effective value of every axis (CSV columns), plus the ``train.`` keys it sweeps."""
    tc = cfg.train
    row: dict[str, Any] = {
        "batch_size": tc.batch_size, "precision": tc.precision, "base_weights": tc.base_weights,
        "activation_checkpointing": tc.checkpoint_fraction if tc.activation_checkpointing and
        tc.checkpoint_fraction < 1 else tc.activation_checkpointing, "compile": tc.compile,
        "attention_backend": tc.attention_backend, "zero_stage": tc.zero_stage,
        "resolution": shape[0], "frames": shape[1],
    }
    row.update({k: v for k, v in point.items() if k not in row})
    return row


def config_lines(point: dict[str, Any]) -> str:
    """The YAML that sets a point's train settings in a config (data axes as comments)."""
    nested: dict[str, Any] = {}
    notes = []
    for key, value in point.items():
        target = BENCH_AXES.get(key, key)
        if key == "activation_checkpointing":
            keys = _checkpointing(value)
            nested.setdefault("train", {}).update(
                keys if keys["checkpoint_fraction"] < 1 else {"activation_checkpointing": keys["activation_checkpointing"]})
            continue
        if not target.startswith("train."):
            notes.append(f"# {key}: {value} (datasets[].{'resolution' if key == 'resolution' else 'frame_buckets'})")
            continue
        node = nested
        *parents, leaf = target.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    text = yaml.safe_dump(nested, sort_keys=False) if nested else ""
    return text + "".join(n + "\n" for n in notes)
