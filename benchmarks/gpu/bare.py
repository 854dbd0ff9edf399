"""Check c: the bf16 + checkpointing FLUX step in a bare diffusers + PEFT loop (no DeepSpeed, no diffpipe).

Same transformer (FLUX.1-dev's config, random bf16 weights built on the device), same LoRA (rank 16 on the
same module names), same shapes (batch 1, 1024 px: 64x64 packed latent tokens, 512 T5 tokens), diffusers'
own gradient checkpointing, a flow-matching loss, ``torch.optim.AdamW`` on the LoRA, gradient clipping, and
the same CUDA defaults as every diffpipe stage (``cuda_defaults``: TF32, SDPA off its cuDNN kernels, which
fail this step on torch 2.11 + H200), so the ratio compares loops, not attention kernels.
``diffpipe``'s step time over this loop's (check b's ``bf16+ckpt`` row) is the training overhead; goal <= 1.10.
"""

from __future__ import annotations

from typing import Any

from kit import Run, free_device_memory, is_oom, median, timed
from points import shape_for


def _lora_targets() -> list[str]:
    """The module names diffpipe puts its FLUX LoRA on (only the names: the loop below is plain PEFT)."""
    from diffpipe.config import ModelConfig
    from diffpipe.families import get_family

    return list(get_family(ModelConfig(family="flux")).lora_targets(None))


class BareFlux:
    def __init__(self, dry: bool):
        import diffusers
        import peft
        import torch
        from diffusers import FluxPipeline

        from diffpipe.models._common import cuda_defaults

        cuda_defaults()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        shape = shape_for("flux", dry)
        spec = shape.spec
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with self.device:
                self.model = getattr(diffusers, spec.cls)(**spec.config)
        finally:
            torch.set_default_dtype(default)
        self.model.requires_grad_(False)
        self.model.add_adapter(peft.LoraConfig(r=16, lora_alpha=16, target_modules=_lora_targets()))
        self.model.enable_gradient_checkpointing()
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        g = torch.Generator(self.device).manual_seed(0)
        h, w = shape.height // spec.vae_factor, shape.width // spec.vae_factor
        bf = dict(device=self.device, dtype=torch.bfloat16)
        self.x0 = torch.randn(1, spec.latent_channels, h, w, generator=g, **bf)
        self.pack = lambda x: FluxPipeline._pack_latents(x, 1, spec.latent_channels, h, w)
        self.img_ids = FluxPipeline._prepare_latent_image_ids(1, h // 2, w // 2, self.device, torch.bfloat16)
        (n_txt, dim), (pooled,) = spec.text["prompt_embeds"], spec.text["pooled_prompt_embeds"]
        self.ctx = torch.randn(1, n_txt, dim, generator=g, **bf)
        self.pooled = torch.randn(1, pooled, generator=g, **bf)
        self.txt_ids = torch.zeros(n_txt, 3, **bf)
        self.guidance = torch.full((1,), 1.0, **bf)
        self.gen = g

    def step(self) -> float:
        import torch

        with timed() as t:
            noise = torch.randn(self.x0.shape, generator=self.gen, device=self.device, dtype=self.x0.dtype)
            s = torch.sigmoid(torch.randn(1, generator=self.gen, device=self.device)).to(self.x0.dtype)
            xt = (1 - s) * self.x0 + s * noise
            pred = self.model(hidden_states=self.pack(xt), encoder_hidden_states=self.ctx,
                              pooled_projections=self.pooled, timestep=s, img_ids=self.img_ids,
                              txt_ids=self.txt_ids, guidance=self.guidance, return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), self.pack(noise - self.x0).float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.loss = float(loss)
        return t()


def check_c(run: Run, diffpipe_row: dict[str, Any] | None) -> None:
    """Time the bare loop; compare with ``diffpipe_row`` (check b's flux bf16+ckpt) when it has a time."""
    import torch

    loop = None
    # What earlier checks left allocated in this process (check b's engine, say) is not the loop's:
    # the peak is reported above it, as check b's points report theirs.
    base = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    try:
        with timed() as setup:
            loop = BareFlux(run.dry)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        warm = [loop.step() for _ in range(run.warmup)]
        times = [loop.step() for _ in range(run.steps)]
        s = median(times)
        fields: dict[str, Any] = {"s_per_step": s, "step_times": [round(x, 4) for x in times],
                                  "warmup_s": [round(x, 3) for x in warm], "setup_s": round(setup(), 1),
                                  "loss": loop.loss}
        if torch.cuda.is_available():
            fields.update(peak_bytes=torch.cuda.max_memory_allocated() - base, allocated_before_bytes=base)
        ours = (diffpipe_row or {}).get("s_per_step")
        if ours:
            fields.update(diffpipe_s_per_step=ours, diffpipe_over_bare=ours / s)
            if not run.dry:  # tiny CPU steps prove nothing about the goal
                fields.update(goal="<= 1.10", meets_goal=ours / s <= 1.10)
        else:
            fields["note"] = "no diffpipe bf16+ckpt time from check b to compare with"
        run.row("c", "flux bf16+ckpt bare diffusers+peft loop", "dry-run" if run.dry else "ok", **fields)
    except Exception as err:  # noqa: BLE001
        run.row("c", "flux bf16+ckpt bare diffusers+peft loop", "oom" if is_oom(err) else "error",
                error=f"{type(err).__name__}: {err}"[:2000])
    finally:
        loop = None
        free_device_memory()
