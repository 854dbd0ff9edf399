"""One input path: every family builds its training inputs in ``Family.prepare`` alone.

The loss, evaluation and pipeline-parallel training all derive from ``prepare`` in the base
class, so a family that overrode ``loss`` or ``pipeline_inputs`` would bring back a second copy
that can drift from the first (the pipeline-layer tests compare the two only where layers exist).
"""

import pytest

from diffpipe.config import ModelConfig
from diffpipe.families import family_names, get_family
from diffpipe.models.base import Family

#: Families that refuse pipeline parallelism in ``pipeline_inputs`` itself, with the reason.
REFUSES_PIPELINE_INPUTS = {"cosmos2-video": "cosmos2's single-frame layer tuple does not apply to its clips"}


@pytest.mark.parametrize("name", family_names())
def test_family_builds_its_inputs_only_in_prepare(name):
    cls = type(get_family(ModelConfig(family=name)))
    assert cls.prepare is not Family.prepare, f"{name}: no prepare"
    assert cls.loss is Family.loss, f"{name} overrides loss: put its inputs in prepare, its output mapping in predict"
    if name in REFUSES_PIPELINE_INPUTS:
        assert cls.pipeline_inputs is not Family.pipeline_inputs
    else:
        assert cls.pipeline_inputs is Family.pipeline_inputs, f"{name} overrides pipeline_inputs: use layer_inputs"
