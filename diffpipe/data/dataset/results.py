"""What a validation run found: one :class:`Issue` per flagged file and the run's :class:`ValidationResult`.

Kept apart from ``validate`` (which produces them) and ``report`` (which renders them), so neither
imports the other for its types.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from diffpipe.config import ValidationConfig
from diffpipe.policy import Action


@dataclass(frozen=True)
class Issue:
    """One flagged file (or dataset): where, which reason, its action and a sentence for humans."""

    dataset: str
    path: str
    reason: str
    message: str
    action: Action
    sha256: str | None = None
    kind: str | None = None


@dataclass
class ValidationResult:
    """Counts of one validation run; ``errors > 0`` means the run must stop."""

    items: int = 0
    kept: int = 0
    skipped: int = 0
    errors: int = 0
    warnings: int = 0
    manifest_changed: bool = False
    hashed: int = 0  # media and aux files whose content was read this run
    reused: int = 0  # media files whose hash came from the previous manifest
    captions_read: int = 0  # caption files read this run
    sharded: int = 0  # media files probed by a validation shard's job (diffpipe validate-shard)
    issues: list[Issue] = field(default_factory=list)
    datasets: dict[str, dict[str, int]] = field(default_factory=dict)
    actions: dict[str, Action] = field(default_factory=dict)
    max_pixels: int = ValidationConfig().max_pixels  # the limit files were checked against

    @property
    def counts(self) -> dict[str, int]:
        return dict(sorted(Counter(i.reason for i in self.issues).items()))
