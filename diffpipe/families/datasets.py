"""Whether a family's model can take each dataset's items (reference images, a last frame), checked by the plan."""

from __future__ import annotations

from diffpipe.config import DatasetConfig
from diffpipe.models.base import Family


def check_datasets_fit(family: Family, datasets: list[DatasetConfig]) -> None:
    """Raise ``ValueError`` naming the dataset and key when ``family``'s model cannot take its items."""
    model = f"{family.name}{' ' + family.variant if getattr(family, 'variant', None) else ''}"
    for ds in datasets:
        if ds.references > family.max_references:
            raise ValueError(
                f"datasets[{ds.name}]: {ds.references} reference images per item, but this model ({model}) takes "
                f"at most {family.max_references}; several references are for Qwen-Image-Edit "
                "`variant: 2509 | 2511` and flux2 / flux2-klein `variant: edit`"
            )
        if ds.control_from_last_frame != family.uses_last_frame:
            raise ValueError(
                f"datasets[{ds.name}].control_from_last_frame: set it to true for first-and-last-frame models "
                f"(Wan variant 2.1-flf2v) and only for them; this model ({model}) "
                f"{'conditions on a first and a last frame' if family.uses_last_frame else 'has no last-frame input'}"
            )
