"""Helpers the model families share: seeded tiny builds, identities, tensor layout.

Identities are content hashes that go into cache keys. A component's identity
is ``digest`` of its class, its config (private and version keys dropped) and a
fingerprint of its weights. The fingerprint is defined on tensors, not on file
bytes: the sorted set of per-tensor hashes (dtype, shape, raw bytes). So the
tiny flavor's in-memory weights and the same weights saved as safetensors
hash alike, and tied weights (stored once on disk, twice in a state dict)
count once. For a local folder the per-tensor hashes of each weight file are
memoised in ``<cache>/weight-fingerprints.json`` keyed by path, size and
mtime_ns, so a 10 GB folder is read once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from diffusers import ModelMixin
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from diffusers.loaders.single_file_utils import load_single_file_checkpoint
from safetensors import safe_open
from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerBase

from diffpipe.models import comfy_fp8
from diffpipe.models.meta import require_names
from diffpipe.models.tokenizers import cache_root
from diffpipe.utils import digest, sha256_file, stable_json, write_text_atomic

# Keys that change with the library version or the save location, not the model.
_VOLATILE_CONFIG_KEYS = {"transformers_version", "architectures", "dtype", "torch_dtype"}
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_WEIGHT_FILE = re.compile(r"^(diffusion_pytorch_model|model)(-\d+-of-\d+)?\.(safetensors|bin)$")


# -- tiny builds -------------------------------------------------------------
def component_seed(seed: int, component: str) -> int:
    """A per-component seed, so components never share a random stream."""
    return int(digest([seed, component])[:15], 16)


@contextmanager
def seeded(seed: int, component: str) -> Iterator[None]:
    """Run a block under a fixed CPU seed without disturbing the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(component_seed(seed, component))
        yield


TINY_CLIP = {
    "hidden_size": 32,
    "intermediate_size": 37,
    "num_attention_heads": 4,
    "num_hidden_layers": 5,
    "projection_dim": 32,
}


def cuda_defaults() -> None:
    """Process-wide CUDA settings every stage that runs a model applies (nothing on the CPU).

    TF32 matmuls. PyTorch's SDPA kept off its cuDNN kernels: with torch 2.11 (cuDNN 9.19) on an H200,
    FLUX.1's 1024-px LoRA step fails in the cuDNN attention kernel (``mha_graph.execute`` not good, then
    an illegal memory access that kills the process), also in a bare diffusers + PEFT loop; with SDPA's
    flash and memory-efficient kernels the same step runs (benchmarks/gpu, check b). The setting only
    narrows what ``attention_backend: native`` may pick; ``_native_cudnn`` still asks for cuDNN.
    """
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cuda.enable_cudnn_sdp(False)


_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ROLE_KEYS = {"denoiser": "dtype", "text_encoder": "text_encoder_dtype", "vae": "vae_dtype"}


def load_dtype(cfg: Any, role: str, *, cuda: bool | None = None, vae_fp32: bool = False) -> torch.dtype:
    """The dtype a component loads and computes in: ``model.dtype`` (role ``denoiser``),
    ``model.text_encoder_dtype`` or ``model.vae_dtype``. ``auto``: float32 on CPU; bfloat16 on CUDA,
    except the VAE when ``vae_fp32`` (the family declares ``vae_needs_fp32``: ``Family.vae_dtype``)."""
    value = getattr(cfg, _ROLE_KEYS[role])
    if value != "auto":
        return _DTYPE_NAMES[value]
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda or (role == "vae" and vae_fp32):
        return torch.float32
    return torch.bfloat16


def with_dtype(identity: str, dtype: torch.dtype) -> str:
    """An encoder identity that also names the dtype it encodes in, so changing it re-encodes.
    float32 leaves the identity as it was: caches written before dtypes were configurable stay valid."""
    return identity if dtype == torch.float32 else digest([identity, str(dtype)])


