"""``diffpipe import-lora``: read a LoRA in any exported format back into our adapter folder.

Accepted: a PEFT folder; a diffusers file (``unet.`` / ``transformer.`` keys,
alpha from ``lora_adapter_metadata`` or ``.alpha`` keys); a ComfyUI file
(``diffusion_model.<original>``); a kohya file (``lora_unet_...``); with the text encoders' LoRAs
beside the denoiser's for families that train them (``text_encoder.*``, ``lora_te*_``). Layer names
are looked up in the family's key map; a name it does not know is an error
that lists it, never a silently dropped layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import peft
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.export.convert import Lora, _pattern_value, adapter_from_loras, from_original, module_loras
from diffpipe.export.import_checks import (
    Shapes,
    adapter_metadata,
    alpha_pattern,
    alpha_value,
    check_lora,
    check_magnitude,
    check_product,
    module_shapes,
    text_encoder_shapes,
)
from diffpipe.export.keymaps import KeyMap, Layer, denoiser_skeleton, keymap_for_model
from diffpipe.export.lycoris import Product, adapter_from_products, module_products, read_products
from diffpipe.export.original_io import LAYOUT_KEY, read_original
from diffpipe.export.text_encoders import TextLoras, clip_module, module_of_kohya
from diffpipe.models.base import Family
from diffpipe.models.keymap import kohya_name
from diffpipe.training.adapter import CONFIG_NAME, WEIGHTS_NAME, adapter_kind, load_adapter, save_adapter
from diffpipe.training.text_encoders import load_text_adapters

#: A module's (or a file layer's) weight shape in the model, None where it has none.
Expect = Callable[[str], tuple[int, ...] | None]
COMFY_PREFIX = "diffusion_model."
KOHYA_PREFIX = "lora_unet_"


@dataclass
class ImportResult:
    format: str
    modules: int
    out_dir: Path

    def __str__(self) -> str:
        return f"{self.format} LoRA, {self.modules} modules -> {self.out_dir}"


def _text_prefixes(family: Family, fmt: str) -> tuple[str, ...]:
    """Key prefixes of the family's trainable text encoders' LoRAs in format ``fmt`` (none for most)."""
    if fmt == "diffusers":
        return tuple(f"{name}." for name in family.trainable_text_encoders)
    return tuple(f"{prefix}_" for prefix in family.trainable_text_encoders.values())


def detect_format(source: Path, family: Family) -> str:
    """``peft``, ``diffusers``, ``comfyui`` or ``kohya``, from the folder layout or the key names (text
    encoders' keys beside them for families that train them)."""
    if source.is_dir():
        if (source / CONFIG_NAME).exists():
            return "peft"
        raise ValueError(f"{source}: a folder must be a PEFT adapter (with {CONFIG_NAME})")
    if not source.exists():
        raise FileNotFoundError(f"LoRA file not found: {source}")
    with safe_open(str(source), framework="pt") as f:
        keys = list(f.keys())
    if not keys:
        raise ValueError(f"{source}: holds no tensors")
    text_keys = _text_prefixes(family, "diffusers") + _text_prefixes(family, "kohya")
    denoiser_keys = [k for k in keys if not k.startswith(text_keys)]
    for fmt, prefix in (("diffusers", f"{family.denoiser_name}."), ("comfyui", COMFY_PREFIX), ("kohya", KOHYA_PREFIX)):
        if denoiser_keys and all(k.startswith(prefix) for k in denoiser_keys) and all(
                k.startswith((prefix, *_text_prefixes(family, fmt))) for k in keys):
            return fmt
    text = [k for k in keys if k.startswith(("lora_te", "text_encoder", "text_encoders."))]
    if text:
        can = ", ".join(family.trainable_text_encoders)
        raise ValueError(f"{source}: text-encoder LoRA keys {text[:2]} are not read for family {family.name!r} "
                         f"(it trains {f'the text encoders {can}' if can else f'the {family.denoiser_name} only'}, "
                         "named text_encoder.* in diffusers files, lora_te*_ in kohya and ComfyUI files)")
    raise ValueError(f"{source}: key names match no known LoRA format for family {family.name!r} "
                     f"(expected {family.denoiser_name}.*, diffusion_model.* or lora_unet_*), e.g. {keys[:3]}")


def _diffusers_loras(source: Path, prefix: str, expect: Expect | None = None,
                     ) -> tuple[dict[str, Lora], dict[str, torch.Tensor]]:
    """The LoRAs of one component (keys ``prefix``: ``unet.``, ``text_encoder.``) of a diffusers file,
    each checked (``expect``: a module's weight shape in the model, to check shapes against)."""
    expect = expect or (lambda module: None)
    tensors = {k.removeprefix(prefix): v for k, v in load_file(str(source)).items() if k.startswith(prefix)}
    with safe_open(str(source), framework="pt") as f:
        header = f.metadata() or {}
    cfg = adapter_metadata(source, header, prefix)
    alphas = {k.removesuffix(".alpha"): alpha_value(source, prefix + k, v)
              for k, v in tensors.items() if k.endswith(".alpha")}
    loras = {}
    for key, down in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key.removesuffix(".lora_A.weight")
        up = tensors.get(f"{module}.lora_B.weight")
        if up is None:
            raise ValueError(f"{source}: {prefix}{module} has lora_A but no lora_B")
        check_lora(source, (prefix + key, f"{prefix}{module}.lora_B.weight"), down, up, expect(module))
        rank = down.shape[0]
        alpha = alphas.get(module)
        if alpha is None:
            # PEFT's rule: patterns match a module name or its dotted suffix; rsLoRA scales by sqrt(rank).
            alpha = float(_pattern_value(cfg["alpha_pattern"], module, cfg.get("lora_alpha", rank)))
            if cfg.get("use_rslora"):
                alpha *= math.sqrt(rank)
        loras[module] = Lora(down.float(), up.float(), alpha)
    # DoRA: the learned magnitude per output row, beside its LoRA.
    magnitudes = {k.removesuffix(".lora_magnitude_vector"): v for k, v in tensors.items()
                  if k.endswith(".lora_magnitude_vector")}
    other = sorted(set(magnitudes) - set(loras))
    if other:
        raise ValueError(f"{source}: DoRA magnitude without a LoRA for {other[:3]}")
    for module, v in magnitudes.items():
        check_magnitude(source, f"{prefix}{module}.lora_magnitude_vector", v, expect(module))
    return loras, {m: v.float() for m, v in magnitudes.items()}


def _original_index(keymap: KeyMap, fmt: str) -> dict:
    # kohya SD files name layers either by our path (sd-scripts SD 1.x) or by the original path (SDXL).
    # Both the original names and ComfyUI's own where they differ (files written before or elsewhere).
    if fmt == "comfyui":
        index = {COMFY_PREFIX + name: layer for layer in keymap.layers for name in (layer.original, layer.comfy_name)}
    else:
        index = {**{kohya_name(layer.original): layer for layer in keymap.layers}, **keymap.by_kohya}
    return index


def _layer_shapes(index: dict[str, Layer], shapes: Shapes) -> dict[str, tuple[int, ...]]:
    """A file's layer name -> the weight shape its LoRA updates: all its modules' rows (a fused layer) by
    its modules' input shape (they share one input)."""
    return {name: (layer.out_features, *shapes[layer.modules[0]][1:]) for name, layer in index.items()
            if layer.modules[0] in shapes}


def _original_loras(source: Path, keymap: KeyMap, fmt: str, text_prefixes: tuple[str, ...],
                    shapes: Shapes) -> dict[str, Lora]:
    index = _original_index(keymap, fmt)
    named, layout, _ = read_original(source, _layer_shapes(index, shapes).get)
    named = {k: v for k, v in named.items() if not k.startswith(text_prefixes)}
    unmapped = sorted(set(named) - set(index))
    if unmapped:
        raise ValueError(f"{source}: {len(unmapped)} layer(s) are not in the {keymap.family} key map "
                         f"(wrong family or model?), e.g. {unmapped[:5]}")
    by_original = {layer.original: layer for layer in index.values()}
    for original, blocks in (layout or {}).items():
        layer = by_original.get(original)
        stray = sorted({m for m, _, _ in blocks} - set(layer.modules if layer else ()))
        if stray:
            raise ValueError(f"{source}: {LAYOUT_KEY}[{original!r}] names {stray[:3]}, not modules of that layer "
                             "in the key map")
    try:
        return from_original({index[name]: lora for name, lora in named.items()}, layout)
    except ValueError as err:  # a layout whose ranks do not add up to the file's
        raise ValueError(f"{source}: {LAYOUT_KEY}: {err}") from None


def _original_products(source: Path, keymap: KeyMap, fmt: str, shapes: Shapes) -> dict[str, Product]:
    """A comfyui/kohya file's LoKr or LoHa layers, by our module (each layer one whole module)."""
    index = _original_index(keymap, fmt)
    named = read_products(load_file(str(source)), str(source), _layer_shapes(index, shapes).get)
    unmapped = sorted(set(named) - set(index))
    if unmapped:
        raise ValueError(f"{source}: {len(unmapped)} layer(s) are not in the {keymap.family} key map "
                         f"(wrong family or model?), e.g. {unmapped[:5]}")
    layers = {name: index[name] for name in named}
    fused = sorted(la.original for la in layers.values() if not la.is_plain)
    if fused:
        raise ValueError(f"{source}: a LoKr/LoHa on the fused or reordered layer(s) {fused[:3]} cannot be split "
                         "into our modules exactly")
    return {layers[name].segments[0].module: p for name, p in named.items()}


def _is_lycoris(source: Path) -> bool:
    with safe_open(str(source), framework="pt") as f:
        return any(k.rpartition(".")[2].startswith(("lokr_", "hada_")) for k in f.keys())


def import_lora(source: str | Path, out_dir: str | Path, family: Family, *, fmt: str | None = None) -> ImportResult:
    """Convert ``source`` into a PEFT adapter folder at ``out_dir`` that training can continue from.

    Everything is checked against the model before anything is written (``import_checks``)."""
    source, out_dir = Path(source), Path(out_dir)
    fmt = fmt or detect_format(source, family)
    skeleton = denoiser_skeleton(family)
    shapes = module_shapes(skeleton)
    magnitudes: dict[str, torch.Tensor] = {}
    sd = cfg = None
    if fmt == "peft":
        sd, cfg = load_adapter(source)
        _check_peft(source, sd, cfg, shapes.get)
        kind = adapter_kind(cfg)
        mods = module_loras(sd, cfg) if kind == "lora" else {k.rsplit(".", 1)[0].removesuffix(".lora_A")
                                                            .removesuffix(".lora_B"): None for k in sd}
    elif fmt == "diffusers":
        mods, magnitudes = _diffusers_loras(source, f"{family.denoiser_name}.", shapes.get)
    elif fmt in ("comfyui", "kohya"):
        keymap = keymap_for_model(family.name, skeleton)
        if _is_lycoris(source):
            sd, cfg = adapter_from_products(mods := _original_products(source, keymap, fmt, shapes))
        else:
            mods = _original_loras(source, keymap, fmt, _text_prefixes(family, fmt), shapes)
    else:
        raise ValueError(f"unknown LoRA format {fmt!r}; choose from peft, diffusers, comfyui, kohya")
    missing = sorted(set(mods) - set(shapes))
    if missing:
        raise ValueError(f"{source}: {len(missing)} module(s) do not exist in the {family.name} denoiser, e.g. {missing[:3]}")
    if sd is None or (fmt == "peft" and adapter_kind(cfg) == "lora"):
        sd, cfg = adapter_from_loras(mods)
        if magnitudes:  # DoRA
            cfg.use_dora = True
            sd |= {f"{m}.lora_magnitude_vector": v.contiguous() for m, v in sorted(magnitudes.items())}
    text = _text_adapters(source, family, fmt)
    save_adapter(out_dir, sd, cfg, {"imported_from": str(source), "format": fmt, "family": family.name},
                 text_encoders=text)
    text_modules = sum(k.endswith(".lora_A.weight") for sd_, _ in text.values() for k in sd_)
    return ImportResult(fmt, len(mods) + text_modules, out_dir)


def _check_peft(folder: Path, sd: dict[str, torch.Tensor], cfg: peft.PeftConfig, expect: Expect) -> None:
    """A PEFT folder's adapter: its config's alpha and rank settings, then every module's tensors."""
    cfg_file, weights = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    kind = adapter_kind(cfg)
    alpha_value(cfg_file, "lora_alpha" if kind in ("lora", "dora") else "alpha",
                cfg.lora_alpha if kind in ("lora", "dora") else cfg.alpha)
    alpha_pattern(cfg_file, "alpha_pattern", cfg.alpha_pattern)
    for key, rank in (("r", cfg.r), *((f"rank_pattern[{k!r}]", v) for k, v in (cfg.rank_pattern or {}).items())):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{cfg_file}: {key}: a rank is a whole number >= 1, not {rank!r}")
    if kind in ("lokr", "loha"):
        try:
            products = module_products(sd, cfg)
        except ValueError as err:  # a tensor that is not LoKr's or LoHa's
            raise ValueError(f"{weights}: {err}") from None
        for module, p in products.items():
            check_product(weights, module, kind, p.tensors, expect(module))
        return
    ups = {k.removesuffix(".lora_B.weight") for k in sd if k.endswith(".lora_B.weight")}
    for key, value in sd.items():
        module, _, leaf = key.rpartition(".lora_")
        if leaf == "A.weight":
            if module not in ups:
                raise ValueError(f"{weights}: {key} has no {module}.lora_B.weight")
            check_lora(weights, (key, f"{module}.lora_B.weight"), value, sd[f"{module}.lora_B.weight"],
                       expect(module))
        elif leaf == "magnitude_vector":
            check_magnitude(weights, key, value, expect(module))
        elif leaf != "B.weight" or f"{module}.lora_A.weight" not in sd:
            raise ValueError(f"{weights}: {key} is not part of a LoRA (lora_A / lora_B / DoRA magnitude pairs)")


def _text_expect(family: Family, name: str) -> Expect:
    """Text encoder ``name``'s module weight shapes by module path (its skeleton built on first use)."""
    shapes = functools.cache(lambda: text_encoder_shapes(family, name))
    cls = family.text_parts[name].cls
    return lambda module: shapes().get(clip_module(module, cls))


def _kohya_text_expect(family: Family, expects: dict[str, Expect]) -> Expect:
    """A kohya text-encoder layer name's weight shape (None for other names)."""
    def expect(layer: str) -> tuple[int, ...] | None:
        for name, prefix in family.trainable_text_encoders.items():
            if layer.startswith(f"{prefix}_"):
                module = module_of_kohya(layer.removeprefix(f"{prefix}_"), family.text_parts[name].cls)
                return None if module is None else expects[name](module)
        return None
    return expect


def _text_adapters(source: Path, family: Family, fmt: str) -> TextLoras:
    """The text encoders' LoRAs in ``source`` (PEFT folders per encoder), by encoder, each checked."""
    expects = {name: _text_expect(family, name) for name in family.trainable_text_encoders}
    if fmt == "peft":
        found = load_text_adapters(source)
        for name, (sd, cfg) in found.items():
            if name not in expects:
                raise ValueError(f"{source / name}: family {family.name!r} trains no text encoder {name!r}")
            _check_peft(source / name, sd, cfg, expects[name])
        return found
    loras: dict[str, dict[str, Lora]] = {}
    if fmt == "diffusers":
        for name in family.trainable_text_encoders:
            part, magnitudes = _diffusers_loras(source, f"{name}.", expects[name])
            if magnitudes:
                raise ValueError(f"{source}: DoRA on {name} is not read (the stock pipelines load a text "
                                 "encoder's LoRA only)")
            if part:  # files from other transformers versions may nest CLIP's layers otherwise
                loras[name] = {clip_module(m, family.text_parts[name].cls): lora for m, lora in part.items()}
    elif family.trainable_text_encoders:  # kohya names, in kohya and ComfyUI files
        with safe_open(str(source), framework="pt") as f:
            if not any(k.startswith(_text_prefixes(family, fmt)) for k in f.keys()):
                return {}  # the denoiser's LoRA alone (LoKr and LoHa files among them)
        named = read_original(source, _kohya_text_expect(family, expects))[0]
        for name, prefix in family.trainable_text_encoders.items():
            for key, lora in named.items():
                if not key.startswith(f"{prefix}_"):
                    continue
                module = module_of_kohya(key.removeprefix(f"{prefix}_"), family.text_parts[name].cls)
                if module is None:
                    raise ValueError(f"{source}: text-encoder layer {key} is not one kohya names (the encoder "
                                     "layers' self_attn q/k/v/out_proj and mlp fc1/fc2)")
                loras.setdefault(name, {})[module] = lora
    for name, part in loras.items():
        missing = sorted(m for m in part if expects[name](m) is None)
        if missing:
            raise ValueError(f"{source}: {len(missing)} module(s) do not exist in {name}, e.g. {missing[:3]}")
    return {name: adapter_from_loras(part) for name, part in loras.items()}
