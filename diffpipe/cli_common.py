"""What the ``diffpipe`` command modules share: the ``--config`` option and config loading, printing
text as it is, and library errors turned into clean messages and exit codes.

Exit codes (STYLE.md point 12): 2 for a config error, 1 for a failure in the data or the run;
never a traceback for an error a user can act on.
"""

from __future__ import annotations

import errno
import functools
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from diffpipe import runlock
from diffpipe.config import Config, ConfigError
from diffpipe.paths import RunPaths
from diffpipe.resolve import load_config

console = Console(stderr=True)

ConfigOpt = Annotated[Path, typer.Option("--config", "-c", help="Experiment config (YAML).")]

P = ParamSpec("P")
R = TypeVar("R")


def say(text: str) -> None:
    """Print library or user text as it is: no rich markup ("[/x]" in a path is text), no added line breaks."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def fail(label: str, message: str, code: int) -> NoReturn:
    """Print ``label: message`` (the message as text) and exit with ``code``."""
    console.print(Text.assemble((f"{label}:", "bold red"), " ", message), highlight=False, soft_wrap=True)
    raise typer.Exit(code)


# What to do about the OSErrors a user can fix (full disk, permissions).
_OS_ADVICE = {
    errno.ENOSPC: "free space on that file system (or move output_dir / cache.dir to another one), then run again",
    errno.EDQUOT: "free space or raise your quota on that file system, then run again",
    errno.EACCES: "check the permissions of that path, or choose a folder you can write",
    errno.EPERM: "check the permissions of that path, or choose a folder you can write",
    errno.EROFS: "the file system is read-only: choose a writable output_dir / cache.dir",
}


def _os_error_message(err: OSError) -> str:
    """``path: reason; what to do`` for an OSError (a library's own message when it wrote one)."""
    if err.errno is None or not err.strerror:
        return str(err)
    names = [str(f) for f in (err.filename, err.filename2) if f is not None]
    what = f"{' -> '.join(names)}: {err.strerror}" if names else f"{err.strerror} (the system did not name the file)"
    advice = _OS_ADVICE.get(err.errno)
    return what + (f"; {advice}" if advice else "")


def errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn library errors into clean messages and exit codes: 2 config, 1 data/run; never a traceback.

    User text in a message is printed as text (a "[/x]" in a path neither crashes
    the printer nor vanishes). An unexpected exception is named with where it was
    raised; DIFFPIPE_DEBUG=1 shows its traceback instead.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.exceptions.TyperException):
            raise  # typer's own exits and usage errors
        except ConfigError as err:
            fail("config error", str(err), 2)
        except ValueError as err:
            fail("error", str(err), 1)
        except OSError as err:  # a missing file, a full disk, a permission, a read-only file system
            fail("error", _os_error_message(err), 1)
        except runlock.FolderLocked as err:
            fail("error", str(err), 1)
        except Exception as err:
            if os.environ.get("DIFFPIPE_DEBUG"):
                raise
            frame = traceback.extract_tb(err.__traceback__)[-1]
            fail("error", f"unexpected {type(err).__name__}: {err} (at {frame.filename}:{frame.lineno}; "
                  "run again with DIFFPIPE_DEBUG=1 for the traceback, and please report it)", 1)

    return wrapper


def setup(config: Path) -> tuple[Config, RunPaths]:
    """The config (resolved) and the run's paths; each stage keeps only its part (diffpipe.stage_inputs)."""
    cfg = load_config(config)
    return cfg, RunPaths(cfg.output_dir)
