"""``diffpipe push``: the verified export and its model card round-trip through a stand-in Hub.

The Hub cannot be reached here: ``tests/hub_standin.py`` answers the requests huggingface_hub sends
(create repo, branch, preupload, commit). The token reaches the server and nowhere else: not the
command's output, not a file.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from hub_standin import HubStandIn
from tiny_adapters import sd_adapter
from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.export import export_lora

TOKEN = "hf_standin_secret_0123456789"  # a made-up token: it must show up at the server only


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder with a verified tiny-SD export, and its config file."""
    root = tmp_path_factory.mktemp("push")
    family, adapter = sd_adapter(root / "adapter", text_encoder=False)
    export_lora(adapter, root / "run" / "export", family, ["diffusers", "peft", "comfyui", "kohya", "merged"])
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(root / "run"), "model": {"family": "sd", "flavor": "tiny"},
                                      "datasets": [{"name": "d", "path": str(root / "data"), "resolution": 32}]}))
    return root, config


def _push(config, hub, *extra):
    env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None,
           "HF_HUB_DISABLE_TELEMETRY": "1"}
    return CliRunner().invoke(app, ["push", "-c", str(config), "--repo", "me/tiny-lora", *extra], env=env)


def _local_files(export) -> dict[str, bytes]:
    """What push uploads, by repository path: the verified files, and the Hub's card as README.md."""
    names = [n for n, entry in json.loads((export / "verify.json").read_text())["files"].items()
             if entry["format"] != "merged"]
    out = {"README.md": (export / "README.hub.md").read_bytes()}
    for name in names:
        path = export / name
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file():
                out[f.relative_to(export).as_posix()] = f.read_bytes()
    return out


def test_push_round_trips_and_a_second_push_is_a_no_op(run):
    root, config = run
    with HubStandIn() as hub:
        first = _push(config, hub, "--private")
        assert first.exit_code == 0, first.output
        repo = hub.state.repos["me/tiny-lora"]
        assert repo.private and len(repo.commits) == 1
        local = _local_files(root / "run" / "export")
        assert "peft/adapter_model.safetensors" in local and "comfyui_lora.safetensors" in local
        assert repo.branches["main"] == local  # byte for byte, nothing else
        again = _push(config, hub)
        assert again.exit_code == 0, again.output
        assert len(repo.commits) == 1  # unchanged files: no commit
        branch = _push(config, hub, "--revision", "v2")
        assert branch.exit_code == 0, branch.output
        assert repo.branches["v2"] == local
    # The token went to the server (so it was used) and nowhere else.
    assert set(hub.state.authorizations) == {f"Bearer {TOKEN}"}
    for result in (first, again, branch):
        assert TOKEN not in result.output
    leaked = [p for p in root.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_pushed_card_lists_only_what_is_uploaded(run):
    """#41: the merged folder stays local, so the card on the Hub neither lists it nor links local samples;
    every file its tables name is in the commit. The local card still lists the merged folder."""
    root, config = run
    assert "`merged`" in (root / "run" / "export" / "README.md").read_text()
    with HubStandIn() as hub:
        result = _push(config, hub)
        assert result.exit_code == 0, result.output
        uploaded = hub.state.repos["me/tiny-lora"].branches["main"]
    assert not any(name.startswith("merged/") for name in uploaded)
    card = uploaded["README.md"].decode()
    assert "merged" not in card and "![sample]" not in card, card
    named = {m.rstrip("/") for line in card.splitlines() if line.startswith("|")
             for m in re.findall(r"\| `([^`]+)` \|", line)}
    assert named and all(any(u == n or u.startswith(n + "/") for u in uploaded) for n in named), (named, sorted(uploaded))


def test_push_reads_the_report_export_writes():
    from diffpipe import push
    from diffpipe.export import card, verify

    assert push.VERIFY_NAME == verify.VERIFY_NAME  # restated in push to keep torch out of its import
    assert push.LOCAL_ONLY == card.LOCAL_ONLY


def test_push_refuses_an_export_that_failed_verification(run, tmp_path):
    root, config = run
    report = root / "run" / "export" / "verify.json"
    good = report.read_text()
    bad = json.loads(good)
    bad["ok"] = False
    bad["files"]["kohya_lora.safetensors"]["ok"] = False
    report.write_text(json.dumps(bad))
    try:
        with HubStandIn() as hub:
            result = _push(config, hub)
        assert result.exit_code == 1, result.output
        assert "failed verification" in result.output and "kohya_lora.safetensors" in result.output
        assert not hub.state.repos  # nothing created
    finally:
        report.write_text(good)
