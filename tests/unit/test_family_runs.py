"""The behavioural family contract: every registered family and variant, built on its tiny flavor and run.

``tests/family_contract.py`` holds the checks: one prepare -> loss -> backward on CPU with the default
LoRA targets, each target matching a module and reached by the gradient, the pipeline layers composing
to the forward's output (and the pipeline loss to the family's), the token streams reading tokenizers
the family loads, the published models and the key map naming the family's denoiser class, the key map
covering every trained module. Each case is built once (a module fixture) and shared by its checks.

The last test plants eight mistakes, one at a time, in a copy of ``flux`` added the documented way (a
folder on the package path and its registry line) and expects the contract to name each one.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from family_contract import CHECKS, Case, ContractError, build, cases, check_published  # tests/family_contract.py

import diffpipe.families as families
from diffpipe.families import FAMILIES

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")  # Mochi's rope



@pytest.fixture(scope="module", params=cases(), ids=lambda c: c.id)
def built(request):
    return build(request.param)


def test_published_models_name_the_family_and_its_denoiser(built):
    check_published(built.case.family, type(built.denoiser), built.family.variants)


def test_each_lora_target_matches_a_module(built):
    CHECKS["lora_targets"](built)


def test_one_training_step(built):
    CHECKS["step"](built)


def test_pipeline_layers_compose_to_the_forward(built):
    CHECKS["layers"](built)


def test_token_streams_read_the_family_tokenizers(built):
    CHECKS["token_streams"](built)


def test_key_map_names_the_denoiser_and_covers_the_trained_modules(built):
    CHECKS["keymap"](built)


def test_token_routing_skips_blocks_in_training_only(built):
    CHECKS["token_routing"](built)


# -- planted mistakes ------------------------------------------------------------------------------
#: Each mistake: (file of the copied ``flux`` folder, text there, its replacement, what the contract says).
PLANTS = {
    "tiny config unfit for the latents": (
        "flavors.py", '"in_channels": 4,', '"in_channels": 16,', "one training step on the tiny flavor fails"),
    "LoRA target matching no module": (
        "family.py", "default_lora_targets: ClassVar[list[str]] = targets.dual_stream()",
        'default_lora_targets: ClassVar[list[str]] = [*targets.dual_stream(), "attn.to_qkv"]',
        r"LoRA target\(s\) \['attn.to_qkv'\] match no module"),
    "pipeline layers without the output layer": (
        "layers.py", "*(FluxBlock(b) for b in blocks), FluxOut(tr)]", "*(FluxBlock(b) for b in blocks)]",
        r"composition gives .* the forward's output is .*the output layer"),
    "wrong token stream": (
        "family.py", "    pipeline_class = FluxPipeline\n",  # streams copied from SD3, which has three tokenizers
        '    pipeline_class = FluxPipeline\n    token_streams = {"clip": ("tokenizer", "tokenizer"), '
        '"t5": ("tokenizer_3", "sequence")}\n',
        "token stream 't5' reads tokenizer 'tokenizer_3', which the family does not load"),
    "published model naming another family": (
        "flavors.py", '"flux1-schnell", "toy",', '"flux1-schnell", "flux",',
        "published model 'flux1-schnell' names family 'flux': write 'toy'"),
    "wrong DENOISER in the key map": (
        "keymap.py", "DENOISER = FluxTransformer2DModel", "DENOISER = __import__('diffusers').SD3Transformer2DModel",
        "keymap.DENOISER is .*SD3Transformer2DModel.*set DENOISER = FluxTransformer2DModel"),
    "KOHYA = None beside a key map": (
        "keymap.py", 'KOHYA = Kohya("flux1", "flux-1-dev/lora", "https://github.com/black-forest-labs/flux")',
        "KOHYA = None", "keymap.KOHYA is None: a key map needs a Kohya"),
    "wrong published class name": (
        "flavors.py", '"flux1-dev", "toy", "FluxTransformer2DModel"', '"flux1-dev", "toy", "FluxTransformer3DModel"',
        "published model 'flux1-dev' names class 'FluxTransformer3DModel'.*write 'FluxTransformer2DModel'"),
}


def _copy_of_flux(root: Path) -> Path:
    """``flux``'s folder copied as family ``toy``: its own modules import each other, its published models
    name ``toy``."""
    folder = root / "toy"
    shutil.copytree(Path(families.__file__).parent / "flux", folder, ignore=shutil.ignore_patterns("__pycache__"))
    for file in folder.glob("*.py"):
        text = file.read_text().replace("diffpipe.families.flux.", "diffpipe.families.toy.")
        if file.name == "flavors.py":
            text = re.sub(r'(Published\(\s*"[^"]+", )"flux"', r'\1"toy"', text)
        file.write_text(text)
    return folder


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The family ``toy``: a copy of ``flux`` on the package path and its registry line."""
    folder = _copy_of_flux(tmp_path)
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.setitem(FAMILIES, "toy", "toy")
    yield folder
    for mod in [m for m in sys.modules if m.startswith("diffpipe.families.toy")]:
        del sys.modules[mod]


def run_contract(name: str) -> None:
    """The whole contract on one family (its default variant): a :class:`ContractError` at the first break."""
    b = build(Case(name))
    check_published(name, type(b.denoiser), b.family.variants)
    for check in CHECKS.values():
        check(b)


def test_a_copy_of_a_family_keeps_the_contract(toy):
    run_contract("toy")


@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_mistake_breaks_the_contract_by_name(toy, plant):
    file, old, new, message = PLANTS[plant]
    path = toy / file
    text = path.read_text()
    assert text.count(old) == 1, f"{file} no longer holds {old!r}: update the plant"
    path.write_text(text.replace(old, new))
    with pytest.raises(ContractError, match=message):
        run_contract("toy")
