"""``sample.steps`` and ``sample.guidance_scale`` resolved: the one place where a null takes the defaults of the
model's family and variant (its spec's ``sampling`` table, declared in the family's folder).

The resolved values are what samples render with (``diffpipe sample``, the in-training sampler) and what the
run report shows. The sample and report rules' digests hold the section as written (:func:`diffpipe.stages.stage_digest`),
so starting the workflow never builds a family.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.families import get_family, spec
from diffpipe.models.spec import SampleDefaults

if TYPE_CHECKING:
    from diffpipe.models.base import Family


def _entry(name: str, key: str | None) -> SampleDefaults:
    """Family ``name``'s entry for sampling key ``key`` (else its default), ``model`` filled in."""
    s = spec(name)
    found = s.sampling.get(key, s.sampling[None])
    return found if found.model else dataclasses.replace(found, model=s.model)


def sample_defaults(family: Family) -> SampleDefaults:
    """The sampling defaults of ``family``'s model: its sampling key's entry, else the family's (``None``);
    ``model`` filled in with the family's models when the entry names none."""
    return _entry(family.name, family.sampling_key())


def _apply(found: SampleDefaults, cfg: SampleConfig) -> SampleConfig:
    if cfg.steps is not None and cfg.guidance_scale is not None:
        return cfg
    return cfg.model_copy(update={
        "steps": found.steps if cfg.steps is None else cfg.steps,
        "guidance_scale": found.guidance_scale if cfg.guidance_scale is None else cfg.guidance_scale,
    })


def resolve_sample(family: Family, cfg: SampleConfig) -> SampleConfig:
    """``cfg`` with a null ``steps`` / ``guidance_scale`` set to :func:`sample_defaults`; values the config
    sets win. The guidance scale stays null for a pipeline that takes none (``family.guidance_arg``)."""
    return _apply(sample_defaults(family), cfg)



def sampling_note(model: ModelConfig, cfg: SampleConfig) -> str:
    """What samples render with and where each value comes from, for the run report: ``4 steps (FLUX.1-schnell's
    default: <source>), guidance scale 0 (...)``."""
    if cfg.steps is not None and cfg.guidance_scale is not None:
        return f"{cfg.steps} steps, guidance scale {cfg.guidance_scale:g} (both set in the config)"
    family = get_family(model)
    found = sample_defaults(family)
    origin = f"{found.model}'s default: {found.source}"
    steps = f"{cfg.steps} steps (set in the config)" if cfg.steps is not None else f"{found.steps} steps ({origin})"
    if cfg.guidance_scale is not None:
        scale = f"guidance scale {cfg.guidance_scale:g} (set in the config)"
    elif found.guidance_scale is None or family.guidance_arg is None:
        scale = "the guidance of the pipeline's guider component"
    else:
        scale = f"guidance scale {found.guidance_scale:g} ({origin})"
    return f"{steps}, {scale}"
