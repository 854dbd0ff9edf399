"""The module-name groups the families' default LoRA targets are built from (diffusers' module names).

PEFT matches ``target_modules`` as a set of name suffixes: the order of a list is for reading only.
"""

from __future__ import annotations


def _named(name: str, parts: tuple[str, ...]) -> list[str]:
    return [f"{name}.{p}" if name else p for p in parts]


def attention(name: str = "attn") -> list[str]:
    """An attention's query, key, value and output projections (``name`` empty: the bare names)."""
    return _named(name, ("to_q", "to_k", "to_v", "to_out.0"))


def added_projections(name: str = "attn") -> list[str]:
    """A joint attention's text-stream projections (``add_q/k/v_proj``, ``to_add_out``)."""
    return _named(name, ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"))


def feed_forward(name: str = "ff") -> list[str]:
    """diffusers' ``FeedForward``: its input projection (GELU/GEGLU) and its output linear."""
    return _named(name, ("net.0.proj", "net.2"))


def dual_stream(attn: str = "attn") -> list[str]:
    """An MM-DiT double-stream block: both streams' attention projections and feed-forwards."""
    return [*attention(attn), *added_projections(attn), *feed_forward("ff"), *feed_forward("ff_context")]
