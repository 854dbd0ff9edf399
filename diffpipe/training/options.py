"""What a run trains and how, in one line of its log: the options in effect besides the memory settings
(``Trainer.memory_options``), as the train job resolved them (``train.memory: auto`` applied)."""

from __future__ import annotations

from typing import Any

from diffpipe.config import Config


def training_options(cfg: Config, memory_plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every option that changes what is trained or how: the trained weights (mode, adapter, text encoders),
    the optimizer and where it steps, what is folded into the base (``model.base_loras``), token routing, EMA
    and how the memory settings were chosen (``memory_plan``: the ``train.memory: auto`` plan the config
    carries)."""
    tc = cfg.train
    lora = tc.lora
    routing = tc.token_routing
    return {
        "mode": "full" if tc.mode == "full" else f"{lora.kind} rank {lora.rank} alpha {lora.alpha:g}",
        "text_encoders": ", ".join(tc.text_encoder.encoders) or "frozen",
        "optimizer": tc.optimizer + (f" {dict(tc.optimizer_args)}" if tc.optimizer_args else ""),
        "optimizer_in_backward": tc.optimizer_in_backward,
        "grad_clip": tc.grad_clip,
        "base_loras": "; ".join(f"{b.path} at scale {b.scale:g}" for b in cfg.model.base_loras) or "none",
        "token_routing": f"keep {routing.keep:g} over blocks {routing.start_block}..{routing.end_block - 1}"
        if routing else "off",
        "ema": f"decay {tc.ema.decay:g}" if tc.ema.enabled else "off",
        "memory": _memory(tc.memory, memory_plan),
    }


def _memory(memory: str, plan: dict[str, Any] | None) -> str:
    if memory != "auto" or not plan:
        return memory
    kept = f"; kept as written: {', '.join(plan['explicit'])}" if plan.get("explicit") else ""
    return (f"auto, planned for a {plan['gpu_bytes'] / 2**30:.1f} GiB GPU (estimate "
            f"{plan['chosen']['estimate_bytes'] / 2**30:.2f} GiB{kept})")
