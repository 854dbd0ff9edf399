"""Every registered family is one folder with the same files, described by its spec.

A spec part is present (its file exists and holds what the machinery reads) or explicitly absent with
a reason, which the errors and the docs show. The last test adds a family the way the docs say (a
folder and one registry line) and checks that every place reading family facts finds it.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

import diffpipe.families as families
from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.families import FAMILIES, UNREGISTERED, Absent, family_names, spec
from diffpipe.models.base import Family
from diffpipe.models.spec import FamilySpec, Kohya

FOLDER = Path(families.__file__).parent


@pytest.mark.parametrize("name", family_names())
def test_each_family_folder_holds_its_spec_parts(name):
    s = spec(name)
    folder = FOLDER / FAMILIES[name]
    assert isinstance(s, FamilySpec) and s.name == name and folder.name == name.replace("-", "_")
    for required in ("__init__.py", "family.py", "flavors.py"):
        assert (folder / required).is_file(), f"{name}: {required} missing"
    assert all((s.model, s.tasks, s.targets, s.comfyui_readers, s.kohya_readers)), f"{name}: docs lines missing"

    cls = s.family_type()
    assert issubclass(cls, Family) and cls.name == name and cls.default_lora_targets

    flavors = importlib.import_module(f"{s.package}.flavors")
    assert flavors.PUBLISHED and tuple(flavors.PUBLISHED) == s.published
    assert {p.family for p in s.published} == {name}

    if isinstance(s.layers, Absent):
        assert s.layers.reason and not (folder / "layers.py").exists()
        with pytest.raises(ValueError, match=s.layers.reason):
            cls(ModelConfig(family=name)).pipeline_layers(None)
    else:
        module = s.layers or f"{s.package}.layers"
        assert (Path(importlib.import_module(module).__file__)).is_file()
        assert cls.pipeline_layers is not Family.pipeline_layers, f"{name}: layers declared, none built"

    if isinstance(s.keymap, Absent):
        assert s.keymap.reason and not (folder / "keymap.py").exists()
        with pytest.raises(ValueError, match="kohya format: no sd-scripts base model version"):
            s.kohya_for(s.published[0].config)
    else:
        keymap = s.keymap_module()
        assert keymap.DENOISER.__name__ == s.published[0].cls and callable(keymap.build)
        k = s.kohya_for(s.published[0].config)
        assert isinstance(k, Kohya) and all((k.base_model_version, k.architecture, k.implementation))


def test_every_folder_is_registered_or_says_why():
    folders = {p.name for p in FOLDER.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(FAMILIES.values()) | set(UNREGISTERED)
    assert all(UNREGISTERED.values())


def test_an_unknown_family_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown family .nope.; known: auraflow, chroma, "):
        spec("nope")


_TOY = {
    "__init__.py": '''
        from diffpipe.models.spec import Absent, FamilySpec, SampleDefaults

        SPEC = FamilySpec(
            model="Toy 1", tasks="text-to-image", targets="as `sd`",
            comfyui_readers="ComfyUI", kohya_readers="ComfyUI",
            layers=Absent("toys do not pipeline"),
            sampling={None: SampleDefaults(3, 1.5, source="made up")},
        )
    ''',
    "family.py": '''
        from diffpipe.families.sd.family import SDFamily
        from diffpipe.models.base import Family


        class ToyFamily(SDFamily):
            pipeline_layers = Family.pipeline_layers
    ''',
    "flavors.py": '''
        from diffpipe.families.sd.flavors import SD_UNET
        from diffpipe.models.spec import Published

        PUBLISHED = [Published("toy-1", "toy", "UNet2DConditionModel", SD_UNET, 859.52e6, 5, "made up")]
    ''',
    "keymap.py": '''
        from diffpipe.families.sd.keymap import DENOISER, build  # noqa: F401
        from diffpipe.models.spec import Kohya

        KOHYA = Kohya("toy_v1", "toy-1/lora", "https://example.org/toy")
    ''',
}


@pytest.fixture
def toy_folder(tmp_path, monkeypatch):
    """The family ``toy``: a folder on the package path holding ``_TOY``'s files, and its registry line."""
    folder = tmp_path / "toy"
    folder.mkdir()
    for file, text in _TOY.items():
        (folder / file).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(tmp_path)])
    monkeypatch.setitem(FAMILIES, "toy", "toy")
    yield folder
    for mod in [m for m in sys.modules if m.startswith("diffpipe.families.toy")]:
        del sys.modules[mod]


def test_a_family_folder_defines_exactly_one_family_class(toy_folder):
    with (toy_folder / "family.py").open("a") as f:
        f.write("\n\nclass OtherFamily(ToyFamily):\n    pass\n")
    with pytest.raises(TypeError, match=r"must define exactly one Family subclass, not \['ToyFamily', 'OtherFamily'\]"):
        spec("toy").family_type()


