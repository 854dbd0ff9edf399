"""Known-harmless library notices are dropped where they are logged; everything else still shows."""

import logging
import os

import pytest
from typer.testing import CliRunner

from diffpipe import logs
from diffpipe.cli import app


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def captured(monkeypatch):
    for var in ("DIFFPIPE_QUIET", "DIFFPIPE_VERBOSE", "TRANSFORMERS_VERBOSITY", "DIFFUSERS_VERBOSITY"):
        monkeypatch.setenv(var, "")  # recorded, so what a test sets is removed afterwards
        monkeypatch.delenv(var)
    keep = _Keep()
    names = list(logs.HARMLESS)
    for name in names:
        logging.getLogger(name).addHandler(keep)
    yield keep
    for name in names:
        logging.getLogger(name).removeHandler(keep)
        logging.getLogger(name).filters.clear()


def _emit():
    logging.getLogger("transformers.utils.import_utils").warning(
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to `CLIPImageProcessorPil` for "
        "backward compatibility.")
    logging.getLogger("transformers.utils.import_utils").warning("something else entirely")
    mu = logging.getLogger("diffusers.models.modeling_utils")
    mu.warning("There are modules in UNet2DConditionModel that should be kept in float32: []. Casting ...")
    mu.warning("There are modules in T5EncoderModel that should be kept in float32: ['wo']. Casting ...")
    lb = logging.getLogger("diffusers.loaders.lora_base")
    lb.warning("No LoRA keys associated to CLIPTextModel found with the prefix='text_encoder'. This is safe ...")
    lb.warning("No LoRA keys associated to UNet2DConditionModel found with the prefix='unet'. This is safe ...")


def test_harmless_notices_are_filtered_and_others_kept(captured):
    logs.configure()
    _emit()
    assert captured.lines == ["something else entirely", "There are modules in T5EncoderModel that should be "
                              "kept in float32: ['wo']. Casting ...",
                              "No LoRA keys associated to UNet2DConditionModel found with the prefix='unet'. "
                              "This is safe ..."]


def test_verbose_keeps_every_notice(captured):
    logs.configure(verbose=True)
    _emit()
    assert len(captured.lines) == 6


def test_quiet_and_verbose_are_global_options(captured):
    result = CliRunner().invoke(app, ["--quiet", "--verbose", "schema"])
    assert result.exit_code == 2 and "not both" in result.output
    result = CliRunner().invoke(app, ["--quiet", "schema"])
    assert result.exit_code == 0
    assert os.environ.get("DIFFPIPE_QUIET") == "1" and os.environ.get("TRANSFORMERS_VERBOSITY") == "error"


def test_quiet_run_hides_snakemake_progress(captured, monkeypatch, tmp_path):
    from diffpipe.runner import snakemake_command

    def cmd():
        return snakemake_command(tmp_path / "c.yaml", profile=None, cores=1, dry_run=False, targets=["plan"],
                                 extra=[], workdir=tmp_path)

    assert "--quiet" not in cmd()
    monkeypatch.setenv("DIFFPIPE_QUIET", "1")
    quiet = cmd()
    assert quiet[quiet.index("--quiet"):][:4] == ["--quiet", "progress", "rules", "host"] and quiet[-2:] == ["--", "plan"]
