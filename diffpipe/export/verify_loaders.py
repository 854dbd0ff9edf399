"""The verify step's readers that load into models: diffusers' LoRA loaders and PEFT's.

Each loads a file into a freshly built denoiser or text encoder (no base weights: the tiny flavor's,
or a local model's config on the meta device, ``low_cpu_mem_usage`` so LoRA tensors are assigned,
not copied into meta tensors), then reads back which modules hold the adapter and at which strength.
"""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file

from diffpipe.export.comfy_rules import clip_diffusers_lora_keys
from diffpipe.export.convert import Lora
from diffpipe.export.verify_checks import FileCheck, applied, differs, lora_applied, probe
from diffpipe.families import spec
from diffpipe.models.base import Family
from diffpipe.training.adapter import PEFT_PREFIX, WEIGHTS_NAME

#: The adapter name verification loads under (never a name a user's pipeline holds: the models are ours).
ADAPTER = "diffpipe_verify"


def text_model(family: Family, name: str) -> torch.nn.Module:
    """Text encoder ``name``: the tiny flavor's, or a local model's config built on the meta device."""
    if family.cfg.flavor == "tiny":
        return getattr(family.load_text_encoders(only=[name]), name)
    cls = family.text_parts[name].cls
    config = cls.config_class.from_pretrained(family.cfg.path, subfolder=name)
    with torch.device("meta"):
        return cls(config)


def _adapter_layers(model: torch.nn.Module) -> dict[str, BaseTunerLayer]:
    """Modules holding the verify adapter, by path in the bare model."""
    return {name.removeprefix(PEFT_PREFIX): m for name, m in model.named_modules()
            if isinstance(m, BaseTunerLayer) and any(ADAPTER in getattr(m, n, {}) for n in m.adapter_layer_names)}


def _compare(check: FileCheck, label: str, layers: dict[str, BaseTunerLayer], want: dict[str, Lora] | None,
             tensors: dict[str, torch.Tensor], magnitudes: dict[str, torch.Tensor] | None = None) -> None:
    """Placed layers against the trained LoRAs, each at the trained strength (DoRA: its magnitudes too).

    The reader decided where each module goes and at which scale (``scaling``); the matrices are the
    file's as the reader keyed them (``tensors``: keys relative to the model), because PEFT moves a
    layer's LoRA weights to its base layer's device, and a base built on the meta device keeps no values.
    """
    if want is None:  # LoKr / LoHa: placement only
        return
    check.keys("trained module(s) missing from the file", {label + m for m in set(want) - set(layers)})
    off, partial = [], []
    for name, m in layers.items():
        if name not in want or not hasattr(m, "scaling"):
            continue
        down, up = tensors.get(f"{name}.lora_A.weight"), tensors.get(f"{name}.lora_B.weight")
        if down is None or up is None:
            partial.append(label + name)
            continue
        x = probe(want[name].down.flatten(1).shape[1])
        magnitude = tensors.get(f"{name}.lora_magnitude_vector", tensors.get(f"{name}.lora_magnitude_vector.weight"))
        if differs(applied(down, up, m.scaling[ADAPTER], x), lora_applied(want[name], x)) or _magnitude_differs(
                magnitude, (magnitudes or {}).get(name)):
            off.append(label + name)
    check.keys("LoRA layer(s) lacking lora_A or lora_B in the file", partial)
    check.keys("layer(s) at another strength than trained", off)


def _magnitude_differs(loaded: torch.Tensor | None, trained: torch.Tensor | None) -> bool:
    if trained is None or loaded is None:
        return (trained is None) != (loaded is None)  # a DoRA magnitude lost, or one nobody trained
    return differs(loaded.double().flatten(), trained.double().flatten())


def _file_modules(state: dict[str, torch.Tensor], prefix: str) -> set[str]:
    return {k.removeprefix(prefix).split(".lora_")[0] for k in state if k.startswith(prefix) and ".lora_" in k}


