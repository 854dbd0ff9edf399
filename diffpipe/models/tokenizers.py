"""Tokenizers for the tiny flavors, written by our own code: offline and deterministic.

- ``clip_tokenizer()``: a CLIP byte-level BPE tokenizer. Every byte has a
  symbol (and a ``</w>`` word-final variant), so any text tokenizes without
  unknowns; a handful of merges make common English words single tokens.
- ``t5_tokenizer()``: a T5-style Unigram tokenizer (``<pad>`` 0, ``</s>`` 1,
  ``<unk>`` 2) over printable ASCII characters, with and without the ``▁``
  word-start marker, plus a few whole words.

Both come out identical on every call and in every process. The CLIP files
live in a cache folder named after their content hash, so a folder is never
reused for a different vocabulary.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import CLIPTokenizer, T5TokenizerFast

try:  # transformers >= 5
    from transformers.convert_slow_tokenizer import bytes_to_unicode
except ImportError:  # transformers 4.x
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

from diffpipe.utils import digest, write_if_changed

CLIP_MAX_LENGTH = 77
BOS, EOS = "<|startoftext|>", "<|endoftext|>"
T5_SPECIALS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2 as in T5

# Words that become single tokens: enough that captions are not pure
# characters, few enough that the vocabulary stays tiny.
_WORDS = ("the", "and", "of", "a", "with", "red", "blue", "green", "circle", "square", "on")


def cache_root() -> Path:
    """diffpipe's per-user cache: ``$DIFFPIPE_CACHE``, else ``$XDG_CACHE_HOME/diffpipe``."""
    if env := os.environ.get("DIFFPIPE_CACHE"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "diffpipe"


# -- CLIP (byte-level BPE) -------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    return bytes_to_unicode()


def _word_merges(word: str) -> list[tuple[str, str]]:
    """Left-to-right merges that build ``word</w>`` from its characters."""
    merges = []
    left = word[0]
    for i, ch in enumerate(word[1:], start=1):
        right = ch + "</w>" if i == len(word) - 1 else ch
        merges.append((left, right))
        left += right
    return merges


def clip_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The CLIP vocabulary (token -> id) and merge list, specials last as in CLIP."""
    alphabet = list(_bytes_to_unicode().values())
    tokens = alphabet + [c + "</w>" for c in alphabet]
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        if len(word) == 1:
            continue  # "a</w>" is already in the alphabet
        for pair in _word_merges(word):
            if pair not in merges:
                merges.append(pair)
    for left, right in merges:
        if left + right not in tokens:
            tokens.append(left + right)
    tokens += [BOS, EOS]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def _clip_folder() -> Path:
    """Write ``vocab.json`` + ``merges.txt`` once into a content-addressed folder."""
    vocab, merges = clip_vocab_and_merges()
    vocab_text = json.dumps(vocab, ensure_ascii=False, indent=0)
    merges_text = "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges)
    folder = cache_root() / "tokenizers" / f"clip-{digest([vocab_text, merges_text])[:16]}"
    # File by file, atomically: concurrent jobs may write the same folder, and
    # a reader must never see a half-written file (the content is identical).
    write_if_changed(folder / "vocab.json", vocab_text)
    write_if_changed(folder / "merges.txt", merges_text)
    return folder


def clip_tokenizer() -> CLIPTokenizer:
    """A fresh CLIP BPE tokenizer (``model_max_length`` 77, pad = ``<|endoftext|>``)."""
    return CLIPTokenizer.from_pretrained(str(_clip_folder()), model_max_length=CLIP_MAX_LENGTH)


# -- T5 (Unigram) ------------------------------------------------------------
def t5_pieces() -> list[tuple[str, float]]:
    """Unigram pieces with log-probabilities; specials first so their ids are 0, 1, 2."""
    pieces: list[tuple[str, float]] = [(tok, 0.0) for tok in T5_SPECIALS]
    pieces.append(("▁", -2.0))
    for ch in sorted(set(string.printable) - set(string.whitespace)):
        # A word-initial character is one piece; without this "▁x" entries
        # every word would cost an extra "▁" token.
        pieces += [("▁" + ch, -5.5), (ch, -5.0)]
    pieces += [("▁" + w, -3.0) for w in _WORDS if len(w) > 1]
    return pieces


def t5_tokenizer(max_length: int = 32) -> T5TokenizerFast:
    """A fresh T5-style fast tokenizer with ``model_max_length=max_length``.

    The backend mirrors what ``T5TokenizerFast.from_pretrained`` rebuilds from
    a saved ``tokenizer.json`` (no normalizer), so a pipeline saved to disk and
    loaded again tokenizes exactly like the in-memory one.
    """
    tok = Tokenizer(models.Unigram(t5_pieces(), unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=max_length,
    )


def tokenizer_fingerprint(tokenizer) -> str:
    """Content hash of a loaded tokenizer: its backend definition and length limit.

    Computed from the tokenizer object rather than its files, so the tiny
    flavor's in-memory tokenizer and the same tokenizer saved and reloaded
    hash alike. A vision-language processor (a tokenizer with an image processor, in a pipeline's
    ``tokenizer`` slot) hashes as its tokenizer plus its image processor's settings.
    """
    if hasattr(tokenizer, "image_processor") and hasattr(tokenizer, "tokenizer"):
        return digest({"class": type(tokenizer).__name__, "tokenizer": tokenizer_fingerprint(tokenizer.tokenizer),
                       "image_processor": [type(tokenizer.image_processor).__name__,
                                           tokenizer.image_processor.to_dict()]})
    if not hasattr(tokenizer, "backend_tokenizer"):  # a Python tokenizer (ByT5's bytes): its vocabulary
        return digest({"class": type(tokenizer).__name__, "vocab": tokenizer.get_vocab(),
                       "model_max_length": tokenizer.model_max_length})
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    # Padding and truncation are per-call state that transformers leaves on
    # the backend (and save_pretrained then writes): not part of the identity.
    backend.pop("padding", None)
    backend.pop("truncation", None)
    return digest(
        {
            "class": type(tokenizer).__name__,
            "backend": backend,
            "model_max_length": tokenizer.model_max_length,
        }
    )
