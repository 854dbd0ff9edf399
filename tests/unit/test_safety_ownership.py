"""Issue #38, cases 1 and 6: no output path of diffpipe's may hold a user's file.

Snakemake deletes a ``directory()`` output before the job that writes it, so a
user's ``plan/`` or ``samples/`` inside ``output_dir`` was lost before any of
diffpipe's own checks ran: ``check_run_folder`` refuses such a folder before
Snakemake starts. Ownership is proven by what a copied marker cannot fake: the
run folder's own inode, and each file's size and modification time as written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from diffpipe import paths, runlock
from diffpipe.ownership import check_run_folder
from diffpipe.paths import REPO_ROOT, RunPaths
from diffpipe.utils import OUTPUT_MARKER, NotOurFolderError, atomic_path, claim_files, write_text_atomic


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _user_run_like(folder: Path) -> dict[str, bytes]:
    """A user's folder whose sub-folders carry the names of two directory() outputs."""
    for rel, text in {"plan/my-plan.md": "plans", "samples/holiday.png": "pixels", "notes.txt": "n"}.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    return _files(folder)


# -- case 1: the run folder, checked before Snakemake starts ---------------------------------------
def test_a_users_folder_with_plan_and_samples_is_refused(tmp_path):
    user = tmp_path / "mine"
    before = _user_run_like(user)
    with pytest.raises(NotOurFolderError) as err:
        check_run_folder(user)
    text = str(err.value)
    assert str(user) in text and "plan/my-plan.md" in text and "samples/holiday.png" in text, text
    assert _files(user) == before and not (user / OUTPUT_MARKER).exists()


def test_a_new_or_empty_folder_is_claimed_and_stays_ours(tmp_path):
    for root in (tmp_path / "new" / "run", tmp_path / "empty"):
        if root.name == "empty":
            root.mkdir()
        check_run_folder(root)
        assert (root / OUTPUT_MARKER).is_file()
        (root / "logs").mkdir(exist_ok=True)  # the run writes; a second run is not refused
        check_run_folder(root)
    moved = tmp_path / "moved"
    (tmp_path / "empty").rename(moved)  # a move keeps the folder (its inode): still ours
    check_run_folder(moved)


def test_a_copied_run_marker_proves_nothing(tmp_path):
    ours = tmp_path / "ours"
    check_run_folder(ours)
    user = tmp_path / "mine"
    before = _user_run_like(user)
    shutil.copy2(ours / OUTPUT_MARKER, user / OUTPUT_MARKER)
    with pytest.raises(NotOurFolderError, match=re.escape(str(ours))):  # names the folder it was made for
        check_run_folder(user)
    assert _files(user) == before | {OUTPUT_MARKER: (ours / OUTPUT_MARKER).read_bytes()}
    # A whole run folder copied is a copy: refused too, the original stays usable.
    shutil.copytree(ours, tmp_path / "copy")
    with pytest.raises(NotOurFolderError, match="copied"):
        check_run_folder(tmp_path / "copy")
    check_run_folder(ours)


def test_a_run_folder_without_a_record_is_refused(tmp_path):
    """A run folder of a diffpipe from before this check has no record: refused, with what to do."""
    old = tmp_path / "old"
    (old / "validate").mkdir(parents=True)
    (old / "resolved-config.yaml").write_text("output_dir: old\n")
    with pytest.raises(NotOurFolderError, match="earlier diffpipe") as err:
        check_run_folder(old)
    assert "resolved-config.yaml" in str(err.value)
    (tmp_path / "file").write_text("a user's file")
    with pytest.raises(NotOurFolderError, match="not a folder"):
        check_run_folder(tmp_path / "file")
    assert (tmp_path / "file").read_text() == "a user's file"


def test_directory_outputs_in_our_run_folder_must_hold_only_our_files(tmp_path):
    run = RunPaths(tmp_path / "run")
    check_run_folder(run.root)
    for folder in (run.plan_dir, run.samples_dir, run.latent_shard("s0000")):
        with atomic_path(folder, is_dir=True) as tmp:
            (tmp / "ours.json").write_text("{}")
        (folder / ".snakemake_timestamp").touch()  # Snakemake's stamp after the job
    check_run_folder(run.root)
    (run.samples_dir / "keep-me.png").write_text("the user's")
    (run.latent_shard("s0000") / "mine.txt").write_text("the user's")
    with pytest.raises(NotOurFolderError) as err:
        check_run_folder(run.root)
    text = str(err.value)
    assert "keep-me.png" in text and "mine.txt" in text and str(run.samples_dir) in text, text
    assert (run.samples_dir / "keep-me.png").read_text() == "the user's"
    # While a run holds the folder (its plan half written), the lock answers a second run, not this check.
    with runlock.hold(run.root, runlock.RUN_LOCK, "diffpipe run"):
        check_run_folder(run.root)


