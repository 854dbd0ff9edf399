"""Pipeline parallelism (``train.pipeline_stages > 1``): the denoiser as a list of layers passing tuples
of tensors, and the first layer's inputs and the last stage's labels, built by the same
:meth:`~diffpipe.models.family.inputs.TrainingInputs.prepare` the loss uses."""

from __future__ import annotations

import sys
from typing import Any

import torch

from diffpipe.config import ObjectiveConfig
from diffpipe.models.family.records import Prepared
from diffpipe.models.spec import Absent


class PipelineParallel:
    """Layers and their inputs (a part of :class:`~diffpipe.models.base.Family`); a family's folder's
    ``layers.py`` holds its layers."""

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """The denoiser as layers passing tuples of tensors: embedding, one per block, output.

        Families with layers (their folder's ``layers.py``) override this; the others' spec says why not.
        """
        # The family's folder is imported with its class: its SPEC says why there are no layers.
        folder = sys.modules.get(type(self).__module__.rpartition(".")[0])
        layers = getattr(getattr(folder, "SPEC", None), "layers", None)
        why = f"is {layers.reason}" if isinstance(layers, Absent) else "has no layer list"
        raise ValueError(f"{self.name}: pipeline parallelism {why}; set train.pipeline_stages: 1")

    def pipeline_inputs(
        self,
        latents: torch.Tensor,
        text: dict[str, torch.Tensor],
        generator: torch.Generator,
        objective: ObjectiveConfig | None = None,
        dtype: torch.dtype = torch.float32,
        *,
        t: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        **aux: Any,
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, torch.Tensor]]:
        """``(first-layer inputs, (target, per-sample weights[, element mask]))`` from :meth:`prepare`, as
        ``loss`` builds them.

        The element mask is the family's own (an image-to-video variant's conditioning frames, weight 0),
        present when :meth:`prepare` sets one, so the last stage's loss leaves out what ``loss`` leaves out.
        Dataset loss masks are refused under pipeline stages.
        """
        p = self.prepare(latents, text, generator, objective=objective or ObjectiveConfig(), t=t, noise=noise,
                         dtype=dtype, **aux)
        weights = torch.ones(p.target.shape[0]) if p.weights is None else p.weights
        labels = (p.target, weights.to(p.target.device))
        return self.layer_inputs(p), labels if p.mask is None else (*labels, p.mask)

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """The first pipeline layer's tuple: ``prepared.inputs`` in order."""
        return tuple(prepared.inputs.values())

