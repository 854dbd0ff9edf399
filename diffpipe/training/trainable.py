"""What training updates: a LoRA adapter on the frozen denoiser (default), or the whole denoiser.

The loop sees ``params``, ``save(folder)`` and ``output_dir``; under ZeRO-3
both ``state`` and ``save`` gather the partitioned weights, so every rank
calls them and rank 0 writes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from diffpipe.config import Config
from diffpipe.paths import RunPaths
from diffpipe.training import adapter, checkpointing, engine
from diffpipe.training.pipeline import stage_lora_state
from diffpipe.training.text_encoders import TrainedTextEncoders, WithTextEncoders
from diffpipe.utils import atomic_path

FULL_DIR = "denoiser"  # under train/: the fine-tuned denoiser as a diffusers model folder


class Trainable:
    def __init__(self, denoiser: torch.nn.Module, family: Any, cfg: Config, *, is_main: bool,
                 continue_lora: bool = True):
        tc = cfg.train
        self.denoiser, self.cfg, self.is_main, self.zero_stage = denoiser, cfg, is_main, tc.zero_stage
        self.full = tc.mode == "full"
        self.lora_cfg = None
        self.stage_params: list[torch.nn.Parameter] | None = None  # set under pipeline parallel
        if len(family.denoiser_parts) > 1 and (self.full or tc.zero_stage == 3):
            # Each process runs only the experts its samples need; ZeRO-3 would gather every expert's
            # weights collectively, and a full fine-tune would have to save two models.
            setting = "train.mode: full" if self.full else "train.zero_stage: 3"
            raise ValueError(f"model.expert both trains a LoRA on each expert: {setting} is not supported; "
                             "use train.mode: lora with train.zero_stage 0-2, or train one expert per run")
        if self.full:
            denoiser.requires_grad_(True)
            self.params = [p for p in denoiser.parameters()]
        else:
            self.lora_cfg = adapter.peft_config(tc.lora, family.lora_targets(tc.lora.targets))
            self.params = adapter.add_lora(denoiser, self.lora_cfg)
            if tc.lora.init_from and continue_lora:
                adapter.init_from(denoiser, tc.lora.init_from, family.denoiser_name)
        if tc.activation_checkpointing:
            checkpointing.enable(denoiser, tc.checkpoint_fraction)
        denoiser.train()
        #: The text encoders trained beside it (train.text_encoder), or None.
        self.text = TrainedTextEncoders(family, tc, continue_lora=continue_lora) if tc.text_encoder.encoders else None

    def training_module(self) -> torch.nn.Module:
        """What DeepSpeed wraps: the denoiser, with the trained text encoders beside it if any."""
        return self.denoiser if self.text is None else WithTextEncoders(self.denoiser, self.text.modules)

    @property
    def all_params(self) -> list[torch.nn.Parameter]:
        """Every trained parameter: the denoiser's, then the text encoders'."""
        return self.params + (self.text.params if self.text else [])

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups: the denoiser's (``train.lr``), the text encoders' at their own rate."""
        return [{"params": self.params}] + ([self.text.param_group()] if self.text else [])

    @property
    def kind(self) -> str:
        return "full fine-tune" if self.full else "LoRA"

    def output_dir(self, paths: RunPaths) -> Path:
        return paths.train_dir / FULL_DIR if self.full else paths.adapter_dir

    def state(self) -> dict[str, torch.Tensor]:
        """The trained tensors as float32 CPU copies (collective under ZeRO-3)."""
        if self.stage_params is not None:  # each pipeline stage holds part of the LoRA
            return stage_lora_state(self.denoiser, self.stage_params, torch.distributed.get_world_size())[0]
        with engine.gathered(self.params, self.zero_stage):
            if self.full:
                return {k: v.detach().float().cpu().clone() for k, v in self.denoiser.state_dict().items()}
            return adapter.lora_state_dict(self.denoiser)

    def ranks_agree(self, world_size: int) -> bool:
        """Do all replicas hold bit-identical trained weights (collective)?"""
        if self.stage_params is not None:
            return stage_lora_state(self.denoiser, self.stage_params, world_size)[1]
        h = hashlib.sha256()
        for key, value in sorted(self.state().items()):
            h.update(key.encode())
            h.update(value.numpy().tobytes())
        return len(set(engine.all_gather_strings(h.hexdigest(), world_size))) == 1

    def save(self, folder: Path, **meta: Any) -> None:
        """Write the adapter (PEFT folder) or the denoiser (diffusers folder) on rank 0."""
        if self.full:
            with engine.gathered(self.params, self.zero_stage):
                if self.is_main:
                    with atomic_path(folder, is_dir=True) as tmp:
                        self.denoiser.save_pretrained(tmp)
            return
        state = self.state()
        text = self.text.saved() if self.text else None
        if self.is_main:
            lc = self.cfg.train.lora
            adapter.save_adapter(folder, state, self.lora_cfg, {
                "family": self.cfg.model.family, "flavor": self.cfg.model.flavor, "rank": lc.rank,
                "alpha": lc.alpha, **meta}, text_encoders=text)
