"""FLOP counting (hand counts), device peaks, the profiler window and the bench grid's pieces."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

from diffpipe.bench import grid as g
from diffpipe.bench.sweep import measure
from diffpipe.config import ConfigError, ProfileConfig, TrainConfig, parse_config
from diffpipe.training.flops import StepFlops, counted, device_peak_tflops, peak_for_name
from diffpipe.training.profiling import StepProfiler

B, S, IN, HID, OUT, HEADS = 2, 6, 16, 32, 8, 4


class _Stack(torch.nn.Module):
    """Linear -> self-attention over the hidden features (4 heads) -> Linear."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(IN, HID), torch.nn.Linear(HID, OUT)

    def forward(self, x):
        h = self.fc1(x).view(B, S, HEADS, HID // HEADS).transpose(1, 2)
        h = F.scaled_dot_product_attention(h, h, h).transpose(1, 2).reshape(B, S, HID)
        return self.fc2(h)


def _hand_count() -> int:
    """2·rows·in·out per matrix product; attention: QKᵀ and AV forward (2), five products backward."""
    rows, d = B * S, HID // HEADS
    linear = lambda i, o: 2 * rows * i * o  # noqa: E731
    attn = 2 * B * HEADS * S * S * d  # one of its products
    forward = linear(IN, HID) + 2 * attn + linear(HID, OUT)
    # backward: fc2 input and weight grads, attention's five products, fc1 weight grad only (x needs no grad)
    backward = 2 * linear(HID, OUT) + 5 * attn + linear(IN, HID)
    return forward + backward


def test_flops_of_a_known_stack_equal_the_hand_count():
    model, x = _Stack(), torch.randn(B, S, IN)
    with counted() as mode:
        model(x).square().mean().backward()
    assert mode.get_total_flops() == _hand_count()


def test_step_flops_counts_each_shape_once_and_gives_tflops_and_mfu():
    model = _Stack()
    flops = StepFlops(TrainConfig(peak_tflops=2.0), torch.device("cpu"))
    seen = []
    for shape in ("a", "a", "b"):
        with flops.step(shape):
            seen.append(_get_current_dispatch_mode() is not None)  # the counter is active
            model(torch.randn(B, S, IN)).sum().backward()
        fields = flops.fields(0.5)
        assert fields["flops_per_step"] == _hand_count()
        assert fields["tflops_per_device"] == pytest.approx(_hand_count() / 0.5 / 1e12)
        assert fields["mfu"] == pytest.approx(fields["tflops_per_device"] / 2.0)
    assert seen == [True, False, True]  # the second step of shape "a" reuses the count
    assert "mfu" not in StepFlops(TrainConfig(), torch.device("cpu")).fields(1.0)  # no CPU peak
    assert StepFlops(TrainConfig(count_flops=False), torch.device("cpu")).fields(1.0) == {}


def test_device_peaks_by_name():
    assert peak_for_name("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_for_name("NVIDIA H100 PCIe", "bf16") == 756.0  # the more specific entry wins
    assert peak_for_name("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_for_name("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on Volta
    assert peak_for_name("Some New GPU", "bf16") is None
    assert device_peak_tflops(torch.device("cpu"), "fp32") is None


def test_profiler_window_writes_a_trace_and_an_operator_summary(tmp_path):
    prof = StepProfiler(ProfileConfig(skip=1, steps=2), tmp_path, rank=0)
    a = torch.randn(64, 64)
    for _ in range(4):
        (a @ a).relu().sum()
        prof.step()
    prof.close()
    traces = list((tmp_path / "trace").glob("*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    rows = list(csv.DictReader((tmp_path / "ops.csv").open()))
    assert rows and {"op", "calls", "self_cpu_us", "flops"} <= set(rows[0])
    mm = next(r for r in rows if r["op"] == "aten::mm")
    assert int(mm["calls"]) == 2 and int(mm["flops"]) == 2 * 2 * 64**3  # two recorded steps
    assert "aten::mm" in (tmp_path / "ops.txt").read_text()
    StepProfiler(ProfileConfig(), tmp_path / "off").close()  # steps 0: off, writes nothing
    assert not (tmp_path / "off").exists()


def test_grid_arguments_points_and_config_lines():
    axes = g.parse_grid_args(["batch_size=1,2", "precision=fp32,bf16", "train.grad_accum=2"])
    assert axes == {"batch_size": [1, 2], "precision": ["fp32", "bf16"], "train.grad_accum": [2]}
    pts = g.points(axes)
    assert len(pts) == 4 and pts[1] == {"batch_size": 1, "precision": "bf16", "train.grad_accum": 2}
    assert g.points({}) == [{}]
    for bad in ("batch_size", "speed=1,2", "batch_size="):
        with pytest.raises(ConfigError, match="--grid"):
            g.parse_grid_args([bad])
    cfg = parse_config({"output_dir": "/tmp/x", "datasets": [{"name": "d", "path": "/tmp/d", "resolution": 48}]})
    pcfg = g.point_config(cfg, {**pts[1], "activation_checkpointing": "on", "resolution": 64},
                          output_dir="/tmp/x/bench/p001", steps=7)
    tc = pcfg.train
    assert (tc.batch_size, tc.precision, tc.grad_accum, tc.activation_checkpointing, tc.max_steps) == (
        1, "bf16", 2, True, 7)
    assert tc.eval.quantiles == [] and tc.sample_every_steps == 0 and pcfg.output_dir == "/tmp/x/bench/p001"
    profiled = cfg.model_copy(update={"train": TrainConfig(profile=ProfileConfig(skip=1, steps=2))})
    assert g.point_config(profiled, {}, output_dir="/tmp/x/p", steps=3).train.profile.steps == 0  # timed: off
    assert g.point_config(profiled, {}, output_dir="/tmp/x/p", steps=3, profile=True).train.profile.steps == 2
    assert g.data_shape(cfg, {}, video=False) == (48, 1)
    assert "batch_size: 1" in g.config_lines(pts[1]) and "grad_accum: 2" in g.config_lines(pts[1])
    half = g.point_config(cfg, {"activation_checkpointing": 0.5}, output_dir="/tmp/x/p", steps=1).train
    assert (half.activation_checkpointing, half.checkpoint_fraction) == (True, 0.5)
    assert "checkpoint_fraction: 0.5" in g.config_lines({"activation_checkpointing": 0.5})
    with pytest.raises(ConfigError, match="a fraction of the blocks"):
        g.point_config(cfg, {"activation_checkpointing": 1.5}, output_dir="/tmp/x/p", steps=1)
    with pytest.raises(ConfigError, match="train.batch_size"):  # the point's config is validated
        g.point_config(cfg, {"batch_size": 0}, output_dir="/tmp/x/p", steps=1)


def test_measure_skips_warmup_and_takes_percentiles(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    times = [9.0, 1.0, 2.0, 3.0, 4.0]  # step 1 is warm-up
    metrics.write_text("".join(json.dumps({"step": i + 1, "step_time": t, "samples_per_s": 4 / t,
                                           "peak_memory_mb": 100.0 + i, "flops_per_step": 8e12}) + "\n"
                               for i, t in enumerate(times)))
    m = measure(metrics, warmup=1)
    assert m["samples_per_s_per_device"] == pytest.approx(16 / 10)
    assert (m["step_time_p50_s"], m["step_time_p95_s"], m["peak_memory_mb"]) == (2.5, 4.0, 104.0)
    assert m["tflops_per_device"] == pytest.approx(8 / 2.5) and "mfu" not in m


def test_bench_refuses_an_out_folder_it_did_not_make(tmp_path):
    from diffpipe.bench.sweep import MARKER, prepare_out

    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not made by diffpipe bench"):
        prepare_out(user)
    assert sorted(p.name for p in user.iterdir()) == ["notes.txt"]
    ours = prepare_out(tmp_path / "bench")
    (ours / "runs_summary.csv").write_text("old")
    assert prepare_out(ours) == ours and (ours / MARKER).is_file()  # a sweep's own folder is reused
