import re

from typer.testing import CliRunner

from diffpipe.cli import app
from diffpipe.paths import REPO_ROOT

runner = CliRunner()


def _commands() -> list[str]:
    names = []
    for cmd in app.registered_commands:
        names.append(cmd.name or cmd.callback.__name__.replace("_", "-"))
    for group in app.registered_groups:
        for cmd in group.typer_instance.registered_commands:
            names.append(f"{group.name} {cmd.name}")
    return names


def test_every_command_has_help_and_an_example():
    for name in _commands():
        result = runner.invoke(app, [*name.split(), "--help"])
        assert result.exit_code == 0, name
        assert "Example:" in result.output, f"`diffpipe {name} --help` has no example"


def test_every_command_is_documented_in_readme():
    """Every command appears as `diffpipe CMD` in README.md or a docs/ page."""
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    text = "\n".join(p.read_text() for p in pages)
    missing = [n for n in _commands() if not re.search(rf"`diffpipe {n}\b", text)]
    assert not missing, f"neither README.md nor docs/*.md documents: {missing}"


def test_config_error_exits_2_and_names_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("datasets: [{name: d, path: x}]\ntrain: {batch_size: 0}\n")
    result = runner.invoke(app, ["validate", "--config", str(cfg)])
    assert result.exit_code == 2
    assert "train.batch_size" in result.output
