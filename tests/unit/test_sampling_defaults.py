"""``sample.steps`` / ``sample.guidance_scale``: null resolves to the model's family and variant defaults (each
family folder's spec), in one place (``diffpipe.families.sampling``) that samples, the report, the card and
the sample digests share; a value the config sets wins."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.families import FAMILIES, get_family, spec
from diffpipe.families.flux.flavors import PUBLISHED as FLUX_PUBLISHED
from diffpipe.families.sampling import resolve_sample, sample_defaults, sampling_note
from diffpipe.models.spec import PIPELINE_DEFAULTS


def _models(name: str) -> list[ModelConfig]:
    """The tiny model of ``name`` and of each of its variants that builds from the variant alone."""
    out = [ModelConfig(family=name)]
    for variant in get_family(out[0]).variants:
        try:
            get_family(ModelConfig(family=name, variant=variant))
        except ValueError:  # a variant that needs more settings (Wan 2.2 A14B: an expert)
            out.append(ModelConfig(family=name, variant=variant, expert="high"))
        else:
            out.append(ModelConfig(family=name, variant=variant))
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_and_variant_resolves_a_default(name):
    """Every family declares a default (``None``), and each of its variants resolves to an entry; values taken
    from the stock pipeline's ``__call__`` equal the installed diffusers' defaults (checked, not copied)."""
    assert None in spec(name).sampling, f"{name}: its spec's sampling table has no family default (None)"
    for model in _models(name):
        family = get_family(model)
        got = resolve_sample(family, SampleConfig())
        found = sample_defaults(family)
        assert (got.steps, got.guidance_scale) == (found.steps, found.guidance_scale)
        assert got.steps >= 1
        # No guidance scale only where the pipeline takes none (its guider component holds it).
        assert (got.guidance_scale is None) == (family.guidance_arg is None), (name, model.variant)
        assert got.guidance_scale is None or got.guidance_scale >= 0
        if found.source == PIPELINE_DEFAULTS:
            params = inspect.signature(family.pipeline_class.__call__).parameters
            assert params["num_inference_steps"].default == found.steps, (name, model.variant)
            if family.guidance_arg is not None:
                assert params[family.guidance_arg].default == found.guidance_scale, (name, model.variant)


def _local_flux(root, published: str) -> ModelConfig:
    """A local FLUX.1 folder holding only what sampling defaults read: its index and transformer config."""
    config = next(p for p in FLUX_PUBLISHED if p.name == published).config
    (root / "transformer").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (root / "transformer" / "config.json").write_text(json.dumps({"_class_name": "FluxTransformer2DModel", **config}))
    return ModelConfig(path=str(root))


def test_flux_schnell_resolves_to_its_distilled_values_and_dev_to_its_own(tmp_path):
    schnell = get_family(_local_flux(tmp_path / "schnell", "flux1-schnell"))
    dev = get_family(_local_flux(tmp_path / "dev", "flux1-dev"))
    assert schnell.sampling_key() == "schnell" and dev.sampling_key() is None
    got = resolve_sample(schnell, SampleConfig())
    assert (got.steps, got.guidance_scale) == (4, 0.0)
    got = resolve_sample(dev, SampleConfig())
    assert (got.steps, got.guidance_scale) == (28, 3.5)  # FluxPipeline's: embedded guidance, not CFG
    assert schnell.sample_kwargs(resolve_sample(schnell, SampleConfig()))["num_inference_steps"] == 4


def test_zimage_turbo_samples_without_guidance():
    got = resolve_sample(get_family(ModelConfig(family="zimage")), SampleConfig())
    assert (got.steps, got.guidance_scale) == (9, 0.0)


def test_an_explicit_value_wins(tmp_path):
    schnell = get_family(_local_flux(tmp_path / "schnell", "flux1-schnell"))
    got = resolve_sample(schnell, SampleConfig(steps=7))
    assert (got.steps, got.guidance_scale) == (7, 0.0)
    got = resolve_sample(schnell, SampleConfig(guidance_scale=1.5))
    assert (got.steps, got.guidance_scale) == (4, 1.5)
    got = resolve_sample(schnell, SampleConfig(steps=2, guidance_scale=0.5))
    assert (got.steps, got.guidance_scale) == (2, 0.5)
    note = sampling_note(schnell.cfg, SampleConfig(guidance_scale=1.5))
    assert note.startswith("4 steps (FLUX.1-schnell's default") and "guidance scale 1.5 (set in the config)" in note


def test_sample_kwargs_refuse_unresolved_settings():
    family = get_family(ModelConfig(family="sd"))
    with pytest.raises(ValueError, match="resolve them first"):
        family.sample_kwargs(SampleConfig())


def test_the_sample_digests_hold_the_section_as_written_and_build_no_family(tmp_path):
    """The sample and report rules' digests hold ``sample`` as written (a null stays null): stable run after run,
    and computing them (the workflow does, in every Snakemake job) imports neither torch nor diffusers, even for a
    local model whose family must be detected and whose defaults need its transformer config."""
    schnell = _local_flux(tmp_path / "schnell", "flux1-schnell")
    script = f"""
