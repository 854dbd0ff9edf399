"""Property tests: caption decoding and metadata parsing never raise and never lose text."""

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from diffpipe.data.dataset.captions import (
    caption_hash,
    decode_caption,
    from_metadata,
    normalize_tags,
)
from diffpipe.data.dataset.metadata import parse_records, pick_column, relative_path
from diffpipe.policy import REASONS, policy_markdown, resolve_actions

line = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zl", "Zp")), max_size=30)
SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(st.binary(max_size=200))
def test_decode_caption_never_raises_and_names_the_byte(data):
    c = decode_caption(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        assert (
            c.reason == "caption_not_utf8" and f"byte offset {err.start}" in c.note and not c.texts
        )
        return
    if c.reason:
        assert c.reason == "empty_caption" and not text.removeprefix("\ufeff").strip()
    else:
        assert c.texts and all(t == t.strip() and t and "\n" not in t for t in c.texts)


@SETTINGS
@given(st.lists(line, min_size=1, max_size=5))
def test_lines_are_alternatives_and_round_trip(lines):
    data = "\n".join(lines).encode()
    c = decode_caption(data)
    expected = [" ".join(x.split()) for x in lines if x.split()]
    assert list(c.texts) == expected or c.reason == "empty_caption" and not expected
    joined = decode_caption(data, lines="join")
    assert list(joined.texts) == ([" ".join(expected)] if expected else [])
    bom = decode_caption(b"\xef\xbb\xbf" + data)
    assert bom.texts == c.texts
    assert caption_hash(c.texts) == caption_hash(list(c.texts))


@SETTINGS
@given(
    st.lists(
        st.text(
            st.characters(blacklist_characters=",", blacklist_categories=("Cs", "Cc")), max_size=8
        ),
        max_size=8,
    )
)
def test_tags_normalised_idempotent_and_unique(tags):
    text = ",".join(tags)
    norm = normalize_tags(text)
    assert normalize_tags(norm) == norm
    parts = norm.split(", ") if norm else []
    assert len(parts) == len(set(parts)) and all(p.strip() == p and p for p in parts)
    assert set(parts) == {" ".join(t.split()) for t in tags if t.split()}


@SETTINGS
@given(
    st.one_of(st.none(), st.integers(), line, st.lists(st.one_of(line, st.integers()), max_size=4))
)
def test_metadata_cells_never_raise(value):
    c = from_metadata(value, where="metadata.jsonl row 1")
    assert bool(c.texts) != bool(c.reason)
    if c.reason:
        assert c.reason in REASONS and "row 1" in c.note


records = st.lists(
    st.fixed_dictionaries(
        {"file_name": st.from_regex(r"[a-z]{1,8}/?[a-z]{1,8}\.png", fullmatch=True), "text": line}
    ),
    max_size=6,
)


@SETTINGS
@given(records)
def test_metadata_formats_parse_the_same(recs):
    jsonl = "\n".join(json.dumps(r) for r in recs).encode()
    as_json = json.dumps(recs).encode()
    buf = io.StringIO()
    w = csv.DictWriter(buf, ["file_name", "text"])
    w.writeheader()
    w.writerows(recs)
    sink = io.BytesIO()
    pq.write_table(
        pa.Table.from_pylist(
            recs, schema=pa.schema([("file_name", pa.string()), ("text", pa.string())])
        ),
        sink,
    )
    assert parse_records(jsonl, "jsonl") == recs
    assert parse_records(as_json, "json") == recs
    assert parse_records(buf.getvalue().encode(), "csv") == recs
    assert parse_records(sink.getvalue(), "parquet") == recs


@SETTINGS
@given(st.binary(max_size=80), st.sampled_from(["csv", "json", "jsonl", "parquet"]))
def test_garbage_metadata_is_a_value_error(data, fmt):
    try:
        recs = parse_records(data, fmt)
    except ValueError:
        return
    assert all(isinstance(r, dict) for r in recs)


@SETTINGS
@given(
    st.lists(st.sampled_from(["a", "..", ".", "b", "c.png"]), min_size=1, max_size=5), st.booleans()
)
def test_relative_paths_never_leave_the_root(parts, absolute):
    root = Path("/data/set")
    value = ("/" if absolute else "") + "/".join(parts)
    rel = relative_path(root, value)
    if rel is not None:
        resolved = (root / rel).resolve()
        assert resolved.is_relative_to(root) and resolved != root


def test_column_detection_and_policy():
    assert pick_column(["File_Name", "Text"], None, ("file_name",)) == "File_Name"
    assert pick_column(["a", "b"], "b", ("x",)) == "b" and pick_column(["a"], "b", ("a",)) is None
    actions = resolve_actions({"orphan_caption": "error"})
    assert actions["orphan_caption"] == "error" and actions["corrupt_media"] == "skip"
    assert actions["path_outside_root"] == "error" and actions["duplicate_media"] == "warn"
    assert all(f"`{code}`" in policy_markdown() for code in REASONS)


def test_readme_documents_every_reason_and_default():
    """docs/validation.md's reason table is generated from policy.REASONS (`make docs`)."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "validation.md").read_text()
    start, end = "<!-- validation-reasons:start -->\n", "\n<!-- validation-reasons:end -->"
    assert readme[readme.index(start) + len(start) : readme.index(end)] == policy_markdown()
