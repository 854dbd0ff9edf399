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

# (ss_base_model_version, modelspec.architecture, modelspec.implementation)
_SD1 = ("sd_v1", "stable-diffusion-v1/lora", "https://github.com/Stability-AI/generative-models")
_SD2 = ("sd_v2", "stable-diffusion-v2-512/lora", "https://github.com/Stability-AI/generative-models")
_SDXL = ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora", "https://github.com/Stability-AI/generative-models")
# Transformer families: the names sd-scripts (SD3, Chroma, Lumina 2) or musubi-tuner
# (Qwen-Image, Wan, HunyuanVideo) write; the edit models keep their base model's version,
# and families no kohya trainer covers (HiDream, LTX-Video, Mochi, Cosmos, CogVideoX,
# CogView4) get their own.
_BY_FAMILY = {
    "flux": ("flux1", "flux-1-dev/lora", "https://github.com/black-forest-labs/flux"),
    "chroma": ("chroma", "chroma/lora", "https://huggingface.co/lodestones/Chroma"),
    "sd3": ("sd3", "stable-diffusion-3/lora", "https://github.com/Stability-AI/sd3.5"),
    "lumina2": ("lumina2", "lumina-2/lora", "https://github.com/Alpha-VLLM/Lumina-Image-2.0"),
    "qwenimage": ("qwen_image", "Qwen-Image/lora", "https://github.com/QwenLM/Qwen-Image"),
    "hidream": ("hidream", "hidream-i1/lora", "https://github.com/HiDream-ai/HiDream-I1"),
    "wan": ("wan", "wan2.1/lora", "https://github.com/Wan-Video/Wan2.1"),
    "flux-kontext": ("flux1", "flux-1-kontext-dev/lora", "https://github.com/black-forest-labs/flux"),
    "qwenimage-edit": ("qwen_image", "Qwen-Image-Edit/lora", "https://github.com/QwenLM/Qwen-Image"),
    "hunyuanvideo": ("hunyuan_video", "hunyuan-video/lora", "https://github.com/Tencent/HunyuanVideo"),
    "ltxvideo": ("ltx_video", "ltx-video/lora", "https://github.com/Lightricks/LTX-Video"),
    "mochi": ("mochi", "mochi-1/lora", "https://github.com/genmoai/mochi"),
    "cosmos2": ("cosmos_predict2", "cosmos-predict2/lora", "https://github.com/nvidia-cosmos/cosmos-predict2"),
    "cosmos2-video": ("cosmos_predict2", "cosmos-predict2/lora", "https://github.com/nvidia-cosmos/cosmos-predict2"),
    "cogvideox": ("cogvideox", "cogvideox/lora", "https://github.com/THUDM/CogVideo"),
    "cogview4": ("cogview4", "cogview4/lora", "https://github.com/THUDM/CogView4"),
}


def base_model_version(family: str, denoiser_config: dict[str, Any]) -> tuple[str, str, str]:
    """The sd-scripts base model version and modelspec architecture of a denoiser."""
    if family in _BY_FAMILY:
        return _BY_FAMILY[family]
    if family not in ("sd", "sdxl"):  # a guess would label the file as another model's LoRA
        raise ValueError(f"kohya format: no sd-scripts base model version for family {family!r} "
                         "(diffpipe/export/kohya.py _BY_FAMILY needs one)")
    if denoiser_config.get("addition_embed_type") == "text_time":
        return _SDXL
    return _SD2 if denoiser_config.get("cross_attention_dim") == 1024 else _SD1


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
    now = time.time()
    meta = {
        **_network(info),
        "ss_network_dim": str(info.rank),
        "ss_network_alpha": str(info.alpha),
        "ss_network_train_unet_only": "True",
        "ss_base_model_version": version,
        "ss_sd_model_name": info.model_path or f"{info.family}-{info.flavor}",
        "ss_training_started_at": str(started_at if started_at is not None else now),
        "ss_training_finished_at": str(now),
        "ss_num_train_images": str(info.dataset.get("items", 0)),
        "ss_steps": str(info.training.get("step", 0)),
        "ss_epoch": str(info.training.get("epoch", 0)),
        "ss_learning_rate": str(train.get("lr", "")),
        "ss_unet_lr": str(train.get("lr", "")),
        "ss_text_encoder_lr": "0",
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
    mods: dict[str, Lora] | dict[str, Product], keymap: KeyMap, out_file: str | Path, metadata: dict[str, str] | None = None
) -> Path:
    """Write our per-module LoRAs as a kohya / A1111 LoRA file."""
    if mods and isinstance(next(iter(mods.values())), Product):  # LoKr / LoHa: LyCORIS tensors
        layers = refuse_restructured(mods, keymap, "kohya", next(iter(mods.values())).kind)
        return write_products(mods, {m: layer.kohya for m, layer in layers.items()}, out_file, metadata)
    loras, layout = to_original(mods, keymap)
    named = {layer.kohya: lora for layer, lora in loras.items()}
    bare = frozenset(layer.kohya for layer in loras if not layer.alpha_key)
    return write_original(named, layout, out_file, metadata, without_alpha=bare)
