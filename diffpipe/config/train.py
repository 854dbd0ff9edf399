"""``train``: the training run (schedule, precision, memory, parallelism, checkpoints, logging) and the
combinations of its options that cannot work together."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from diffpipe.config.adapter import EmaConfig, LoraConfig, TextEncoderTrainConfig
from diffpipe.config.base import MAX_BATCH, MAX_EPOCHS, MAX_STEPS, Bool, Float, Int, OnceEach, Section, Seed, Text
from diffpipe.config.monitor import EvalConfig, ProfileConfig
from diffpipe.config.objective import ObjectiveConfig

#: Optimizers that step bf16 weights themselves (diffpipe.training.optim.AdamWBF16).
BF16_OPTIMIZERS = ("adamw_kahan", "adamw_stochastic")
#: torchao's AdamW with block-quantised moments (8-bit: 256 values per float32 scale; 4-bit: 128).
QUANTISED_OPTIMIZERS = ("adamw8bit", "adamw4bit")


class TokenRoutingConfig(Section):
    keep: Float = Field(
        0.5, description="Share of the image/video tokens the routed blocks compute on (the rest skip them); 1: "
        "no routing.", gt=0, le=1,
    )
    start_block: Int = Field(
        2, description="First routed block (0-based, over the denoiser's block stack in forward order; FLUX.1: "
        "its double-stream blocks, then its single-stream ones).", ge=0, le=100_000,
    )
    end_block: Int = Field(
        ..., description="The block after the last routed one: blocks start_block <= i < end_block are routed, "
        "and the skipped tokens rejoin before block end_block.", ge=1, le=100_000,
    )

    @model_validator(mode="after")
    def _check_range(self) -> TokenRoutingConfig:
        if self.end_block <= self.start_block:
            raise ValueError(f"train.token_routing: end_block {self.end_block} must be above start_block "
                             f"{self.start_block} (blocks start_block <= i < end_block are routed)")
        return self


class TrainConfig(Section):
    epochs: Int = Field(10, description="Passes over the training data.", ge=1, le=MAX_EPOCHS)
    max_steps: Int | None = Field(
        None, description="Stop after this many optimizer steps (overrides epochs).", ge=1, le=MAX_STEPS
    )
    batch_size: Int = Field(4, description="Micro-batch size per process.", ge=1, le=MAX_BATCH)
    grad_accum: Int = Field(1, description="Gradient accumulation steps.", ge=1, le=MAX_BATCH)
    lr: Float = Field(1e-3, description="Peak learning rate.", gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: Int = Field(0, description="Linear warmup steps.", ge=0, le=MAX_STEPS)
    weight_decay: Float = Field(0.0, description="Weight decay (decoupled for the AdamW variants).", ge=0)
    optimizer: Text = Field(
        "adamw",
        description="`adamw`, `adamw_kahan` / `adamw_stochastic` (precision bf16, zero_stage 1-3: the trained "
        "weights are kept in bf16 with no fp32 master copy, saving 4 bytes per trained parameter; Kahan "
        "summation or stochastic rounding keeps small updates), `adamw8bit` / `adamw4bit` (torchao: both AdamW "
        "moments block-quantised to 8 or 4 bits, about 2 or 1 bytes per trained parameter instead of 8; tensors "
        "under 4096 values, or not a multiple of the block, keep full-width moments; zero_stage 0), `adafactor`, "
        "or any `torch.optim` class name (e.g. `SGD`, `RAdam`).",
    )
    optimizer_args: dict[Text, Any] = Field(
        {}, description="Extra keyword arguments for the optimizer (e.g. `{betas: [0.9, 0.99]}`)."
    )
    grad_clip: Float = Field(1.0, description="Gradient norm clip (0 disables).", ge=0)
    optimizer_in_backward: Bool = Field(
        False,
        description="mode full on one process: step each parameter in the backward pass as soon as its gradient "
        "is complete, then free that gradient, so at most one parameter's gradient (the largest) is held "
        "instead of all of them. Needs grad_accum 1 and grad_clip 0 (both need every gradient at once), "
        "zero_stage 0, pipeline_stages 1, no offload_optimizer. Under precision bf16 the weights stay in bf16 "
        "with no float32 master copy: use adamw8bit / adamw4bit (bf16 stochastic rounding), adamw_kahan or "
        "adamw_stochastic.",
    )
    caption_dropout: Float = Field(
        0.0,
        description="Probability of training an item on the empty caption (the cached empty-caption "
        "embedding), which keeps classifier-free guidance working.",
        ge=0,
        lt=1,
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="Training precision: `auto` (bf16 on CUDA, fp32 on CPU), fp32, bf16 (CPU and GPU; DeepSpeed keeps "
        "float32 master copies of the trained weights), fp16 (GPU only, dynamic loss scaling).",
    )
    base_weights: Literal["auto", "fp8", "int8", "nf4"] = Field(
        "auto",
        description="Storage of the frozen denoiser weights during LoRA training: `auto` = the training precision; "
        "`fp8` = scaled float8_e4m3fn: an 8-bit code per weight and a bf16 scale per output channel, dequantised "
        "in each matmul (norms, embeddings, convolutions and the LoRA stay in 16/32 bits); half the weight memory "
        "of bf16. `int8` = torchao's int8 weight-only quantisation of the same Linear layers (a float32 scale per "
        "output channel), on CPU and GPU. `nf4` = QLoRA's 4-bit NormalFloat of the same layers (torchao's "
        "NF4Tensor: an absmax scale per 64 weights, those scales in int8), about a quarter of bf16's weight "
        "memory, on CPU and GPU. None of them with zero_stage 3; int8 and nf4 not with block_swap.",
    )
    attention_backend: Text = Field(
        "native",
        description="diffusers attention backend for the denoiser: `native` (torch SDPA), `flash`, `sage`, "
        "`xformers`, `_native_cudnn`, ... (a name from diffusers' AttentionBackendName). All but `native`, "
        "`_native_math` and `flex` need CUDA and, for some, their package.",
    )
    compile: Bool = Field(
        False,
        description="Regional compilation: torch.compile each repeated block of the denoiser (diffusers' "
        "`compile_repeated_blocks`) rather than the whole model; the first steps are slower.",
    )
    activation_checkpointing: Bool = Field(
        False, description="Recompute block activations in the backward pass: less memory, about 30% more compute."
    )
    checkpoint_fraction: Float = Field(
        1.0, description="With activation_checkpointing: the share of the denoiser's blocks checkpointed, the first "
        "ones in forward order (e.g. 0.5); the others keep their activations: faster, more memory. 1: every block. "
        "Single-process and data-parallel training (pipeline stages checkpoint every layer).", gt=0, le=1,
    )
    activation_offload: Bool = Field(
        False,
        description="Keep the activations the backward pass needs in CPU memory (pinned on CUDA) rather than on "
        "the GPU, each copied back when the backward pass reaches it. With activation_checkpointing these are "
        "the blocks' inputs (each comes back for its block's recomputation), so the GPU holds one block's "
        "activations at a time; without it, every saved tensor. Costs their size in system RAM and two "
        "host-device copies of each per step; the losses are the same. One pipeline stage.",
    )
    block_swap: Int = Field(
        0,
        description="Block swap for one GPU: the frozen weights of the denoiser's last N repeated blocks stay in "
        "CPU memory and each block is copied to the GPU for its forward and for its recomputation in the backward "
        "pass (0: off; more than the block count: every block). Costs their size in (pinned) system RAM and one "
        "transfer per block per forward and per recomputation. Needs activation_checkpointing (every block: "
        "checkpoint_fraction 1), LoRA, ZeRO 0-2, one pipeline stage.",
        ge=0,
        le=100_000,
    )
    token_routing: TokenRoutingConfig | None = Field(
        None,
        description="Token routing, e.g. `{keep: 0.5, start_block: 2, end_block: 17}`: in each training step a "
        "random `1 - keep` share of the image/video tokens skips blocks start_block..end_block-1 and rejoins "
        "after them (their positional embedding travels with them), so those blocks cost about `keep` of their "
        "compute and activations; evaluation and sampling use every token. Families with a homogeneous block "
        "stack (flux, qwenimage, wan); one pipeline stage. null: off.",
    )
    memory: Literal["manual", "auto"] = Field(
        "manual",
        description="`manual`: the memory keys as written. `auto`: `diffpipe train` sets the memory keys this "
        "section leaves unset (base_weights, activation_checkpointing, block_swap, activation_offload; with mode "
        "full also optimizer_in_backward, where grad_clip 0 and grad_accum 1 allow it) to the "
        "fastest setting whose `diffpipe estimate` plus a margin (1.5 GiB CUDA context + 15% of the estimate) "
        "fits train.gpu_memory, preferring bf16 > fp8 > int8 > nf4 base weights within 10% of the fastest; a key "
        "written here is never changed. See `diffpipe plan-memory` and docs/training.md.",
    )
    gpu_memory: Float | None = Field(
        None,
        description="With memory: auto, the GPU memory to plan for, in GiB; null = the free memory of the GPU at "
        "train time (a machine without a GPU then refuses memory: auto).", gt=0, le=100_000,
    )
    zero_stage: Int = Field(0, description="DeepSpeed ZeRO stage.", ge=0, le=3)
    count_flops: Bool = Field(
        True, description="Log model FLOPs per step, TFLOPS per device and MFU (`metrics.jsonl`, TensorBoard): "
        "counted with torch's FLOP formulas on the first step of each batch shape, then reused.",
    )
    peak_tflops: Float | None = Field(
        None, description="The device's dense peak TFLOPS at the training precision, for MFU; null = from the "
        "table of known GPUs in diffpipe/training/flops.py (no MFU on an unknown device or on CPU).", gt=0,
    )
    profile: ProfileConfig = Field(
        default_factory=ProfileConfig, description="Profile a window of steps, e.g. `{skip: 2, steps: 3}`: a "
        "torch profiler trace (TensorBoard plugin format) and a per-operator summary under `train/profile`.",
    )
    pipeline_stages: Int = Field(
        1,
        description="Pipeline parallel: split the denoiser's layers over this many processes (the process count "
        "must be a multiple: data parallel across the rest). ZeRO 0 or 1, LoRA only.",
        ge=1,
        le=1024,
    )
    pipeline_split: list[Annotated[Int, Field(ge=1, le=1_000_000)]] | None = Field(
        None,
        description="Manual pipeline split: the first layer index of each stage after the first; null = balance "
        "the parameter count, frozen weights included.",
    )
    offload_optimizer: Bool = Field(False, description="ZeRO 1-3: keep optimizer states in CPU memory.")
    offload_params: Bool = Field(False, description="ZeRO 3: keep parameters in CPU memory.")
    seed: Seed = Field(42, description="Seed for noise, timesteps and data order.")
    save_every_epochs: Int = Field(1, description="Save a LoRA every N epochs (0: only at the end).", ge=0, le=MAX_EPOCHS)
    checkpoint_every_steps: Int = Field(
        0, description="Full checkpoint every N steps (0: only at the end).", ge=0, le=MAX_STEPS
    )
    checkpoint_every_minutes: Float = Field(
        0, description="Also a full checkpoint every N minutes of training (0: off).", ge=0
    )
    keep_checkpoints: Int = Field(3, description="Keep only the newest K full checkpoints (0: keep all).", ge=0, le=10_000)
    max_nonfinite_steps: Int = Field(
        5, description="Optimizer steps whose loss or gradients are not finite (NaN, inf) are skipped with a "
        "warning; this many in a row stop the run with an error (exit 1). Weights that are not finite are never "
        "saved.", ge=1, le=MAX_STEPS,
    )
    mode: Literal["lora", "full"] = Field(
        "lora",
        description="`lora`: train a LoRA on the frozen denoiser; `full`: fine-tune every denoiser weight "
        "(written to `train/denoiser/` as a diffusers model; no LoRA, no per-epoch saves).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA settings.")
    text_encoder: TextEncoderTrainConfig = Field(
        default_factory=TextEncoderTrainConfig, description="LoRA on the text encoders too (SD 1.x/2.x, SDXL, Flux's CLIP-L)."
    )
    objective: ObjectiveConfig = Field(
        default_factory=ObjectiveConfig, description="Timestep sampling, loss and loss weighting."
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Eval loss at fixed timesteps and noise.")
    ema: EmaConfig = Field(default_factory=EmaConfig, description="Exponential moving average of the weights.")
    sample_every_steps: Int = Field(
        0, description="Render the `sample` prompts from the in-training weights every N steps (0: off).", ge=0,
        le=MAX_STEPS,
    )
    sample_every_epochs: Int = Field(
        0, description="Render the `sample` prompts every N epochs (0: off); PNGs under `train/samples/`.", ge=0,
        le=MAX_EPOCHS,
    )
    trackers: Annotated[list[Literal["tensorboard", "wandb", "mlflow"]], OnceEach] = Field(
        ["tensorboard"],
        description="Where rank 0 logs the numeric fields of each `metrics.jsonl` row (as `train/<field>`, "
        "`eval/<name>`), the in-training sample grids and the resolved config: `tensorboard` "
        "(`train/tensorboard/`), `wandb` (`train/wandb/`; `WANDB_MODE=offline` needs no account), `mlflow` (file "
        "store `train/mlruns/`, or the server `MLFLOW_TRACKING_URI` names). wandb and mlflow are optional "
        "packages: `pip install 'diffpipe[trackers]'`; a missing one stops `diffpipe train` and `diffpipe run` "
        "before any work, naming it. Empty: `metrics.jsonl` only.",
        max_length=3,
    )
    tracker_project: Text = Field(
        "diffpipe", description="W&B project and MLflow experiment the run logs to (TensorBoard ignores it)."
    )
    run_name: Text | None = Field(
        None, description="Name of the run in W&B and MLflow; null: the name of `output_dir`'s folder."
    )

    @model_validator(mode="after")
    def _check_base_weights(self) -> TrainConfig:
        if self.base_weights != "auto" and self.mode == "full":
            raise ValueError(f"train.base_weights: {self.base_weights} stores frozen weights in 8 or 4 bits; "
                             "train.mode full trains every weight: use train.mode lora or base_weights auto")
        if self.base_weights != "auto" and self.pipeline_stages > 1:
            raise ValueError(f"train.base_weights: {self.base_weights} needs train.pipeline_stages: 1")
        if self.base_weights != "auto" and self.zero_stage == 3:
            # ZeRO-3 partitions parameters; the stored weights are buffers, which every GPU would hold whole.
            raise ValueError(f"train.base_weights: {self.base_weights} keeps the frozen weights as buffers, which "
                             "zero_stage 3 does not partition; use zero_stage 2 (or base_weights auto)")
        if self.base_weights in ("int8", "nf4") and self.block_swap:
            # Block swap moves the frozen weights; torchao's tensors through it are untested.
            raise ValueError(f"train.base_weights: {self.base_weights} does not combine with block_swap yet; "
                             "use base_weights fp8 with it")
        return self

    @model_validator(mode="after")
    def _check_ema(self) -> TrainConfig:
        if self.ema.enabled and (self.mode != "lora" or self.zero_stage == 3 or self.pipeline_stages > 1):
            raise ValueError("train.ema needs train.mode lora, train.zero_stage 0-2 and train.pipeline_stages: 1 "
                             "(the average is kept beside whole LoRA weights on every process)")
        return self

    @model_validator(mode="after")
    def _check_text_encoder(self) -> TrainConfig:
        if not self.text_encoder.encoders:
            return self
        if self.mode != "lora" or self.lora.kind != "lora":
            raise ValueError("train.text_encoder needs train.mode lora with train.lora.kind lora (the stock "
                             "pipelines load a text encoder's LoRA, not its DoRA, LoKr or LoHa)")
        if self.zero_stage == 3 or self.pipeline_stages > 1:
            raise ValueError("train.text_encoder needs train.zero_stage 0-2 and train.pipeline_stages: 1")
        return self

    @model_validator(mode="after")
    def _check_block_swap(self) -> TrainConfig:
        if not self.block_swap:
            return self
        if not self.activation_checkpointing:
            raise ValueError("train.block_swap needs train.activation_checkpointing: true (without recomputation "
                             "autograd keeps every block's weights on the GPU until the backward pass)")
        if self.mode != "lora":
            raise ValueError("train.block_swap moves frozen weights: it needs train.mode lora")
        if self.zero_stage == 3:
            raise ValueError("train.block_swap works with train.zero_stage 0-2 (ZeRO-3 partitions the weights; "
                             "use train.offload_params there)")
        if self.pipeline_stages > 1:
            raise ValueError("train.block_swap needs train.pipeline_stages: 1")
        if self.checkpoint_fraction < 1:
            # Swap takes the last blocks; partial checkpointing leaves exactly those unchecked, and their saved
            # tensors would keep the swapped weights on the GPU until the backward pass.
            raise ValueError(f"train.block_swap needs every block checkpointed: train.checkpoint_fraction "
                             f"{self.checkpoint_fraction} leaves the last blocks, the swapped ones, unchecked; "
                             "set checkpoint_fraction: 1 (or block_swap: 0)")
        return self

    @model_validator(mode="after")
    def _check_activation_offload(self) -> TrainConfig:
        if self.activation_offload and self.pipeline_stages > 1:
            raise ValueError("train.activation_offload needs train.pipeline_stages: 1 (DeepSpeed's pipeline engine "
                             "runs the forward and backward passes itself)")
        return self

    @model_validator(mode="after")
    def _check_pipeline(self) -> TrainConfig:
        if self.pipeline_stages > 1:
            if self.zero_stage > 1:
                raise ValueError("train.pipeline_stages > 1 works with train.zero_stage 0 or 1")
            if self.mode != "lora" or self.sample_every_steps or self.sample_every_epochs:
                raise ValueError("train.pipeline_stages > 1 needs train.mode lora and no sampling during training")
        return self

    @model_validator(mode="after")
    def _check_token_routing(self) -> TrainConfig:
        if self.token_routing is not None and self.pipeline_stages > 1:
            raise ValueError("train.token_routing needs train.pipeline_stages: 1 (the pipeline-parallel layers "
                             "pass every token from stage to stage)")
        return self

    @model_validator(mode="after")
    def _check_sampling(self) -> TrainConfig:
        if (self.sample_every_steps or self.sample_every_epochs) and self.zero_stage == 3:
            raise ValueError("sampling during training (train.sample_every_*) needs train.zero_stage below 3")
        return self

    @model_validator(mode="after")
    def _check_checkpoint_fraction(self) -> TrainConfig:
        if self.checkpoint_fraction < 1 and self.pipeline_stages > 1:
            raise ValueError("train.checkpoint_fraction below 1 needs train.pipeline_stages: 1 (pipeline stages "
                             "checkpoint every layer)")
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> TrainConfig:
        if self.offload_optimizer and self.optimizer in QUANTISED_OPTIMIZERS:
            # Checked first: otherwise zero_stage 0 asks for ZeRO, and ZeRO 1-3 asks for zero_stage 0.
            raise ValueError(f"train.optimizer {self.optimizer} cannot have train.offload_optimizer: CPU-offloaded "
                             "optimizer states are ZeRO's (zero_stage 1-3), whose flat partitions torchao would keep "
                             "in float32, so the quantised states stay beside the weights; remove offload_optimizer, "
                             "or offload the states of optimizer adamw with zero_stage 1-3")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("train.offload_optimizer needs train.zero_stage 1, 2 or 3")
        if self.offload_params and self.zero_stage != 3:
            raise ValueError("train.offload_params needs train.zero_stage 3")
        if self.optimizer in BF16_OPTIMIZERS and not self.optimizer_in_backward and (
                self.zero_stage == 0 or self.offload_optimizer):
            raise ValueError(f"train.optimizer {self.optimizer}: the weights stay in bf16 without fp32 master "
                             "copies, which DeepSpeed supports with train.zero_stage 1, 2 or 3 and no "
                             "offload_optimizer; set zero_stage: 1")
        return self

    @model_validator(mode="after")
    def _check_quantised_optimizer(self) -> TrainConfig:
        if self.optimizer in QUANTISED_OPTIMIZERS and self.zero_stage:
            # ZeRO hands the optimizer one flat partition per group, of no particular length: torchao quantises
            # a tensor only when its length is a multiple of the block, so the states would silently stay float32.
            raise ValueError(f"train.optimizer {self.optimizer} needs train.zero_stage 0: ZeRO flattens the "
                             "parameters into partitions whose moments torchao keeps in float32; set zero_stage: 0")
        return self

    @model_validator(mode="after")
    def _check_optimizer_in_backward(self) -> TrainConfig:
        if not self.optimizer_in_backward:
            return self
        refusals = [
            (self.mode != "full", "train.mode full"),
            (self.grad_accum != 1, "train.grad_accum 1 (each gradient is freed once its parameter is stepped: "
                                   "there is nothing to accumulate into)"),
            (self.grad_clip != 0, "train.grad_clip 0 (clipping needs the norm over every gradient before the "
                                  "first step, and no gradient waits for it)"),
            (self.zero_stage != 0 or self.offload_optimizer, "train.zero_stage 0 and no offload_optimizer"),
            (self.pipeline_stages != 1, "train.pipeline_stages 1"),
            (self.precision == "fp16", "precision fp32 or bf16 (fp16 needs loss scaling over all gradients)"),
        ]
        for refused, need in refusals:
            if refused:
                raise ValueError(f"train.optimizer_in_backward needs {need}")
        if self.precision == "bf16" and self.optimizer not in (*QUANTISED_OPTIMIZERS, *BF16_OPTIMIZERS):
            raise ValueError(f"train.optimizer_in_backward with precision bf16 steps the bf16 weights themselves "
                             f"(no float32 master copy), where train.optimizer {self.optimizer} rounds small "
                             "updates away: use adamw8bit, adamw4bit, adamw_kahan or adamw_stochastic")
        return self
