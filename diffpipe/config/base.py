"""Shared pieces of the config sections: the error type, strict value types and upper bounds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, StrictBool, StringConstraints


class ConfigError(ValueError):
    """A config problem a user can fix; the message names the key and value."""


# -- value types: strict, finite, bounded --------------------------------------------------------------
# Lax pydantic reads `epochs: true` as 1, `shards: 2.5` as an error but `2.0` as 2, and `weight: .inf`
# as a weight; each ends in a traceback or a silent surprise later. These types refuse them up front.

#: A whole number: no bool (`true` is not 1), no float (not even `2.0`), no text.
Int = Annotated[int, Strict()]
#: A finite number (a whole number is fine): no bool, no text, no `.inf` or `.nan`.
Float = Annotated[float, Strict(), Field(allow_inf_nan=False)]
#: `true` or `false`, not 1, 0 or "yes".
Bool = StrictBool
#: Text that must not be empty (names, columns, extensions).
Text = Annotated[str, StringConstraints(min_length=1)]
#: A file or folder: not empty, not only spaces, no NUL character.
PathText = Annotated[str, StringConstraints(pattern=r"^[^\x00]*[^\s\x00][^\x00]*$")]
#: A Hugging Face repo id: ``name`` or ``org/name`` (letters, digits, ``-``, ``_``, ``.``).
HubId = Annotated[str, StringConstraints(pattern=r"^(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*$", max_length=96)]
#: A random seed (torch and NumPy both take it).
Seed = Annotated[int, Strict(), Field(ge=0, le=2**32 - 1)]
LoadDtype = Literal["auto", "float32", "bfloat16", "float16"]
#: A fraction strictly between 0 and 1: bounds in the schema (Snakemake); the model's validator checks them
#: with a message naming the range.
Quantile = Annotated[Float, Field(json_schema_extra={"exclusiveMinimum": 0, "exclusiveMaximum": 1})]


def _once_each(value: list[Any]) -> list[Any]:
    repeated = next((v for i, v in enumerate(value) if v in value[:i]), None)
    if repeated is not None:
        raise ValueError(f"names {repeated!r} twice")
    return value


#: On a list of names (``Annotated[list[Text], OnceEach]``): each name at most once; a repeat is an error naming it.
OnceEach = AfterValidator(_once_each)
#: A width / height ratio.
AspectRatio = Annotated[Float, Field(ge=0.01, le=100)]

# Upper bounds: a larger value can only be a typo (`shards: 1e9`), and would cost hours or memory
# before failing, or never fail at all.
MAX_SIDE = 16_384  # pixels: image resolution, sample size
MAX_FRAMES = 10_000  # video frames
MAX_REPEATS = 10_000  # dataset repeats and weight
MAX_SHARDS = 10_000  # cache shards: one Snakemake job each
MAX_BATCH = 4_096  # batch size, gradient accumulation
MAX_WORKERS = 256  # processes per job
MAX_EPOCHS = 1_000_000
MAX_STEPS = 10**9


class Section(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
