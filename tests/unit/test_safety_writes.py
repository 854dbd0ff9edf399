"""Issue #14, items 1 and 4: atomic writes never replace a user's folder, and they are synced to disk.

The CLI tests give ``diffpipe sample --out``, ``diffpipe import-lora`` and
``diffpipe export --out`` a folder holding a user's files: each must refuse
(exit 1, the folder named) and leave every file as it was, while replacing
diffpipe's own earlier output keeps working. A power loss cannot be produced
here, so the durability tests record the ``os.fsync`` calls (the one thing
replaced) and check that every trusted file and its folder are synced.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import export_lora
from diffpipe.families import get_family
from diffpipe.training.adapter import add_lora, lora_state_dict, peft_config, save_adapter
from diffpipe.utils import (
    OUTPUT_MARKER,
    NotOurFolderError,
    atomic_path,
    fsync_dir,
    fsync_file,
    fsync_tree,
    write_text_atomic,
)

USER_FILES = {f"photo-{i:02d}.jpg": f"user bytes {i}" for i in range(14)}
USER_FILES |= {"notes.txt": "my notes", "README.md": "# my README", "sub/deep.txt": "nested"}  # 17 files


def _user_folder(folder: Path, files: dict[str, str] = USER_FILES) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def _intact(folder: Path) -> None:
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    assert found == set(USER_FILES), f"files changed: {sorted(found ^ set(USER_FILES))}"
    for name, text in USER_FILES.items():
        assert (folder / name).read_text() == text


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    """A tiny SD LoRA: its PEFT folder and its diffusers export."""
    root = tmp_path_factory.mktemp("safety-lora")
    family = get_family(ModelConfig())
    denoiser = family.load_denoiser()
    targets = family.lora_targets(None)
    cfg = peft_config(LoraConfig(rank=4, alpha=4, targets=targets), targets)
    add_lora(denoiser, cfg)
    save_adapter(root / "adapter", lora_state_dict(denoiser), cfg, {"family": "sd", "flavor": "tiny"})
    result = export_lora(root / "adapter", root / "export", family, ["diffusers"])
    return {"root": root, "adapter": root / "adapter", "diffusers": result.files["diffusers"]}


def _sample_config(root: Path) -> Path:
    cfg = {"output_dir": str(root / "run"), "datasets": [{"name": "d", "path": str(root / "data")}],
           "sample": {"prompts": ["a red circle"], "steps": 1, "width": 32, "height": 32}}
    (root / "data").mkdir(exist_ok=True)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


# -- item 1: no user folder is ever replaced ----------------------------------------------------
def test_sample_out_refuses_a_folder_of_user_files(lora, tmp_path):
    runner = CliRunner()
    cfg = _sample_config(tmp_path)
    user = _user_folder(tmp_path / "mine")
    res = runner.invoke(app, ["sample", "-c", str(cfg), "--lora", str(lora["diffusers"]), "--out", str(user)])
    assert res.exit_code == 1, res.output
    assert "mine" in res.output and "did not write" in res.output
    _intact(user)
    # A new folder, then the same folder again (diffpipe's own output is replaced), then an empty one.
    (tmp_path / "empty").mkdir()
    for out in ("new", "new", "empty"):
        res = runner.invoke(app, ["sample", "-c", str(cfg), "--lora", str(lora["diffusers"]),
                                  "--out", str(tmp_path / out)])
        assert res.exit_code == 0, res.output
        assert (tmp_path / out / "grid.png").is_file() and (tmp_path / out / OUTPUT_MARKER).is_file()


def test_import_lora_refuses_a_folder_of_user_files(lora, tmp_path):
    runner = CliRunner()
    user = _user_folder(tmp_path / "mine")
    res = runner.invoke(app, ["import-lora", str(lora["adapter"]), str(user), "--family", "sd"])
    assert res.exit_code == 1, res.output
    assert "mine" in res.output and "did not write" in res.output
    _intact(user)
    for _ in range(2):  # our own output is replaced on the second run
        res = runner.invoke(app, ["import-lora", str(lora["diffusers"]), str(tmp_path / "imported"), "--family", "sd"])
        assert res.exit_code == 0, res.output
    # Files added by the user to a folder diffpipe wrote are theirs: refused again, nothing lost.
    (tmp_path / "imported" / "my-notes.txt").write_text("keep me")
    res = runner.invoke(app, ["import-lora", str(lora["adapter"]), str(tmp_path / "imported"), "--family", "sd"])
    assert res.exit_code == 1 and "my-notes.txt" in res.output, res.output
    assert (tmp_path / "imported" / "my-notes.txt").read_text() == "keep me"


def test_export_out_never_overwrites_a_user_file(lora, tmp_path):
    runner = CliRunner()
    user = _user_folder(tmp_path / "mine")  # holds a README.md, the name of the model card
    res = runner.invoke(app, ["export", str(lora["adapter"]), "--format", "diffusers", "--format", "peft",
                              "--out", str(user)])
    assert res.exit_code == 1, res.output
    assert "README.md" in res.output
    _intact(user)
    # A folder of other files: export writes beside them and touches none; again on a rerun.
    others = {k: v for k, v in USER_FILES.items() if k != "README.md"}
    user = _user_folder(tmp_path / "other", others)
    for _ in range(2):
        res = runner.invoke(app, ["export", str(lora["adapter"]), "--format", "peft", "--out", str(user)])
        assert res.exit_code == 0, res.output
    assert (user / "README.md").is_file() and (user / "peft" / "adapter_model.safetensors").is_file()
    _intact_beside(user, others, 2 + 3 + 1)  # README.md and README.hub.md; peft/ with its two files and its marker; verify.json
    # Snakemake creates the (empty) folders of a job's outputs before it runs: no clash.
    (tmp_path / "fresh" / "peft").mkdir(parents=True)
    res = runner.invoke(app, ["export", str(lora["adapter"]), "--format", "peft", "--out", str(tmp_path / "fresh")])
    assert res.exit_code == 0, res.output


def test_demo_data_never_overwrites_a_user_file(tmp_path):
    """``diffpipe demo-data OUT`` into a folder of the user's: a clashing name is refused, others stay."""
    from diffpipe.data.dataset.demo import write_demo_dataset

    user = _user_folder(tmp_path / "mine")
    (user / "shape_001.png").write_bytes(b"my own picture")
    with pytest.raises(NotOurFolderError, match="shape_001.png"):
        write_demo_dataset(user, n=4, size=32)
    assert (user / "shape_001.png").read_bytes() == b"my own picture" and not (user / "shape_000.png").exists()
    (user / "shape_001.png").unlink()
    for _ in range(2):  # beside the user's files, then over its own
        write_demo_dataset(user, n=4, size=32)
    _intact_beside(user, USER_FILES, 8)


