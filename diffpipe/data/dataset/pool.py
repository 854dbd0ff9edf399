"""The worker pool that probes new and changed media files, with a progress bar.

Chunks of files go to a process pool (one process per core by default); a
decoder that crashes its worker costs only its own file, which is probed
again alone and otherwise reported as ``corrupt_media``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rich.console import Console

from diffpipe.data.dataset.media import probe_many, sha256_media

#: Files per task: large enough to amortise inter-process overhead, small enough to balance.
CHUNK = 32


def probe_files(
    jobs: list[tuple[str, str]],
    max_pixels: int,
    workers: int | None,
    console: Console | None,
    on_started: Any = None,
) -> list[dict[str, Any]]:
    """Probe files in chunks over a process pool (inline when few), with a progress bar.

    ``on_started`` runs once the workers exist: threads started before a fork
    could leave a child holding a lock (an import lock) forever.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn  # noqa: I001

    workers = workers or os.cpu_count() or 1
    chunks = [jobs[i : i + CHUNK] for i in range(0, len(jobs), CHUNK)]
    out: list[list[dict[str, Any]]] = [[] for _ in chunks]
    progress = Progress(
        TextColumn("validate"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console,
        transient=True,
        disable=console is None or not console.is_terminal,
    )
    with progress:
        task = progress.add_task("probe", total=len(jobs))
        if workers <= 1 or len(chunks) <= 2:
            if on_started:
                on_started()
            for i, chunk in enumerate(chunks):
                out[i] = probe_many(chunk, max_pixels)
                progress.advance(task, len(chunk))
        else:
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            with ProcessPoolExecutor(max_workers=min(workers, len(chunks)), mp_context=ctx) as pool:
                futures = {pool.submit(probe_many, c, max_pixels): i for i, c in enumerate(chunks)}
                if on_started:  # a fork pool starts every worker on the first submit
                    on_started()
                failed = []
                for fut in as_completed(futures):
                    i = futures[fut]
                    try:
                        out[i] = fut.result()
                    except BrokenProcessPool:  # a decoder crashed its worker (and the pool)
                        failed.append(i)
                        continue
                    progress.advance(task, len(chunks[i]))
            for i in failed:
                out[i] = [_probe_isolated(path, kind, max_pixels, ctx) for path, kind in chunks[i]]
                progress.advance(task, len(chunks[i]))
    return [p for chunk in out for p in chunk]


def _probe_isolated(path: str, kind: str, max_pixels: int, ctx: Any) -> dict[str, Any]:
    """One file in its own process, so a decoder that crashes costs only that file."""
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        try:
            return pool.submit(probe_many, [(path, kind)], max_pixels).result()[0]
        except BrokenProcessPool:
            pass

    try:
        sha = sha256_media(path)
    except OSError:
        sha = None
    problem = ("corrupt_media", "the decoder crashed on this file")
    return {
        "sha256": sha,
        "kind": kind,
        "width": None,
        "height": None,
        "frames": None,
        "fps": None,
        "problems": [problem],
    }