def component(cls: type, cfg: Any, family: str, subfolder: str, tiny: Mapping[str, Any],
              dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A diffusers model of a family, in eval mode, in its configured dtype (:func:`load_dtype`; the
    ``vae`` subfolder is the VAE, any other the denoiser): tiny flavor = ``cls(**tiny)`` with weights
    seeded from ``model.seed`` and ``family.subfolder`` (built in float32, then cast, so a tiny bf16
    model is the float32 one rounded); local = the folder's ``subfolder``, loaded straight in the dtype
    (``dtype``, when given, replaces :func:`load_dtype`'s)."""
    dtype = dtype or load_dtype(cfg, "vae" if subfolder == "vae" else "denoiser")
    if cfg.flavor == "tiny":
        with seeded(cfg.seed, f"{family}.{subfolder}"):
            model = cls(**tiny)
        # No cast at float32: diffusers' ``to`` warns on every call with a dtype.
        return (model if dtype == torch.float32 else model.to(dtype)).eval()
    return local_component(cls, cfg, subfolder, dtype)


def local_component(cls: type, cfg: Any, subfolder: str, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A diffusers model from the local folder's ``subfolder``, or from the single-file checkpoint
    ``model.single_files`` names for it (config from the folder), in eval mode, loaded in ``dtype``
    (None: the denoiser's :func:`load_dtype`)."""
    dtype = dtype or load_dtype(cfg, "vae" if subfolder == "vae" else "denoiser")
    file = cfg.single_files.get(subfolder)
    if file is None:
        return cls.from_pretrained(cfg.path, subfolder=subfolder, torch_dtype=dtype,
                                   variant=cfg.weight_variant).eval()
    return single_file_component(cls, file, cfg.path, subfolder, dtype)


def pretrained_text_encoder(cls: type, cfg: Any, subfolder: str) -> torch.nn.Module:
    """A text encoder from the local folder's ``subfolder``, loaded straight in ``model.text_encoder_dtype``
    (transformers 5 names the argument ``dtype``; a diffusers model on the text side, such as LTX-2's
    connectors, ``torch_dtype``), in eval mode."""
    key = "torch_dtype" if issubclass(cls, ModelMixin) else "dtype"
    return cls.from_pretrained(cfg.path, subfolder=subfolder, **{key: load_dtype(cfg, "text_encoder")},
                               variant=cfg.weight_variant).eval()


def single_file_component(cls: type, file: str, folder: str, subfolder: str,
                          dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``cls`` with ``folder/subfolder``'s config and the weights of the single-file checkpoint ``file``.

    diffusers' converter for ``cls`` renames an original-naming file (a file in diffusers naming
    is taken as is). The converted keys are checked against the model's before loading: diffusers
    would leave a weight the file lacks unset, and drop one the model lacks (a checkpoint of a
    different model), so either is an error naming the tensors. A file in ComfyUI's fp8-scaled layout
    loads through :func:`diffpipe.models.comfy_fp8.load_scaled_fp8` (its Linear weights stay 8-bit).
    """
    what = f"model.single_files.{subfolder}"
    known = next((c.__name__ for c in cls.__mro__ if c.__name__ in SINGLE_FILE_LOADABLE_CLASSES), None)
    if known is None:
        raise ValueError(
            f"{what}: diffusers cannot load {cls.__name__} from a single file (no converter for it); "
            f"use the diffusers folder's {subfolder}/ instead"
        )
    if not Path(file).is_file():
        raise FileNotFoundError(f"{what}: file not found: {file}")
    config = cls.load_config(folder, subfolder=subfolder)
    if comfy_fp8.scaled_fp8_key(file) is not None:  # ComfyUI's fp8-scaled layout: built in fp8, not 16 bits
        convert = SINGLE_FILE_LOADABLE_CLASSES[known]["checkpoint_mapping_fn"]
        return comfy_fp8.load_scaled_fp8(cls, file, config, convert, dtype or torch.float32, what)
    with torch.device("meta"):
        expected = set(cls.from_config(config).state_dict())
    try:
        checkpoint = load_single_file_checkpoint(file, local_files_only=True)
        if set(checkpoint) != expected:
            convert = SINGLE_FILE_LOADABLE_CLASSES[known]["checkpoint_mapping_fn"]
            checkpoint = convert(checkpoint=checkpoint, config=dict(config))
    except (ValueError, KeyError, IndexError, RuntimeError, OSError) as err:
        raise ValueError(f"{what}: cannot convert {file} to {cls.__name__}: {err!r}") from err
    require_names(expected, checkpoint, what, file, f"{cls.__name__} with the config in {Path(folder) / subfolder}")
    try:
        model = cls.from_single_file(checkpoint, config=str(folder), subfolder=subfolder, torch_dtype=dtype)
    except (ValueError, RuntimeError) as err:
        raise ValueError(f"{what}: cannot load {file} as {cls.__name__}: {err}") from err
    return model.eval()


def tiny_clip_text_encoder(
    tokenizer: PreTrainedTokenizerBase, seed: int, component: str, cls: type = CLIPTextModel
) -> CLIPTextModel:
    """The tiny CLIP text encoder (``cls``: ``CLIPTextModel`` or ``CLIPTextModelWithProjection``);
    vocabulary, length and special ids match ``tokenizer``."""
    config = CLIPTextConfig(
        **TINY_CLIP,
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with seeded(seed, component):
        return cls(config).eval()


# -- identities --------------------------------------------------------------
def clean_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config without private (``_*``) and version keys, JSON-normalised."""
    kept = {
        k: v for k, v in config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS
    }
    return json.loads(stable_json(kept))


def _tensor_hash(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _combine(tensor_hashes: Iterable[str]) -> str:
    return digest(sorted(set(tensor_hashes)))


def module_fingerprint(module: torch.nn.Module) -> str:
    """Fingerprint of a module's state-dict tensors (see module docstring)."""
    return _combine(_tensor_hash(t) for t in module.state_dict().values())


def weight_files(folder: str | Path, variant: str | None = None) -> list[Path]:
    """The weight files ``from_pretrained`` reads in a component folder.

    Safetensors when present (as the loaders prefer), else ``.bin``; with
    ``variant`` (``model.weight_variant``) the files named ``*.<variant>.*``,
    which a plain load never reads.
    """
    pattern = _WEIGHT_FILE if variant is None else re.compile(
        r"^(diffusion_pytorch_model|model)\." + re.escape(variant) + r"(-\d+-of-\d+)?\.(safetensors|bin)$")
    files = sorted(p for p in Path(folder).iterdir() if pattern.match(p.name))
    safe = [p for p in files if p.suffix == ".safetensors"]
    chosen = safe or files
    if not chosen:
        raise FileNotFoundError(
            f"no weight file (diffusion_pytorch_model*.safetensors or model*.safetensors) in {folder}"
        )
    return chosen


def _file_tensor_hashes(path: Path) -> list[str]:
    if path.suffix != ".safetensors":
        # Pickled checkpoints are not read tensor by tensor: hash the bytes.
        return [sha256_file(path)]

    with safe_open(str(path), framework="pt") as f:
        return sorted({_tensor_hash(f.get_tensor(name)) for name in f.keys()})


def _memo_path() -> Path:
    return cache_root() / "weight-fingerprints.json"


def _read_memo() -> dict[str, list[str]]:
    try:
        return json.loads(_memo_path().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def folder_fingerprint(folder: str | Path, variant: str | None = None) -> str:
    """Fingerprint of a component folder's weight files (of ``variant``), memoised on disk."""
    return files_fingerprint(weight_files(folder, variant))


def weights_fingerprint(cfg: Any, subfolder: str) -> str:
    """Fingerprint of a local component's weights: its single file (``model.single_files``) or its folder."""
    file = cfg.single_files.get(subfolder)
    return files_fingerprint([Path(file)]) if file else folder_fingerprint(Path(cfg.path) / subfolder,
                                                                          cfg.weight_variant)


def files_fingerprint(files: Iterable[Path]) -> str:
    """Fingerprint of weight files (see module docstring), memoised on disk."""
    memo = _read_memo()
    hashes: list[str] = []
    changed = False
    for path in files:
        stat = path.stat()
        key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if key not in memo:
            memo[key] = _file_tensor_hashes(path)
            changed = True
        hashes += memo[key]
    if changed:
        # Re-read so entries written by a concurrent process are kept.
        write_text_atomic(_memo_path(), stable_json({**_read_memo(), **memo}))
    return _combine(hashes)


# Process-wide memo of tiny-flavor identities: building a component to hash it
# is cheap but not free, and every cache job asks.
_TINY_IDENTITIES: dict[tuple, str] = {}


def memo_identity(key: tuple, build: Callable[[], str]) -> str:
    """``build()`` once per process per ``key`` (tiny flavors only: they cannot change)."""
    if key not in _TINY_IDENTITIES:
        _TINY_IDENTITIES[key] = build()
    return _TINY_IDENTITIES[key]


def identity(kind: str, config: Mapping[str, Any], weights: str) -> dict[str, Any]:
    """One component's identity record (class, cleaned config, weight fingerprint)."""
    return {"class": kind, "config": clean_config(config), "weights": weights}


def module_identity(module: torch.nn.Module) -> dict[str, Any]:
    """Identity record of an in-memory diffusers or transformers model."""
    config = module.config
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return identity(type(module).__name__, config, module_fingerprint(module))


def diffusers_component_identity(cls: type, cfg: Any, subfolder: str) -> dict[str, Any]:
    """Identity of a local diffusers component (folder or single file), without loading the model."""
    config = cls.load_config(cfg.path, subfolder=subfolder)
    return identity(cls.__name__, config, weights_fingerprint(cfg, subfolder))


def transformers_folder_identity(model_cls: type, config_cls: type, path: str, subfolder: str,
                                 variant: str | None = None):
    """Identity of a transformers model folder (its ``variant`` weight files), without loading the weights;
    a diffusers ``config_cls`` (a diffusers model on the text side) reads its config with ``load_config``."""
    if hasattr(config_cls, "load_config"):
        config = dict(config_cls.load_config(path, subfolder=subfolder))
    else:
        config = config_cls.from_pretrained(path, subfolder=subfolder).to_dict()
    return identity(model_cls.__name__, config, folder_fingerprint(Path(path) / subfolder, variant))


# -- tensors -----------------------------------------------------------------
def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a DeepSpeed engine (or DDP); the model itself otherwise."""
    return getattr(model, "module", model)


def param_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the denoiser computes in: its weights' dtype, or, under layerwise casting
    (``train.base_weights: fp8``), the dtype its float8-stored weights are cast to for each forward."""
    dtype = next(model.parameters()).dtype
    if dtype not in _FLOAT8:
        return dtype
    for m in model.modules():
        registry = getattr(m, "_diffusers_hook", None)
        hook = registry.get_hook("layerwise_casting") if registry is not None else None
        if hook is not None:
            return hook.compute_dtype
    raise ValueError(f"{type(model).__name__} stores weights in {dtype} without layerwise casting: no compute dtype")


def frames_to_batch(pixels: torch.Tensor) -> torch.Tensor:
    """``[B,C,F,H,W]`` -> ``[B*F,C,H,W]`` for image VAEs (frame-major per sample)."""
    b, c, f, h, w = pixels.shape
    return pixels.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)


def batch_to_frames(x: torch.Tensor, frames: int) -> torch.Tensor:
    """Inverse of ``frames_to_batch``: ``[B*F,C,h,w]`` -> ``[B,C,F,h,w]``."""
    bf, c, h, w = x.shape
    return x.reshape(bf // frames, frames, c, h, w).permute(0, 2, 1, 3, 4)


def single_frame(latents: torch.Tensor, family: str) -> torch.Tensor:
    """``[B,C,1,h,w]`` -> ``[B,C,h,w]``; image families train on single frames."""
    if latents.ndim != 5 or latents.shape[2] != 1:
        raise ValueError(
            f"family {family!r} trains on images: latents must be [B,C,1,h,w], got {tuple(latents.shape)}"
        )
    return latents[:, :, 0]


def vae_latents(vae: torch.nn.Module, pixels: torch.Tensor, *, per_frame: bool = True,
                frame_axis: bool = False) -> torch.Tensor:
    """The VAE's latent mode (float32, not yet normalised) of ``pixels`` ``[B,3,F,H,W]``, as ``[B,C,F',h,w]``.

    ``per_frame``: each frame is an image of its own (an image VAE; ``frame_axis``: one that takes
    ``[N,3,1,H,W]``, as Qwen-Image's and Wan's do); otherwise the clip is encoded at once (a video VAE,
    ``F'`` its compressed frame count). Encoded in the VAE's device and dtype, without gradients.
    """
    param = next(vae.parameters())
    with torch.no_grad():
        if not per_frame:
            return _mode(vae.encode(pixels.to(device=param.device, dtype=param.dtype))).float()
        x = frames_to_batch(pixels).to(device=param.device, dtype=param.dtype)
        if frame_axis:
            latents = _mode(vae.encode(x[:, :, None]))[:, :, 0]
        else:
            latents = _mode(vae.encode(x))
    return batch_to_frames(latents.float(), pixels.shape[2])


def _mode(encoded: Any) -> torch.Tensor:
    """The latents of an ``encode`` output: its distribution's mode, or the latent itself (a deterministic
    autoencoder such as Sana's DC-AE)."""
    return encoded.latent if hasattr(encoded, "latent") else encoded.latent_dist.mode()


def scaled_latents(latents: torch.Tensor, vae: torch.nn.Module, *, shift: bool = True) -> torch.Tensor:
    """``(latents - shift_factor) * scaling_factor``: the inverse of the pipelines' ``latents / scaling_factor
    + shift_factor`` before decoding (``shift``: False for pipelines that apply no shift)."""
    offset = (vae.config.get("shift_factor") or 0.0) if shift else 0.0
    return (latents - offset) * vae.config.scaling_factor


def latent_stats(vae: torch.nn.Module, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The VAE config's per-channel ``latents_mean`` and ``latents_std``, shaped to broadcast over ``latents``
    ``[B,C,...]``, on its device."""
    shape = (1, -1) + (1,) * (latents.ndim - 2)
    c = vae.config
    return (torch.tensor(c.latents_mean, device=latents.device).view(shape),
            torch.tensor(c.latents_std, device=latents.device).view(shape))


#: Tokenizer ids a tiny encoder's config takes: decoder-style language models and T5-style encoders.
LM_IDS = ("pad", "bos", "eos")
T5_IDS = ("pad", "eos", "decoder_start")


def tiny_text_model(model_cls: type, config_cls: type, config: Mapping[str, Any], component: str,
                    ids: tuple[str, ...] = LM_IDS, *,
                    vision: Mapping[str, Any] | None = None) -> Callable[[Any, int], torch.nn.Module]:
    """A ``TextEncoder.tiny`` builder: ``model_cls(config_cls(**config, vocab_size=len(tok), <ids>))``,
    weights seeded from ``model.seed`` and ``component``. ``decoder_start`` takes the pad id, as T5 does.
    ``vision``: a vision-language model, ``config_cls(text_config=<that>, vision_config=vision)``."""

    def build(tok: Any, seed: int) -> torch.nn.Module:
        special = {f"{k}_token_id": tok.pad_token_id if k == "decoder_start" else getattr(tok, f"{k}_token_id")
                   for k in ids}
        text = {**config, "vocab_size": len(tok), **special}
        with seeded(seed, component):
            cfg = config_cls(**text) if vision is None else config_cls(text_config=text, vision_config=dict(vision))
            return model_cls(cfg).eval()

    return build


def forward_by_text_length(run: Callable[[dict[str, torch.Tensor], int], torch.Tensor],
                           inputs: Mapping[str, torch.Tensor], lengths: list[int]) -> torch.Tensor:
    """The denoiser's output for a batch whose prompts have their own token counts, for transformers that
    cannot mask text: ``run(part, n)`` forwards the rows ``part`` (every input cut to them) whose prompts
    have ``n`` tokens, once per distinct ``n``; the outputs come back in batch order."""
    device = next(iter(inputs.values())).device
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    outs, order = [], []
    for n, idx in sorted(groups.items()):
        rows = torch.tensor(idx, device=device) if len(groups) > 1 else slice(None)
        outs.append(run({k: v[rows] for k, v in inputs.items()}, n))
        order += idx
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)[torch.argsort(torch.tensor(order, device=device))]


def prompt_lengths(embeds: torch.Tensor, keep: torch.Tensor) -> list[int]:
    """Each cached prompt's token count from its ``*_mask`` (on the meta device, as memory estimates run:
    every prompt at full length); a clear error for an empty one."""
    if embeds.device.type == "meta":
        return [embeds.shape[1]] * embeds.shape[0]
    lengths = [int(n) for n in keep.sum(dim=1).round().long().tolist()]
    if min(lengths) <= 0:
        raise ValueError("text prompt_embeds_mask: an item has no prompt tokens; rerun the text cache step")
    return lengths


def one_prompt_length(family: str, lengths: list[int]) -> int:
    """The one prompt length of a pipeline-parallel micro-batch (its transformer cannot mask text, and a
    pipeline stage passes one tensor); a clear error when the prompts differ."""
    distinct = sorted(set(lengths))
    if len(distinct) != 1:
        raise ValueError(
            f"{family} with train.pipeline_stages > 1: the prompts of a micro-batch have {distinct} tokens, "
            "but a pipeline needs one prompt length per micro-batch (the transformer cannot mask text); "
            "set train.batch_size: 1 or train.pipeline_stages: 1"
        )
    return distinct[0]
