import pytest

from diffpipe.training.checkpoint import (
    ResumeError,
    check_resumable,
    config_differences,
    list_checkpoints,
    resolve_checkpoint,
)


def test_config_differences_names_meaningful_keys_only():
    saved = {"output_dir": "a", "train": {"lr": 1e-3, "checkpoint_every_steps": 2, "lora": {"rank": 4}},
             "datasets": [{"name": "d", "path": "/x"}]}
    now = {"output_dir": "b", "train": {"lr": 2e-3, "checkpoint_every_steps": 5, "lora": {"rank": 8}},
           "datasets": [{"name": "e", "path": "/y"}]}
    assert config_differences(saved, now) == ["datasets.0.name", "train.lora.rank", "train.lr"]
    assert config_differences(saved, saved) == []
    # How many non-finite steps in a row stop a run may change on resume: no trained step differs.
    assert config_differences({"train": {"max_nonfinite_steps": 5}}, {"train": {"max_nonfinite_steps": 20}}) == []


def test_check_resumable_message(tmp_path):
    meta = {"config": {"train": {"lr": 1.0}}, "world_size": 2, "data_digest": "a"}
    with pytest.raises(ResumeError) as err:
        check_resumable(meta, config={"train": {"lr": 2.0}}, world_size=1, data_digest="b", ckpt=tmp_path)
    msg = str(err.value)
    assert "train.lr: checkpoint 1.0, config 2.0" in msg and "processes: checkpoint 2, now 1" in msg
    assert "training data" in msg


def test_only_complete_checkpoints_are_listed(tmp_path):
    for name in ["step-000010", "step-000002", ".tmp-step-000012", "step-000011"]:
        (tmp_path / name).mkdir()
    for name in ["step-000010", "step-000002"]:
        (tmp_path / name / "diffpipe.json").write_text("{}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000010"]
    assert resolve_checkpoint(tmp_path).name == "step-000010"
    assert resolve_checkpoint(tmp_path, "step-000002").name == "step-000002"
    with pytest.raises(FileNotFoundError, match="step-000002, step-000010"):
        resolve_checkpoint(tmp_path, "step-000011")


def test_caption_dropout_swaps_in_the_empty_caption():
    import torch

    from diffpipe.training.loop import _drop_captions

    text = {"prompt_embeds": torch.ones(2000, 3, 2)}
    empty = {"prompt_embeds": torch.zeros(1, 3, 2)}
    out = _drop_captions(text, empty, 0.3, torch.Generator().manual_seed(0))
    dropped = (out["prompt_embeds"] == 0).all(dim=(1, 2))
    assert 0.25 < dropped.float().mean() < 0.35
    assert (out["prompt_embeds"][~dropped] == 1).all() and (text["prompt_embeds"] == 1).all()


def test_a_new_gpu_budget_that_keeps_the_planned_settings_resumes():
    """Under train.memory: auto the checkpoint's config holds the planned settings themselves: a changed budget
    (or memory: manual with the same settings) may resume; a plan that changed them may not."""
    saved = {"train": {"memory": "auto", "gpu_memory": 24, "base_weights": "fp8", "block_swap": 0}}
    assert config_differences(saved, {"train": {**saved["train"], "gpu_memory": 22}}) == []
    assert config_differences(saved, {"train": {**saved["train"], "memory": "manual", "gpu_memory": None}}) == []
    assert config_differences(saved, {"train": {**saved["train"], "gpu_memory": 12, "block_swap": 30}}) == [
        "train.block_swap"]
