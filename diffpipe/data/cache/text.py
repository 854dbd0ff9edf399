"""Text-embedding cache shards: one Arrow IPC file per shard.

Columns: ``id`` and ``key`` (strings), then one ``FixedSizeList`` column per
embedding name (``prompt_embeds``, ``pooled_prompt_embeds``, ...) holding the
flattened tensor: float32, or the raw uint16 bits of bfloat16. The schema
metadata key ``diffpipe`` holds JSON: format, version, dtype, the per-name
shapes (without the batch dimension), a sha256 checksum of the columns, and
any extra attrs. Readers memory-map the file, so opening is cheap.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from diffpipe.data.cache.latents import DTYPES, from_storage, storage_to_tensor, to_storage
from diffpipe.utils import atomic_path, stable_json

FORMAT = "diffpipe-text"
VERSION = 1
META_KEY = b"diffpipe"


def _checksum(ids: Sequence[str], keys: Sequence[str], arrays: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha256(stable_json([list(ids), list(keys)]).encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(stable_json([name, list(a.shape), a.dtype.str]).encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def write_text_shard(
    out_path: str | Path,
    ids: Sequence[str],
    keys: Sequence[str],
    embeddings: Mapping[str, torch.Tensor],
    *,
    dtype: str = "float32",
    attrs: dict[str, Any] | None = None,
) -> int:
    """Write embeddings ``{name: Tensor[N, ...]}`` for ``N`` items atomically; returns N."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported cache dtype {dtype!r}; use one of {DTYPES}")
    n = len(ids)
    if len(keys) != n:
        raise ValueError(f"text shard {out_path}: {n} ids but {len(keys)} keys")
    arrays: dict[str, np.ndarray] = {}
    for name, t in sorted(embeddings.items()):
        if t.shape[0] != n:
            raise ValueError(f"text shard {out_path}: {name} has {t.shape[0]} rows for {n} ids")
        arrays[name] = to_storage(t, dtype)
    meta = {
        **(attrs or {}),
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "shapes": {name: list(a.shape[1:]) for name, a in arrays.items()},
        "checksum": _checksum(ids, keys, arrays),
    }
    columns = [pa.array(list(ids), pa.string()), pa.array(list(keys), pa.string())]
    fields = [pa.field("id", pa.string()), pa.field("key", pa.string())]
    for name, a in arrays.items():
        width = int(np.prod(a.shape[1:], dtype=np.int64))
        flat = pa.array(a.reshape(-1))
        columns.append(pa.FixedSizeListArray.from_arrays(flat, width))
        fields.append(pa.field(name, pa.list_(flat.type, width)))
    schema = pa.schema(fields, metadata={META_KEY: json.dumps(meta, sort_keys=True)})
    table = pa.Table.from_arrays(columns, schema=schema)
    with atomic_path(out_path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            writer.write_table(table)
    return n


class TextShard:
    """Read side of a text shard (memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"text shard {self.path} is missing; run the cache step for it")
        try:
            source = pa.memory_map(str(self.path), "r")
            self.table = pa.ipc.open_file(source).read_all()
            self.meta: dict[str, Any] = json.loads(self.table.schema.metadata[META_KEY])
        except Exception as err:  # ArrowInvalid, KeyError, JSON errors: all mean damaged
            raise ValueError(f"text shard {self.path} cannot be read ({err}); delete it and rerun its cache job "
                             "(`diffpipe run` does)") from err
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"text shard {self.path} is not a diffpipe text shard")
        self.dtype: str = self.meta["dtype"]
        self.shapes: dict[str, tuple[int, ...]] = {
            k: tuple(v) for k, v in self.meta["shapes"].items()
        }

    def __len__(self) -> int:
        return self.table.num_rows

    @property
    def names(self) -> list[str]:
        return sorted(self.shapes)

    @property
    def ids(self) -> list[str]:
        return self.table.column("id").to_pylist()

    @property
    def keys(self) -> list[str]:
        return self.table.column("key").to_pylist()

    def read_raw(self, name: str) -> np.ndarray:
        """Column ``name`` in storage form ``[N, *shape]`` (a view of the mapped file)."""
        col = self.table.column(name).combine_chunks()
        flat = col.values.to_numpy(zero_copy_only=False)
        return flat.reshape(len(self), *self.shapes[name])

    def read(self, name: str) -> np.ndarray:
        """Column ``name`` as float32 ``[N, *shape]``."""
        return from_storage(self.read_raw(name), self.dtype)

    def load(self) -> dict[str, np.ndarray]:
        """Every embedding in storage form, checked against the shard checksum."""
        arrays = {name: self.read_raw(name) for name in self.names}
        if _checksum(self.ids, self.keys, arrays) != self.meta.get("checksum"):
            raise ValueError(
                f"text shard {self.path} is corrupt (checksum mismatch); delete it and rerun its cache job"
            )
        return arrays

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every embedding as a tensor in its compute dtype (bf16 stays bf16), checksum checked."""
        return {name: storage_to_tensor(a, self.dtype) for name, a in self.load().items()}

    def verify(self) -> bool:
        """Recompute the checksum; raises ValueError naming the shard on mismatch."""
        self.load()
        return True
