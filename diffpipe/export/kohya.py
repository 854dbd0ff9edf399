"""kohya / A1111 format: ``lora_unet_<name>.lora_down/lora_up.weight`` + ``.alpha``, ``ss_*`` and ``modelspec.*`` metadata.

Names come from the family key map (``Layer.kohya``): sd-scripts names SD 1.x/2.x
layers by the diffusers UNet path and every other family's layers (SDXL, SD3,
Flux, Chroma, Lumina 2; musubi-tuner: Wan, Qwen-Image) by the original path
(CogVideoX: ComfyUI's model path, see its key map).
The ``ss_*`` keys are the ones sd-scripts writes and A1111 / kohya's GUI read;
``modelspec.*`` follows Stability's model spec 1.0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from diffpipe.export.convert import Lora, to_original
from diffpipe.export.keymaps import KeyMap
from diffpipe.export.lycoris import Product, refuse_restructured, write_products
from diffpipe.export.metadata import ExportInfo
from diffpipe.export.original_io import write_original
from diffpipe.families import spec


def base_model_version(family: str, denoiser_config: dict[str, Any]) -> tuple[str, str, str]:
    """The sd-scripts base model version and modelspec architecture of a denoiser (its family's spec:
    the names sd-scripts or musubi-tuner write, or the family's own where no kohya trainer covers it).

    An unknown family is an error: a guess would label the file as another model's LoRA."""
    k = spec(family).kohya_for(denoiser_config)
    return k.base_model_version, k.architecture, k.implementation


def _network(info: ExportInfo) -> dict[str, str]:
    """``ss_network_module`` / ``ss_network_args``: sd-scripts' LoRA, or LyCORIS' module with its algorithm."""
    args: dict[str, Any] = {"conv_dim": info.rank, "conv_alpha": info.alpha}
    if info.kind in ("lokr", "loha"):
        return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps({**args, "algo": info.kind})}
    return {"ss_network_module": "networks.lora", "ss_network_args": json.dumps(args)}


def kohya_metadata(
    info: ExportInfo, denoiser_config: dict[str, Any], *, title: str, started_at: float | None = None
) -> dict[str, str]:
    """``ss_*`` and ``modelspec.*`` keys, as sd-scripts writes them (strings)."""
    version, arch, impl = base_model_version(info.family, denoiser_config)
    cfg = info.config or {}
    train = cfg.get("train", {})
    datasets = cfg.get("datasets", [])
    res = max((d.get("resolution", 0) for d in datasets), default=0)
    items = info.dataset.get("items_per_dataset", {})
    text = train.get("text_encoder") or {}  # text encoders trained beside the denoiser
    now = time.time()
    meta = {
        **_network(info),
        "ss_network_dim": str(info.rank),
        "ss_network_alpha": str(info.alpha),
        "ss_network_train_unet_only": str(not text.get("encoders")),
        "ss_base_model_version": version,
        "ss_sd_model_name": info.model_path or f"{info.family}-{info.flavor}",
        "ss_training_started_at": str(started_at if started_at is not None else now),
        "ss_training_finished_at": str(now),
        "ss_num_train_images": str(info.dataset.get("items", 0)),
        "ss_steps": str(info.training.get("step", 0)),
        "ss_epoch": str(info.training.get("epoch", 0)),
        "ss_learning_rate": str(train.get("lr", "")),
        "ss_unet_lr": str(train.get("lr", "")),
        "ss_text_encoder_lr": str(text.get("lr") or train.get("lr", "")) if text.get("encoders") else "0",
        "ss_lr_scheduler": str(train.get("lr_schedule", "")),
        "ss_batch_size_per_device": str(train.get("batch_size", "")),
        "ss_gradient_accumulation_steps": str(train.get("grad_accum", "")),
        "ss_mixed_precision": str(train.get("precision", "")),
        "ss_seed": str(train.get("seed", "")),
        "ss_resolution": f"({res}, {res})",
        "ss_dataset_dirs": json.dumps(
            {d["name"]: {"n_repeats": d.get("repeats", 1), "img_count": items.get(d["name"], 0)} for d in datasets}
        ),
        "ss_output_name": title,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": arch,
        "modelspec.implementation": impl,
        "modelspec.title": title,
        "modelspec.resolution": f"{res}x{res}",
        "modelspec.date": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)),
    }
    if info.trigger_words:
        meta["modelspec.trigger_phrase"] = ", ".join(info.trigger_words)
    return meta


def export_kohya(
    mods: dict[str, Lora] | dict[str, Product], keymap: KeyMap, out_file: str | Path, metadata: dict[str, str] | None = None,
    text: dict[str, Lora] | None = None,
) -> Path:
    """Write our per-module LoRAs as a kohya / A1111 LoRA file; ``text``: the trained text encoders' LoRAs
    under their kohya names (``export.text_encoders.kohya_tensors``)."""
    if mods and isinstance(next(iter(mods.values())), Product):  # LoKr / LoHa: LyCORIS tensors
        layers = refuse_restructured(mods, keymap, "kohya", next(iter(mods.values())).kind)
        return write_products(mods, {m: layer.kohya for m, layer in layers.items()}, out_file, metadata)
    loras, layout = to_original(mods, keymap)
    named = {layer.kohya: lora for layer, lora in loras.items()} | (text or {})
    bare = frozenset(layer.kohya for layer in loras if not layer.alpha_key)
    return write_original(named, layout, out_file, metadata, without_alpha=bare)