def check_diffusers(file: Path, family: Family, denoiser: torch.nn.Module, trained: dict[str, Lora] | None,
                    text: dict[str, dict[str, Lora]], magnitudes: dict[str, torch.Tensor] | None = None) -> FileCheck:
    """The diffusers file as the stock pipeline reads it: its class's ``lora_state_dict``, then ``denoiser``'s
    ``load_lora_adapter`` and the loader's ``load_lora_into_text_encoder`` (``text``: the trained encoders)."""
    loader = family.lora_writer or family.pipeline_class
    check = FileCheck(file, "diffusers", "diffusers lora_state_dict + load_lora_adapter")
    out = loader.lora_state_dict(str(file), return_lora_metadata=True)
    state, metadata = out[0], out[-1]
    names = [family.denoiser_name, *text]
    check.keys("tensor(s) for no component of the pipeline",
               {k for k in state if not k.startswith(tuple(f"{n}." for n in names))})
    models = {family.denoiser_name: denoiser, **{n: text_model(family, n) for n in text}}
    for name, model in models.items():
        is_text = name != family.denoiser_name
        _load_diffusers(check, loader, model, name, state, metadata, text[name] if is_text else trained,
                        None if is_text else magnitudes, is_text=is_text)
    _check_comfy_clip(check, family, state, models)
    return check


def _load_diffusers(check: FileCheck, loader, model: torch.nn.Module, name: str, state, metadata,
                    want: dict[str, Lora] | None, magnitudes: dict[str, torch.Tensor] | None, *, is_text: bool) -> None:
    prefix = f"{name}."
    tensors = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    if is_text and not hasattr(model, "text_model"):  # diffusers strips CLIP's transformers-4 root there
        tensors = {k.removeprefix("text_model."): v for k, v in tensors.items()}
    in_file = _file_modules(tensors, "")
    if not in_file:
        check.keys(f"trained module(s) of {name} missing from the file", {prefix + m for m in (want or {})})
        return
    try:
        if is_text:
            loader.load_lora_into_text_encoder(state, network_alphas=None, text_encoder=model, prefix=name,
                                               adapter_name=ADAPTER, metadata=metadata, low_cpu_mem_usage=True)
        else:
            model.load_lora_adapter(state, prefix=name, adapter_name=ADAPTER, metadata=metadata,
                                    low_cpu_mem_usage=True)
    except Exception as err:  # noqa: BLE001 - whatever the reader raises is the finding, reported with the file
        check.problems.append(f"{name}: diffusers could not load it ({type(err).__name__}: {err})")
        return
    layers = _adapter_layers(model)
    check.keys("tensor name(s) diffusers placed on no module", {prefix + m for m in in_file - set(layers)})
    check.placed += len(in_file & set(layers))
    _compare(check, prefix, layers, want, tensors, magnitudes)


def _check_comfy_clip(check: FileCheck, family: Family, state, models: dict[str, torch.nn.Module]) -> None:
    """Where ComfyUI reads this family's diffusers file, its CLIP names must be ones ComfyUI maps
    (``text_encoder.text_model.encoder.layers.N...``): it drops the others with only a log line."""
    if spec(family.name).comfy_reads_diffusers not in ("all", "part"):
        return
    clip = {n: m.config.num_hidden_layers for n, m in models.items()
            if n != family.denoiser_name and type(m).__name__.startswith("CLIP")}
    known = clip_diffusers_lora_keys(clip)
    in_file = {f"{n}.{m}" for n in clip for m in _file_modules(state, f"{n}.")}
    check.keys("text-encoder layer(s) ComfyUI's diffusers mapping drops", in_file - set(known))


def check_peft(folder: Path, model: torch.nn.Module, want: dict[str, Lora] | None,
               magnitudes: dict[str, torch.Tensor] | None = None, check: FileCheck | None = None,
               label: str = "") -> FileCheck:
    """A PEFT folder as PEFT loads it: its config, then ``set_peft_model_state_dict`` into ``model``."""
    check = check or FileCheck(folder, "peft", "PEFT set_peft_model_state_dict")
    try:
        config = peft.PeftConfig.from_pretrained(str(folder))
        wrapped = peft.PeftModel(model, config, adapter_name=ADAPTER, low_cpu_mem_usage=True)
        tensors = load_file(str(folder / WEIGHTS_NAME))
        result = peft.set_peft_model_state_dict(wrapped, tensors, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    except Exception as err:  # noqa: BLE001 - whatever the reader raises is the finding, reported with the file
        check.problems.append(f"{label or 'denoiser'}: PEFT could not load it ({type(err).__name__}: {err})")
        return check
    check.keys("tensor(s) PEFT found no place for", {label + k for k in result.unexpected_keys})
    check.keys("adapter tensor(s) PEFT expected and the file lacks",
               {label + k for k in result.missing_keys if f".{ADAPTER}" in k})
    layers = _adapter_layers(wrapped)
    check.placed += len(layers)
    _compare(check, label, layers, want, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()}, magnitudes)
    return check
