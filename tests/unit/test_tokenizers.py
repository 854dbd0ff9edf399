"""The offline tokenizers: deterministic, full coverage, stable across save/load."""

from __future__ import annotations

import string

import pytest

from diffpipe.models import tokenizers as toks

TEXTS = ["a red circle", "The Quick brown fox, 42!", "café 🙂 naïve — ½", "x" * 300, ""]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFPIPE_CACHE", str(tmp_path))


def test_clip_vocab_is_consistent():
    vocab, merges = toks.clip_vocab_and_merges()
    assert sorted(vocab.values()) == list(range(len(vocab)))
    assert (vocab[toks.BOS], vocab[toks.EOS]) == (len(vocab) - 2, len(vocab) - 1)
    for a, b in merges:  # every merge joins known symbols into a known symbol
        assert a in vocab and b in vocab and a + b in vocab
    assert (vocab, merges) == toks.clip_vocab_and_merges()


def test_clip_tokenizer_covers_any_text():
    tok = toks.clip_tokenizer()
    assert tok.model_max_length == 77
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (toks.BOS, toks.EOS, toks.EOS)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
        # unk is <|endoftext|> in CLIP: it must not appear inside the text.
        assert tok.eos_token_id not in ids[1:-1]
    words = tok.convert_ids_to_tokens(tok("the red circle").input_ids)
    assert words == [toks.BOS, "the</w>", "red</w>", "circle</w>", toks.EOS]


def test_clip_files_are_content_addressed(tmp_path):
    toks.clip_tokenizer()
    (folder,) = (tmp_path / "tokenizers").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["merges.txt", "vocab.json"]
    before = (folder / "vocab.json").stat().st_mtime_ns
    toks.clip_tokenizer()
    assert (folder / "vocab.json").stat().st_mtime_ns == before  # not rewritten


def test_t5_tokenizer_ids_and_coverage():
    tok = toks.t5_tokenizer(16)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.model_max_length == 16
    ascii_text = string.ascii_letters + string.digits + string.punctuation + " words and more"
    ids = tok(ascii_text).input_ids
    assert tok.unk_token_id not in ids and ids[-1] == tok.eos_token_id
    assert tok.convert_ids_to_tokens(tok("a red circle").input_ids) == [
        "▁a",
        "▁red",
        "▁circle",
        "</s>",
    ]
    assert (
        tok.decode(tok("Hello, world 42!").input_ids, skip_special_tokens=True)
        == "Hello, world 42!"
    )


@pytest.mark.parametrize("build", [toks.clip_tokenizer, toks.t5_tokenizer])
def test_same_tokens_and_fingerprint_after_save_and_load(build, tmp_path):
    tok = build()
    fingerprint = toks.tokenizer_fingerprint(tok)
    assert toks.tokenizer_fingerprint(build()) == fingerprint
    # A padded, truncated call leaves state on the backend: not part of the identity.
    tok(TEXTS, padding="max_length", max_length=20, truncation=True)
    assert toks.tokenizer_fingerprint(tok) == fingerprint
    tok.save_pretrained(tmp_path / "saved")
    loaded = type(tok).from_pretrained(tmp_path / "saved")
    assert toks.tokenizer_fingerprint(loaded) == fingerprint
    assert loaded(TEXTS).input_ids == build()(TEXTS).input_ids
    assert loaded.model_max_length == tok.model_max_length
