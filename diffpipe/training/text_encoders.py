"""Text encoders trained beside the denoiser (``train.text_encoder``): a LoRA on each, run at every step.

The trained encoders' captions are cached as token ids; :meth:`Family.text_from_ids` encodes them
inside the loss with the encoders this module holds. Denoiser and encoders go to DeepSpeed as one
module (:class:`WithTextEncoders`), so one optimizer (the encoders in their own parameter group, at
``train.text_encoder.lr``), gradient clipping, bf16 master weights, data-parallel reduction and
checkpoints (exact resume) cover both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import peft
import torch

from diffpipe.config import LoraConfig, TrainConfig
from diffpipe.training import adapter


class WithTextEncoders(torch.nn.Module):
    """The denoiser (its forward, its ``config``) with the trained text encoders beside it."""

    def __init__(self, denoiser: torch.nn.Module, encoders: dict[str, torch.nn.Module]):
        super().__init__()
        self.denoiser = denoiser  # first: its parameters lead (the compute dtype is read from them)
        self.text_encoders = torch.nn.ModuleDict(encoders)

    @property
    def config(self) -> Any:
        return self.denoiser.config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.denoiser(*args, **kwargs)


def text_lora_config(tc: TrainConfig) -> peft.LoraConfig:
    """The encoders' PEFT config: ``train.text_encoder``'s rank, alpha and targets, else ``train.lora``'s."""
    te, lora = tc.text_encoder, tc.lora
    ours = LoraConfig(rank=te.rank or lora.rank, alpha=te.alpha or lora.alpha, dropout=lora.dropout, init=lora.init)
    return adapter.peft_config(ours, list(te.targets))


class TrainedTextEncoders:
    """The encoders ``train.text_encoder.encoders`` names, loaded from the family, each with a LoRA."""

    def __init__(self, family: Any, tc: TrainConfig, *, continue_lora: bool = True):
        """``continue_lora``: load ``train.lora.init_from``'s encoder LoRAs (its ``text_encoder*/``
        folders, as training and import-lora write them) where it has them (not when resuming)."""
        bundle = family.load_text_encoders(only=tc.text_encoder.encoders)
        self.config = text_lora_config(tc)
        self.modules: dict[str, torch.nn.Module] = {}
        self.params: list[torch.nn.Parameter] = []
        for name in tc.text_encoder.encoders:
            module = getattr(bundle, name)
            try:
                self.params += adapter.add_lora(module, self.config)
            except ValueError as err:
                raise ValueError(f"train.text_encoder.targets {list(tc.text_encoder.targets)} matched no module "
                                 f"of {name}") from err
            init = Path(tc.lora.init_from or "") / name
            if tc.lora.init_from and continue_lora and (init / adapter.CONFIG_NAME).is_file():
                adapter.init_from(module, init, name)
            if tc.activation_checkpointing:
                module.gradient_checkpointing_enable()
            module.train()
            self.modules[name] = module
        self.lr = tc.text_encoder.lr or tc.lr

    def param_group(self) -> dict[str, Any]:
        return {"params": self.params, "lr": self.lr}

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Each encoder's LoRA tensors (keys relative to the encoder), float32 copies."""
        return {name: adapter.lora_state_dict(m) for name, m in self.modules.items()}

    def saved(self) -> dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]]:
        """What :func:`adapter.save_adapter` writes beside the denoiser's LoRA."""
        return {name: (sd, self.config) for name, sd in self.state().items()}


def load_text_adapters(directory: str | Path) -> dict[str, tuple[dict[str, torch.Tensor], peft.LoraConfig]]:
    """The text-encoder LoRAs saved in an adapter folder (its ``text_encoder*/`` subfolders), by encoder."""
    directory = Path(directory)
    return {sub.name: adapter.load_adapter(sub) for sub in sorted(directory.glob("text_encoder*"))
            if (sub / adapter.CONFIG_NAME).is_file()}