def _intact_beside(folder: Path, files: dict[str, str], added: int) -> None:
    """The user's ``files`` unchanged, and only ``added`` files (and the folder's marker) beside them."""
    for name, text in files.items():
        assert (folder / name).read_text() == text
    assert len([p for p in folder.rglob("*") if p.is_file()]) == len(files) + added + 1


def test_atomic_path_replaces_only_its_own_folders(tmp_path):
    target = tmp_path / "out"
    for text in ("one", "two"):  # created, then our own folder replaced
        with atomic_path(target, is_dir=True) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "a.txt").write_text(text)
    assert (target / "sub" / "a.txt").read_text() == "two"
    (target / ".snakemake_timestamp").touch()  # Snakemake's own stamp is no user file
    with atomic_path(target, is_dir=True) as tmp:
        (tmp / "b.txt").write_text("three")
    assert sorted(p.name for p in target.iterdir()) == [OUTPUT_MARKER, "b.txt"]
    (target / "sub").mkdir()
    (target / "sub" / "mine.txt").write_text("user")  # the user adds a file: no longer replaceable
    with pytest.raises(NotOurFolderError, match="mine.txt"), atomic_path(target, is_dir=True) as tmp:
        (tmp / "c.txt").write_text("four")
    assert (target / "sub" / "mine.txt").read_text() == "user" and (target / "b.txt").read_text() == "three"
    assert issubclass(NotOurFolderError, ValueError)  # the CLI prints it and exits 1
    # A damaged marker proves nothing: refused.
    (target / "sub" / "mine.txt").unlink()
    (target / OUTPUT_MARKER).write_text("{not json")
    with pytest.raises(NotOurFolderError), atomic_path(target, is_dir=True):
        pass
    # A file where a folder goes, a folder where a file goes: refused, both intact.
    (tmp_path / "file").write_text("user file")
    with pytest.raises(NotOurFolderError, match="not a folder"), atomic_path(tmp_path / "file", is_dir=True):
        pass
    assert (tmp_path / "file").read_text() == "user file"
    with pytest.raises(NotOurFolderError, match="is a folder"):
        write_text_atomic(target, "x")
    assert (target / "b.txt").read_text() == "three"
    assert not list(tmp_path.glob(".tmp-*"))  # no temp left behind by a refusal


def test_refusal_comes_before_the_work(tmp_path):
    """The check runs on entry: minutes of sampling are not spent on an output that is then refused."""
    _user_folder(tmp_path / "mine")
    ran = []
    with pytest.raises(NotOurFolderError), atomic_path(tmp_path / "mine", is_dir=True):
        ran.append(1)
    assert not ran