def test_adding_a_family_is_one_folder_and_one_registry_line(toy_folder):
    """The family ``toy`` exists only as a folder on the package path plus its registry line; every
    reader of family facts (lookup, docs tables, key maps, kohya metadata, model card, estimate) finds it.
    Its spec and class leave out what the registry derives: the name, the published models, the class."""
    from diffpipe.export.card import how_to_load
    from diffpipe.export.keymaps import keymap_for, mapped_families
    from diffpipe.export.kohya import base_model_version
    from diffpipe.families import family_names as names
    from diffpipe.families import get_family
    from diffpipe.families.published import for_family
    from diffpipe.families.sampling import resolve_sample
    from diffpipe.families.tables import families_markdown, formats_markdown, pipeline_markdown, sampling_markdown

    family = get_family(ModelConfig(family="toy"))
    assert type(family).__name__ == "ToyFamily" and family.name == "toy" and "toy" in names()
    assert "toy" in mapped_families() and keymap_for(family).family == "sd"
    assert base_model_version("toy", {}) == ("toy_v1", "toy-1/lora", "https://example.org/toy")
    assert "A1111/Forge do not run this model" in how_to_load("kohya", "toy")
    assert [p.name for p in for_family("toy")] == ["toy-1"]
    assert "| `toy` | Toy 1 |" in families_markdown() and "| `toy` | ComfyUI |" in formats_markdown()
    assert "| `toy` | refused: toys do not pipeline |" in pipeline_markdown()
    assert "| `toy` | Toy 1 | 3 | 1.5 | `guidance_scale` | made up |" in sampling_markdown()
    sample = resolve_sample(family, SampleConfig())
    assert (sample.steps, sample.guidance_scale) == (3, 1.5)
    with pytest.raises(ValueError, match="toys do not pipeline"):
        family.pipeline_layers(None)


def test_every_lora_loader_of_diffusers_is_a_family_or_said_not_to_be():
    """The pinned diffusers' LoRA loader mixins: each is used by a registered family's pipeline, or the
    not-implemented table names it with a reason (and then no family uses it)."""
    import diffusers.loaders.lora_pipeline as lora_pipeline

    from diffpipe.families import NOT_IMPLEMENTED

    mixins = {n: getattr(lora_pipeline, n) for n in dir(lora_pipeline)
          if n.endswith("LoraLoaderMixin") and n != "LoraLoaderMixin"}
    used = {n for n, m in mixins.items() for name in family_names()
        if issubclass(spec(name).family_type()(ModelConfig(family=name)).pipeline_class, m)}
    listed = {mixin for mixin, _ in NOT_IMPLEMENTED.values() if mixin}
    assert listed <= set(mixins), f"not in the pinned diffusers: {sorted(listed - set(mixins))}"
    assert not used & listed, f"families exist for {sorted(used & listed)}: take them off NOT_IMPLEMENTED"
    assert set(mixins) == used | listed, f"neither a family nor listed: {sorted(set(mixins) - used - listed)}"


@pytest.mark.parametrize("name", family_names())
def test_a_pipeline_without_a_lora_loader_gets_a_writer_a_loader_and_a_card_line(name):
    """Where the stock pipeline has neither ``save_lora_weights`` nor ``load_lora_weights`` (diffusers 0.42.1's
    HunyuanImage and HunyuanVideo 1.5 pipelines), the family writes and loads through the transformer and its
    card says so; every other pipeline writes and loads the file itself."""
    from diffpipe.export.card import how_to_load
    from diffpipe.families import get_family
    from diffpipe.models.base import TransformerLoRA

    family = get_family(ModelConfig(family=name))
    own = hasattr(family.pipeline_class, "load_lora_weights")
    assert own == hasattr(family.pipeline_class, "save_lora_weights")
    assert own != isinstance(family, TransformerLoRA), name
    line = how_to_load("diffusers", name)
    assert ('pipe.transformer.load_lora_adapter("{path}", prefix="transformer")' in line) != own, line


def test_models_and_tokenizer_streams_become_the_attributes_the_base_class_reads():
    """``models = Models(...)`` declares the three models (tiny configs by the flavors' shared names) and the
    pipeline; each tokenizer's ``stream`` becomes ``token_streams``, in the text parts' order."""
    from diffusers import AutoencoderDC, DPMSolverMultistepScheduler, SanaPipeline, SanaTransformer2DModel

    from diffpipe.families.sana import flavors
    from diffpipe.families.sana.family import SanaFamily
    from diffpipe.families.sd3.family import SD3Family

    assert (SanaFamily.vae_model.cls, SanaFamily.denoiser_model.cls, SanaFamily.scheduler_model.cls) == (
        AutoencoderDC, SanaTransformer2DModel, DPMSolverMultistepScheduler)
    assert SanaFamily.vae_model.tiny is flavors.TINY_VAE and SanaFamily.denoiser_model.tiny is flavors.TINY_TRANSFORMER
    assert SanaFamily.scheduler_model.tiny is flavors.TINY_SCHEDULER and SanaFamily.pipeline_class is SanaPipeline
    assert SanaFamily.vae_class is AutoencoderDC and SanaFamily.name == "sana"
    assert SanaFamily.token_streams == {"gemma": ("tokenizer", "sequence")}
    assert list(SD3Family.token_streams.items()) == [
        ("clip_l", ("tokenizer", "tokenizer")), ("clip_g", ("tokenizer_2", "tokenizer")), ("t5", ("tokenizer_3", "sequence"))]
