"""The memory planner (``train.memory: auto``, ``diffpipe plan-memory``) on FLUX.1-dev's real-size estimates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from diffpipe import memory_plan as mp
from diffpipe import train_job
from diffpipe.cli import app
from diffpipe.config import Config, ConfigError, parse_config
from diffpipe.estimate import GiB
from diffpipe.paths import RunPaths

# bf16 written, as the docs' fits table writes it (``auto`` is bf16 on a GPU too): the two share estimates.
_TRAIN = {"batch_size": 1, "precision": "bf16", "lora": {"rank": 16}}


def _cfg(**train) -> Config:
    return Config.model_validate({"model": {"family": "flux"}, "datasets": [{"name": "d", "path": "data",
                                  "resolution": 1024}], "train": {**_TRAIN, **train}})


@pytest.fixture(scope="module")
def estimate(cached_estimate):
    """FLUX.1-dev at 1024 px, rank 16 (tests/unit/conftest.py: each estimate built once for the session)."""

    def one(cfg: Config, **sizes) -> object:
        assert sizes.get("model") in (None, "flux1-dev")
        return cached_estimate(cfg, model="flux1-dev")

    return one


def _plan(cfg: Config, gib: float, estimate, **kw) -> mp.MemoryPlan:
    return mp.plan_memory(cfg, int(gib * GiB), estimate=estimate, **kw)


def _fits(c: mp.Candidate, plan: mp.MemoryPlan) -> bool:
    ram = c.estimate.cpu_bytes + c.estimate.activation_cpu_bytes
    return (c.estimate.total_bytes + mp.margin_bytes(c.estimate) <= plan.gpu_bytes
            and (plan.system_bytes is None or ram <= plan.system_bytes))


@pytest.mark.parametrize("gib", [80, 24, 16, 12])
def test_the_plan_and_its_runner_up_fit_the_budget_with_the_margin(estimate, gib):
    plan = _plan(_cfg(), gib, estimate)
    assert _fits(plan.chosen, plan) and plan.runner_up is not None and _fits(plan.runner_up, plan)
    # The margin is the CUDA context plus the estimate's measured error.
    e = plan.chosen.estimate
    assert mp.margin_bytes(e) == mp.CONTEXT_BYTES + int(0.15 * e.total_bytes)
    assert plan.chosen.estimate.block_swap == plan.chosen.settings["block_swap"]


def test_flux_at_24_gib_trains_fp8_with_checkpointing_and_at_12_swaps_or_quantises_more(estimate):
    assert _plan(_cfg(), 80, estimate).chosen.settings["base_weights"] == "auto"  # bf16 fits: nothing to save
    at24 = _plan(_cfg(), 24, estimate).chosen.settings
    assert at24 == {"base_weights": "fp8", "activation_checkpointing": True, "block_swap": 0,
                    "activation_offload": False}
    at12 = _plan(_cfg(), 12, estimate).chosen.settings
    assert at12["block_swap"] > 0 or at12["base_weights"] == "nf4"


def test_explicit_settings_are_never_changed(estimate):
    # bf16 written explicitly: kept at 24 GiB, where fp8 would be faster (it needs blocks swapped to fit).
    plan = _plan(_cfg(base_weights="auto"), 24, estimate)
    assert plan.explicit == ("base_weights",)
    assert plan.chosen.settings["base_weights"] == "auto" and plan.chosen.settings["block_swap"] > 0
    assert plan.runner_up is None or plan.runner_up.settings["base_weights"] == "auto"
    applied = mp.apply_plan(_cfg(base_weights="auto"), plan.as_dict())
    assert applied.train.base_weights == "auto" and applied.train.activation_checkpointing
    # Checkpointing off, written: every setting keeps FLUX's ~25 GiB of activations, so nothing fits 24 GiB.
    with pytest.raises(mp.NothingFits, match="activation_checkpointing off"):
        _plan(_cfg(activation_checkpointing=False), 24, estimate)


def test_a_lossy_base_weight_only_when_no_better_one_fits_within_the_slowdown_bound(estimate):
    # At 24 GiB bf16 fits with blocks swapped, slower than fp8 by more than the default 10%...
    fast = _plan(_cfg(), 24, estimate)
    bf16 = _plan(_cfg(base_weights="auto"), 24, estimate).chosen
    assert bf16.cost > fast.chosen.cost * (1 + mp.SLOWDOWN)
    # ...and within a 50% bound: then bf16 is chosen over the faster fp8.
    assert _plan(_cfg(), 24, estimate, slowdown=0.5).chosen.settings == bf16.settings
    # The ranking itself: the faster nf4 wins only beyond the bound.
    e = fast.chosen.estimate
    slow_bf16 = mp.Candidate({"base_weights": "auto"}, e, 1.5)
    fast_nf4 = mp.Candidate({"base_weights": "nf4"}, e, 1.4)
    assert mp.rank([fast_nf4, slow_bf16], 0.1)[0] is slow_bf16
    assert mp.rank([fast_nf4, slow_bf16], 0.05)[0] is fast_nf4


def test_nothing_fits_names_the_closest_setting_and_the_miss(estimate):
    with pytest.raises(mp.NothingFits) as err:
        _plan(_cfg(), 4, estimate)
    message = str(err.value)
    assert "no memory setting fits a 4.0 GiB GPU; the closest, base_weights " in message
    assert " GiB of GPU memory" in message and "misses by " in message
    # System RAM too small for the swap 12 GiB needs: the miss is named as system RAM.
    with pytest.raises(mp.NothingFits, match="GiB of system RAM"):
        _plan(_cfg(base_weights="fp8", activation_checkpointing=True), 12, estimate, system_bytes=GiB)


def test_plan_memory_command_prints_the_plan_and_exits_1_when_nothing_fits(tmp_path, monkeypatch, estimate):
    monkeypatch.setattr(mp, "estimate_memory", estimate)
    config = tmp_path / "flux.yaml"
    config.write_text(yaml.safe_dump({"model": {"family": "flux"}, "train": _TRAIN,
                                      "datasets": [{"name": "d", "path": str(tmp_path), "resolution": 1024}]}))
    runner = CliRunner()
    out = runner.invoke(app, ["plan-memory", "-c", str(config), "--model", "flux1-dev", "--gpu-memory", "24"])
    assert out.exit_code == 0, out.output
    assert "margin: 1.5 GiB CUDA context + 15% of the estimate" in out.output
    assert "chosen: base_weights fp8, activation_checkpointing on, block_swap 0, activation_offload off: estimate" in out.output
    assert "runner-up: base_weights " in out.output
    out = runner.invoke(app, ["plan-memory", "-c", str(config), "--model", "flux1-dev", "--gpu-memory", "4"])
    assert out.exit_code == 1 and "the closest, base_weights" in out.output


def _train_cfg(tmp_path: Path, **train) -> Config:
    return parse_config({"output_dir": str(tmp_path / "run"), "model": {"family": "flux"},
                         "datasets": [{"name": "d", "path": str(tmp_path / "data"), "resolution": 1024}],
                         "train": {**_TRAIN, **train}})


def test_train_refuses_memory_auto_without_a_gpu_or_gpu_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(train_job.PLAN_ENV, raising=False)
    cfg = _train_cfg(tmp_path, memory="auto")
    paths = RunPaths(cfg.output_dir)
    with pytest.raises(ConfigError, match="no CUDA GPU: set train.gpu_memory"):
        train_job.run_train_job(cfg, paths, train_job.TrainRequest(Path("c.yaml")), log=print)
    assert not paths.train_dir.exists()


def test_train_applies_the_plan_to_the_unset_keys_and_logs_it(tmp_path, monkeypatch, estimate):
    monkeypatch.setattr(mp, "estimate_memory", estimate)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # gpu_memory given: plans on CPU too
    monkeypatch.delenv(train_job.PLAN_ENV, raising=False)
    logged = []
    cfg = _train_cfg(tmp_path, memory="auto", gpu_memory=24, activation_offload=False)
    planned_cfg, planned = train_job._memory_plan(cfg, False, logged.append)
    tc = planned_cfg.train
    assert (tc.base_weights, tc.activation_checkpointing, tc.block_swap) == ("fp8", True, 0)
    assert planned["explicit"] == ["activation_offload"] and planned["chosen"]["base_weights"] == "fp8"
    assert any(line.startswith("train: memory plan: chosen: base_weights fp8") for line in logged)
    assert train_job._memory_plan(_train_cfg(tmp_path), False, logged.append)[1] is None  # manual: as written


def test_a_model_whose_activations_cannot_be_measured_gets_no_plan(estimate):
    from dataclasses import replace

    def unmeasured(cfg: Config):
        return replace(estimate(cfg), activation_bytes=None)  # as for Lumina 2's mask, read on meta

    with pytest.raises(ValueError, match="cannot be measured on the meta device"):
        mp.plan_memory(_cfg(), 24 * GiB, estimate=unmeasured)


# -- properties over many configs: explicit keys are kept, lossy bases only beyond the slowdown bound ----------
_WRITTEN = {"base_weights": st.sampled_from(["auto", "fp8", "int8", "nf4"]),
            "activation_checkpointing": st.booleans(), "activation_offload": st.booleans(),
            "block_swap": st.sampled_from([0, 10, 40])}
_BUDGETS = st.sampled_from([10, 12, 16, 24, 40, 80])


def _swap_derived(estimate):
    """Estimates with ``block_swap`` written, derived from the unswapped one (what the planner does itself):
    keeps the property tests to the few real estimates the module builds anyway."""
    def one(cfg: Config):
        n = cfg.train.block_swap
        base = estimate(cfg.model_copy(update={"train": cfg.train.model_copy(update={"block_swap": 0})}))
        return base.swapped(n) if n else base

    return one


def _written_cfg(written: dict) -> Config:
    try:
        return _cfg(**written)
    except ValueError:  # a combination the train section refuses (e.g. nf4 with block_swap): nothing to plan
        assume(False)


@settings(max_examples=40, deadline=None)
@given(written=st.fixed_dictionaries({}, optional=_WRITTEN), gib=_BUDGETS, slowdown=st.sampled_from([0.0, 0.1, 0.3]))
def test_the_planner_never_changes_a_written_key(estimate, written, gib, slowdown):
    cfg = _written_cfg(written)
    try:
        plan = _plan(cfg, gib, _swap_derived(estimate), slowdown=slowdown)
    except mp.NothingFits as err:
        assert "misses by" in str(err)
        return
    assert set(plan.explicit) == set(written)
    for c in (plan.chosen, plan.runner_up):
        assert c is None or all(c.settings[k] == v for k, v in written.items()), (written, c.settings)
    applied = mp.apply_plan(cfg, plan.as_dict()).train
    assert all(getattr(applied, k) == v for k, v in written.items())
    # optimizer_in_backward is planned for full fine-tuning only: a LoRA plan leaves it out.
    assert set(plan.chosen.settings) <= set(mp.KEYS) and "optimizer_in_backward" not in plan.chosen.settings
    assert {k: getattr(applied, k) for k in plan.chosen.settings} == plan.chosen.settings


@settings(max_examples=30, deadline=None)
@given(written=st.fixed_dictionaries({}, optional={k: v for k, v in _WRITTEN.items() if k != "base_weights"}),
       gib=_BUDGETS, slowdown=st.sampled_from([0.0, 0.1, 0.3, 1.0]))
def test_a_lossy_base_is_never_chosen_while_a_better_one_fits_within_the_bound(estimate, written, gib, slowdown):
    cfg, est = _written_cfg(written), _swap_derived(estimate)
    try:
        chosen = _plan(cfg, gib, est, slowdown=slowdown).chosen
    except mp.NothingFits:
        return
    fastest = _plan(cfg, gib, est, slowdown=0.0).chosen.cost
    assert chosen.cost <= fastest * (1 + slowdown) + 1e-9
    for base, quality in mp.QUALITY.items():
        if quality >= mp.QUALITY[chosen.settings["base_weights"]]:
            continue
        try:  # the best setting with this better base weight written
            better = _plan(_cfg(**written, base_weights=base), gib, est, slowdown=slowdown).chosen
        except (mp.NothingFits, ValueError):
            continue
        assert better.cost > fastest * (1 + slowdown), (base, better.describe(), chosen.describe())


def test_the_train_digest_holds_the_planned_settings_not_the_gpu_size(tmp_path, monkeypatch, estimate):
    """A GPU that changes the plan reruns train; one that keeps it (or a memory: manual run) does not."""
    from diffpipe.stages import stage_digest

    monkeypatch.setattr(mp, "estimate_memory", estimate)

    def digest(**train) -> str:
        return stage_digest(_train_cfg(tmp_path, memory="auto", **train), "train")

    assert digest(gpu_memory=80) == digest(gpu_memory=60)  # bf16 without checkpointing fits both
    assert digest(gpu_memory=80) != digest(gpu_memory=24)  # 24 GiB: fp8 + checkpointing
    assert digest(gpu_memory=24) != digest(gpu_memory=12)  # 12 GiB: blocks swapped too
    # A written key stays a rerun trigger as written; the planned ones follow the plan.
    assert digest(gpu_memory=24, lr=0.5) != digest(gpu_memory=24)
    # No GPU to plan for when the workflow starts (a login node, gpu_memory unset): the train job plans.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert digest() == digest()


def test_the_docs_fits_table_is_the_planners(estimate):
    """docs/training.md's fits table names, per card, what the planner chooses (``make docs`` refreshes it: too
    slow for every test run); its FLUX.1-dev row must be current."""
    from diffpipe.fits import FITS_MODELS, fits_row
    from diffpipe.readme_tables import REPO_ROOT

    row = fits_row(FITS_MODELS[0], estimate)
    assert row in (REPO_ROOT / "docs" / "training.md").read_text(), "run `make docs`"
    cells = row.strip("| ").split(" | ")
    for gib, cell in zip((24, 16, 12), cells[7:10], strict=True):
        assert cell == _plan(_cfg(), gib, estimate).chosen.short()


def test_doctor_prints_the_plan_under_memory_auto(tmp_path, monkeypatch, estimate):
    from diffpipe.doctor import _plan_checks

    monkeypatch.setattr(mp, "estimate_memory", estimate)
    assert _plan_checks(_train_cfg(tmp_path), 24 * GiB) == []  # manual: nothing to plan
    (check,) = _plan_checks(_train_cfg(tmp_path, memory="auto"), 24 * GiB)  # the smallest GPU's 24 GiB
    assert check.ok and "chosen: base_weights fp8, activation_checkpointing on" in check.detail
    assert "runner-up: base_weights " in check.detail and "estimate " in check.detail
    (check,) = _plan_checks(_train_cfg(tmp_path, memory="auto", gpu_memory=4), 24 * GiB)
    assert not check.ok and "the closest, base_weights" in check.detail and "misses by" in check.detail
    (check,) = _plan_checks(_train_cfg(tmp_path, memory="auto"), 0)  # no GPU, no gpu_memory
    assert not check.ok and "train.gpu_memory" in check.fix


def test_full_fine_tune_plans_the_optimizer_in_the_backward_pass_where_the_config_allows_it(estimate):
    """FLUX.1-dev full fine-tuning with 8-bit states on a 141 GiB card: stepping in the backward pass (no cost)
    fits without checkpointing; where grad_clip keeps it out, nothing fits (all gradients, float32 copies too)."""
    full = {"mode": "full", "optimizer": "adamw8bit"}
    plan = _plan(_cfg(**full, grad_clip=0), 141, estimate)
    assert plan.chosen.settings == {"base_weights": "auto", "activation_checkpointing": False, "block_swap": 0,
                                    "activation_offload": False, "optimizer_in_backward": True}
    assert "optimizer_in_backward on" in plan.lines()[1]
    with pytest.raises(mp.NothingFits, match="optimizer_in_backward off"):  # grad_clip 1.0: all gradients at once
        _plan(_cfg(**full), 141, estimate)
    applied = mp.apply_plan(_cfg(**full, grad_clip=0), plan.as_dict())
    assert applied.train.optimizer_in_backward


def test_a_plan_builds_the_denoiser_once_and_traces_each_forward_once(monkeypatch, shallow_flux):
    """Every one of the 12 candidates (4 base weights x checkpointing x offload) is estimated where nothing fits,
    yet the plan builds the meta denoiser once (fp8's and int8's are converted copies; bf16 and nf4 share the
    plain one) and runs 3 forwards, one per denoiser (each counted with checkpointing and without; offload
    moves what the checkpointed forward saved), not a build and a forward per candidate."""
    from diffpipe import saved_activations
    from diffpipe.families.published import PUBLISHED, Published

    monkeypatch.setitem(PUBLISHED, shallow_flux.name, shallow_flux)
    builds, forwards = [], []
    build_meta, fused = Published.build_meta, saved_activations._fused_attention
    monkeypatch.setattr(Published, "build_meta", lambda self: builds.append(self.name) or build_meta(self))
    monkeypatch.setattr(saved_activations, "_fused_attention", lambda: forwards.append(1) or fused())
    with pytest.raises(mp.NothingFits):  # 1 GiB: below the CUDA context alone
        mp.plan_memory(_cfg(), GiB, model=shallow_flux.name)
    assert len(builds) == 1 and len(forwards) == 3, (builds, forwards)