# -- item 4: durability ---------------------------------------------------------------------
@pytest.fixture
def synced(monkeypatch):
    """The paths handed to ``os.fsync``, in call order (resolved from the descriptor)."""
    calls: list[Path] = []
    real = os.fsync

    def record(fd):
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def _synced_then_dir(calls: list[Path], target: Path) -> None:
    """``target``'s content was synced (at its temp name), then the folder it was renamed into."""
    files = [i for i, p in enumerate(calls) if p.name == target.name and p != target.parent]
    assert files, f"{target} was never synced: {calls}"
    assert target.parent in calls[files[0]:], f"the folder of {target} was not synced after it: {calls}"


def test_fsync_helpers(tmp_path, synced):
    (tmp_path / "t" / "sub").mkdir(parents=True)
    (tmp_path / "t" / "a").write_text("a")
    (tmp_path / "t" / "sub" / "b").write_text("b")
    fsync_file(tmp_path / "t" / "a")
    fsync_dir(tmp_path / "t")
    assert synced == [tmp_path / "t" / "a", tmp_path / "t"]
    synced.clear()
    fsync_tree(tmp_path / "t")
    assert set(synced) == {tmp_path / "t" / "a", tmp_path / "t" / "sub" / "b", tmp_path / "t" / "sub",
                           tmp_path / "t", tmp_path}
    assert synced.index(tmp_path / "t" / "sub" / "b") < synced.index(tmp_path / "t" / "sub")
    assert synced[-1] == tmp_path  # the parent last: the tree's own entry
    synced.clear()
    fsync_tree(tmp_path / "t" / "a")  # a file: itself, then its folder
    assert synced == [tmp_path / "t" / "a", tmp_path / "t"]


def test_atomic_writes_are_synced(tmp_path, synced):
    write_text_atomic(tmp_path / "new" / "deeper" / "f.json", "{}")
    _synced_then_dir(synced, tmp_path / "new" / "deeper" / "f.json")
    assert tmp_path in synced and tmp_path / "new" in synced  # the folders it created are recorded too
    synced.clear()
    with atomic_path(tmp_path / "d", is_dir=True) as tmp:
        (tmp / "x").write_text("x")
    assert any(p.name == "x" for p in synced) and any(p.name == OUTPUT_MARKER for p in synced)
    _synced_then_dir(synced, tmp_path / "d")


def test_trusted_outputs_are_synced(lora, tmp_path, synced):
    """Exported LoRAs, an adapter, a store shard and its index, a manifest and a shard spec."""
    import torch

    from diffpipe.config import parse_config
    from diffpipe.data.cache.latents import LatentEntry, write_latent_shard
    from diffpipe.data.cache.plan import make_plan
    from diffpipe.data.cache.store import Store
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.validate import run_validation
    from diffpipe.paths import RunPaths

    family = get_family(ModelConfig())
    res = export_lora(lora["adapter"], tmp_path / "export", family, ["diffusers", "peft", "kohya"])
    for path in res.files.values():
        _synced_then_dir(synced, path)
    _synced_then_dir(synced, tmp_path / "export" / "README.md")
    assert tmp_path / "export" / "peft" / "adapter_model.safetensors" in synced or any(
        p.name == "adapter_model.safetensors" for p in synced)

    synced.clear()
    store = Store(tmp_path / "store")
    shard = store.shard_path("latents", "n1")
    write_latent_shard(shard, [LatentEntry("i", "k", (1, 8, 8), torch.zeros(4, 1, 1, 1))])
    store.add_index("latents", "n1", [("k", "1x8x8", 0)])
    _synced_then_dir(synced, shard)
    _synced_then_dir(synced, store.index_path("latents", "n1"))
    assert any(p.name == "zarr.json" for p in synced)

    synced.clear()
    write_demo_dataset(tmp_path / "data", n=2, size=32)
    cfg = parse_config({"output_dir": str(tmp_path / "run"), "datasets": [{"name": "d", "path": str(tmp_path / "data"),
                                                                           "resolution": 32}]})
    paths = RunPaths(cfg.output_dir)
    run_validation(cfg.datasets, cfg.validation, manifest_path=paths.manifest, report_json=paths.report_json,
                   report_html=paths.report_html)
    make_plan(paths.manifest, cfg.datasets, cfg.cache, latent_identity=family.vae_identity(),
              text_identity=family.text_identity(), pixel_multiple=family.pixel_multiple, paths=paths)
    _synced_then_dir(synced, paths.manifest)
    _synced_then_dir(synced, paths.latent_spec(paths.shard_names()[0]))
