"""Caption token counts from a model family's real tokenizers, for dataset validation
(:class:`diffpipe.data.dataset.checks.TokenCounter`)."""

from __future__ import annotations

import threading
from typing import Any

from diffpipe.config import ModelConfig
from diffpipe.families import get_family
from diffpipe.utils import digest


class FamilyTokenCounter:
    """A :class:`TokenCounter` from the model config; loads the tokenizers on first use only."""

    def __init__(self, model: ModelConfig):
        self.model = model
        self.key = digest(["tokens", model.model_dump(mode="json")])[:16]
        self._family: Any = None
        self._tok: Any = None
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None
        self._lock = threading.Lock()

    def prefetch(self) -> None:
        """Start loading the tokenizers in a thread (imports take seconds) while files are probed."""
        if self._thread is None and self._tok is None:
            self._thread = threading.Thread(target=self._load_kept, daemon=True)
            self._thread.start()

    def _load_kept(self) -> None:
        """The thread's load: a failure is kept for the caller's next :meth:`_load`, which raises it as its
        own (a thread's exception would print a traceback, and the caller would load again)."""
        try:
            self._load()
        except Exception as err:  # noqa: BLE001 - whatever it is, the caller raises it
            self._error = err

    def _load(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._tok is None:
                self._family = get_family(self.model)
                self._tok = self._family.load_tokenizers()

    def limits(self) -> dict[str, int]:
        self._load()
        return self._family.token_limits(self._tok)

    def count(self, texts: list[str]) -> dict[str, list[int]]:
        self._load()
        return self._family.count_tokens(self._tok, texts)