def test_the_plan_folder_records_its_files(tmp_path):
    """plan/ is filled file by file (unchanged specs keep their time): the plan records what it wrote."""
    from diffpipe.config import parse_config
    from diffpipe.data.cache.plan import make_plan
    from diffpipe.data.dataset.demo import write_demo_dataset
    from diffpipe.data.dataset.validate import run_validation

    write_demo_dataset(tmp_path / "data", n=4, size=32)
    cfg = parse_config({"output_dir": str(tmp_path / "run"), "cache": {"shards": 2},
                        "datasets": [{"name": "d", "path": str(tmp_path / "data"), "resolution": 32}]})
    run = RunPaths(cfg.output_dir)
    check_run_folder(run.root)
    run_validation(cfg.datasets, cfg.validation, manifest_path=run.manifest, report_json=run.report_json,
                   report_html=run.report_html)
    for _ in range(2):  # written, then kept as it was
        make_plan(run.manifest, cfg.datasets, cfg.cache, latent_identity="vae", text_identity="te",
                  pixel_multiple=8, paths=run)
        (run.plan_dir / ".snakemake_timestamp").touch()
        check_run_folder(run.root)
    (run.plan_dir / "latents" / "notes.md").write_text("the user's")
    with pytest.raises(NotOurFolderError, match="latents/notes.md"):
        check_run_folder(run.root)


def test_every_directory_output_of_the_rules_is_checked():
    """paths.DIRECTORY_OUTPUTS (what check_run_folder looks at) is every directory() output of the workflow."""
    declared = set()
    for smk in sorted((REPO_ROOT / "workflow" / "rules").glob("*.smk")):
        for call in re.findall(r"directory\(([^)]+)", smk.read_text()):  # "directory()" in a comment: no call
            assert re.fullmatch(r"out\(paths\.\w+", call), f"{smk}: directory({call}): name a paths constant"
            declared.add(call.removeprefix("out(paths."))
    assert declared and {getattr(paths, name) for name in declared} == set(paths.DIRECTORY_OUTPUTS)


# -- case 6: ownership by file name alone -------------------------------------------------------------
def test_a_copied_marker_does_not_make_a_users_files_ours(tmp_path):
    ours = tmp_path / "ours"
    with atomic_path(ours, is_dir=True) as tmp:
        (tmp / "photo.jpg").write_text("ours")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("ours")
    user = tmp_path / "mine"
    (user / "sub").mkdir(parents=True)
    (user / "photo.jpg").write_text("mine")  # same name and size, another modification time
    os.utime(user / "photo.jpg", ns=(0, (ours / "photo.jpg").stat().st_mtime_ns + 1))
    (user / "sub" / "a.txt").write_text("my own text")
    shutil.copy2(ours / OUTPUT_MARKER, user / OUTPUT_MARKER)
    before = _files(user)
    with pytest.raises(NotOurFolderError, match="photo.jpg"), atomic_path(user, is_dir=True):
        pass
    with pytest.raises(NotOurFolderError, match="photo.jpg"):
        claim_files(user, ["photo.jpg"])
    assert _files(user) == before
    # A marker listing names only (as written before sizes and times were recorded) proves nothing either.
    (user / OUTPUT_MARKER).write_text(json.dumps({"written_by": "diffpipe", "entries": ["photo.jpg", "sub",
                                                                                         "sub/a.txt"]}))
    with pytest.raises(NotOurFolderError, match="photo.jpg"), atomic_path(user, is_dir=True):
        pass
    assert (user / "photo.jpg").read_text() == "mine"


def test_a_users_snakemake_timestamp_is_not_deleted(tmp_path):
    for text in ("", "my notes"):
        user = tmp_path / f"mine-{len(text)}"
        user.mkdir()
        (user / ".snakemake_timestamp").write_text(text)
        with pytest.raises(NotOurFolderError, match="snakemake_timestamp"), atomic_path(user, is_dir=True):
            pass
        assert (user / ".snakemake_timestamp").read_text() == text
    # In a folder of ours, a stamp with content is no Snakemake stamp: refused as well.
    with atomic_path(tmp_path / "ours", is_dir=True) as tmp:
        (tmp / "a").write_text("a")
    (tmp_path / "ours" / ".snakemake_timestamp").write_text("my notes")
    with pytest.raises(NotOurFolderError, match="snakemake_timestamp"), atomic_path(tmp_path / "ours", is_dir=True):
        pass


def test_demo_data_never_overwrites_a_caption_the_user_edited(tmp_path):
    from diffpipe.data.dataset.demo import write_demo_dataset

    out = tmp_path / "shapes"
    write_demo_dataset(out, n=3, size=32)
    write_demo_dataset(out, n=3, size=32)  # over its own files: fine
    caption = out / "shape_001.txt"
    caption.write_text("my own caption, much better\n")
    with pytest.raises(NotOurFolderError, match="shape_001.txt"):
        write_demo_dataset(out, n=3, size=32)
    assert caption.read_text() == "my own caption, much better\n"


def test_files_written_into_a_claimed_folder_are_recorded_with_their_stamp(tmp_path):
    folder = claim_files(tmp_path / "out", ["a.txt", "b.txt"])
    write_text_atomic(folder / "a.txt", "a")
    claim_files(folder, ["a.txt"])  # ours: claimed again
    # b.txt was claimed but never written by diffpipe: a file there now is the user's.
    (folder / "b.txt").write_text("the user's")
    with pytest.raises(NotOurFolderError, match="b.txt"):
        claim_files(folder, ["b.txt"])
    # The same bytes at another modification time (the user wrote them again) are not ours either.
    os.utime(folder / "a.txt", ns=(0, (folder / "a.txt").stat().st_mtime_ns + 1))
    with pytest.raises(NotOurFolderError, match="a.txt"):
        claim_files(folder, ["a.txt"])