import sys
from diffpipe.config import Config, ModelConfig, SampleConfig
from diffpipe.stages import stage_digest
def cfg(**sample):
    return Config(output_dir={str(tmp_path / "run")!r}, datasets=[{{"name": "d", "path": {str(tmp_path / "data")!r}}}],
                  model=ModelConfig(path={schnell.path!r}), sample=SampleConfig(**sample))
for stage in ("sample", "report"):
    null = stage_digest(cfg(), stage)
    assert null == stage_digest(cfg(), stage), stage
    assert null != stage_digest(cfg(steps=4, guidance_scale=0), stage), stage
assert "torch" not in sys.modules and "diffusers" not in sys.modules, "the digests imported torch or diffusers"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_card_shows_the_base_models_sampling_defaults(tmp_path):
    """The model card's "Sampling" section: the defaults ``diffpipe sample`` resolves for this base, where they come
    from, and a warning when base LoRAs (a speed LoRA) may need others."""
    from diffpipe.export.card import write_card
    from diffpipe.export.metadata import ExportInfo

    schnell = get_family(_local_flux(tmp_path / "schnell", "flux1-schnell"))
    info = ExportInfo(family="flux", flavor="local", model_path="black-forest-labs/FLUX.1-schnell", weights="0" * 64,
                      rank=4, alpha=4.0, targets=["to_q"])
    card = write_card(tmp_path / "README.md", info, [], pipeline="FluxPipeline",
                      sampling=(sample_defaults(schnell), schnell.guidance_arg)).read_text()
    assert ("## Sampling\n\nThe base model's defaults: 4 steps, guidance scale 0 (`guidance_scale`), FLUX.1-schnell's "
            "(model card: black-forest-labs/FLUX.1-schnell, not checked here).") in card
    assert "speed LoRA" not in card
    info.config = {"model": {"base_loras": [{"path": "lightning.safetensors", "scale": 1.0}]}}
    card = write_card(tmp_path / "README.md", info, [], pipeline="FluxPipeline",
                      sampling=(sample_defaults(schnell), schnell.guidance_arg)).read_text()
    assert "a speed LoRA among them (Lightning, LightX2V) samples with the settings its publisher gives" in card


def test_the_in_training_sampler_renders_with_the_resolved_values(tmp_path):
    """``train.sample_every_*`` samples resolve like ``diffpipe sample`` (its pipeline is built on first use)."""
    from diffpipe.training.sample import TrainingSampler

    family = get_family(ModelConfig(family="zimage"))
    sampler = TrainingSampler(family, SampleConfig(steps=3), None, tmp_path)
    assert (sampler.cfg.steps, sampler.cfg.guidance_scale) == (3, 0.0)
