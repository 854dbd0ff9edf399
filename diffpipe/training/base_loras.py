"""Base LoRAs (``model.base_loras``): LoRAs folded into the frozen denoiser's weights as they are loaded,
and their text-encoder parts into the frozen text encoders (:func:`with_base_text`).

A training adapter that de-distills a few-step base, a speed LoRA, or a LoRA to train a second concept
over: the trained LoRA goes in on top of the folded weights, and the export leaves the base LoRAs out.
Each base LoRA file is first read into a PEFT adapter folder by ``diffpipe import-lora``'s reader, under the
run's ``base_loras/<content digest>`` (:func:`diffpipe.export.base_loras.prepare_base_loras`); this module
reads those folders and adds each module's update to its weight as the weight arrives: one layer's delta
in float32 at a time, added in float32 and stored back in the weight's dtype, before an 8- or 4-bit base is
quantised (never a float32 copy of the model). The update is PEFT's at ``scale``: LoRA
``scale * alpha / r * up @ down`` (rsLoRA: ``alpha / sqrt(r)``), LoKr ``scale * alpha / r * kron(w1, w2)``,
LoHa ``scale * alpha / r * (w1_a @ w1_b) * (w2_a @ w2_b)`` (each factor whole or ``_a @ _b``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffpipe.training.adapter import CONFIG_NAME, WEIGHTS_NAME, adapter_kind, load_adapter
from diffpipe.utils import digest, sha256_bytes, sha256_file

#: The run's folder of base LoRAs read into PEFT adapter folders, one per content digest.
FOLDER = "base_loras"
#: The header key of an exported LoRA file that holds the base LoRAs too (``export.include_base_loras``): their
#: paths and scales, as JSON. Samples then fold none into the model (they are in the file).
BASES_INCLUDED = "diffpipe.base_loras_included"
#: Key prefixes of a text encoder's LoRA in every file format import-lora reads (diffusers ``text_encoder.``,
#: ``text_encoder_2.``; kohya and ComfyUI ``lora_te_``, ``lora_te1_``, ``lora_te2_``).
TEXT_KEY_PREFIXES = ("text_encoder", "lora_te")


def source_digest(source: str | Path) -> str:
    """Digest of a base LoRA's content: the file's bytes, or a PEFT folder's config and weights (its text
    encoders' subfolders included, where it has them)."""
    source = Path(source)
    if source.is_dir():
        parts = [sha256_file(source / name) for name in (CONFIG_NAME, WEIGHTS_NAME) if (source / name).is_file()]
        parts += [sha256_file(f) for sub in _text_folders(source) for f in (sub / CONFIG_NAME, sub / WEIGHTS_NAME)
                  if f.is_file()]
        return sha256_bytes("\n".join(parts).encode())
    if not source.is_file():
        raise FileNotFoundError(f"model.base_loras: no such file {source}")
    return sha256_file(source)


def adapter_dir(run_root: str | Path, source: str | Path) -> Path:
    """Where the run keeps ``source`` read into a PEFT adapter folder (keyed by content, not path)."""
    return Path(run_root) / FOLDER / source_digest(source)[:16]


def _text_folders(folder: Path) -> list[Path]:
    return sorted(sub for sub in folder.glob("text_encoder*") if (sub / CONFIG_NAME).is_file())


def has_text_part(source: str | Path) -> bool:
    """Whether a base LoRA (a file in any format import-lora reads, or a PEFT folder) holds a text encoder's
    LoRA: read from the key names alone (a file's header), so a stage's digest can ask without reading it.
    A missing path has none (the stage that reads it says it is missing)."""
    from safetensors import safe_open  # deferred: the digests of every stage import this module

    source = Path(source)
    if source.is_dir():
        return bool(_text_folders(source))
    if not source.is_file():
        return False
    try:
        with safe_open(str(source), framework="pt") as f:
            return any(k.startswith(TEXT_KEY_PREFIXES) for k in f.keys())  # noqa: SIM118 (no __iter__)
    except Exception:  # noqa: BLE001 (any unreadable file): import-lora names the problem when a stage reads it
        return False


def _pattern(patterns: dict | None, module: str, default):
    # PEFT's rule: a pattern matches the module name or a dotted suffix of it.
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return value
    return default


def _factor(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    whole = t.get(name)
    return whole.float() if whole is not None else t[f"{name}_a"].float() @ t[f"{name}_b"].float()


@dataclass
class _Adapter:
    kind: str
    cfg: object
    scale: float
    tensors: dict[str, dict[str, torch.Tensor]]  # module -> leaf name -> tensor

    def delta(self, module: str, shape: tuple[int, ...]) -> torch.Tensor:
        t, cfg = self.tensors[module], self.cfg
        if self.kind == "lora":
            down, up = t["lora_A.weight"].float(), t["lora_B.weight"].float()
            rank = down.shape[0]
            alpha = float(_pattern(cfg.alpha_pattern, module, cfg.lora_alpha))
            s = alpha / (math.sqrt(rank) if cfg.use_rslora else rank)
            return (s * self.scale) * (up.flatten(1) @ down.flatten(1)).reshape(shape)
        if any(k.endswith("_t1") or k.endswith("_t2") for k in t):
            raise ValueError(f"model.base_loras: {module}: a {self.kind} with a Tucker core (conv 'effective "
                             "conv') is not folded; merge it into the model or convert it to a plain LoRA")
        r = _pattern(cfg.rank_pattern, module, cfg.r)
        alpha = float(_pattern(cfg.alpha_pattern, module, cfg.alpha))
        if self.kind == "loha":
            w = _factor(t, "hada_w1") * _factor(t, "hada_w2")
        else:
            w1, w2 = _factor(t, "lokr_w1"), _factor(t, "lokr_w2")
            w = torch.kron(w1[:, :, None, None] if w2.ndim == 4 else w1, w2)
        return (alpha / r * self.scale) * w.reshape(shape)


def _by_module(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in sd.items():
        match = re.match(r"(.*)\.(lora_[AB]\.weight|lora_magnitude_vector|(?:lokr|hada)_\w+)$", key)
        if match is None:
            raise ValueError(f"model.base_loras: {key} is no LoRA, LoKr or LoHa tensor")
        out.setdefault(match.group(1), {})[match.group(2)] = value
    return out


@dataclass
class BaseDeltas:
    """The base LoRAs of a run, ready to fold module by module (:meth:`fold`)."""

    adapters: list[_Adapter] = field(default_factory=list)
    folded: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, folders: list[tuple[Path, float]]) -> BaseDeltas:
        """Adapter folders (as ``import-lora`` writes them) with the scale each is folded at."""
        adapters = []
        for folder, scale in folders:
            sd, cfg = load_adapter(folder)
            kind = adapter_kind(cfg)
            if kind not in ("lora", "lokr", "loha") or any(k.endswith("lora_magnitude_vector") for k in sd):
                raise ValueError(f"model.base_loras: {folder}: a {kind} LoRA (DoRA included) is not folded; "
                                 "plain LoRA, LoKr and LoHa are")
            adapters.append(_Adapter(kind, cfg, float(scale), _by_module(sd)))
        return cls(adapters)

    @property
    def modules(self) -> set[str]:
        return {m for a in self.adapters for m in a.tensors}

    def fold(self, name: str, module: torch.nn.Module) -> None:
        """Add every base LoRA's update of module ``name`` to its weight (nothing for other modules)."""
        parts = [a for a in self.adapters if name in a.tensors]
        if not parts:
            return
        weight = module.weight
        with torch.no_grad():
            total = weight.detach().float()  # one layer in float32, never the model
            for a in parts:
                total += a.delta(name, tuple(weight.shape))
            weight.data = total.to(weight.dtype)
        self.folded.add(name)

    def fold_all(self, model: torch.nn.Module) -> None:
        """Fold into a model loaded whole, module by module, then :meth:`check`."""
        for name, module in model.named_modules():
            self.fold(name, module)
        self.check()

    def check(self, model: str = "the denoiser") -> None:
        """Every module a base LoRA updates was folded: one that names no module of the model is an error."""
        missing = sorted(self.modules - self.folded)
        if missing:
            raise ValueError(f"model.base_loras: {len(missing)} module(s) are not in {model}, e.g. "
                             f"{missing[:3]}; is the LoRA for this model?")


@dataclass
class _TextFold:
    """One text encoder's part of the base LoRAs, folded into it whole as it is loaded (an encoder is a few GB
    at most: it is loaded whole anyway)."""

    name: str
    deltas: BaseDeltas

    def fold_all(self, module: torch.nn.Module) -> None:
        self.deltas.folded.clear()  # each load of the encoder is folded afresh
        for name, sub in module.named_modules():
            self.deltas.fold(name, sub)
        self.deltas.check(f"text encoder {self.name}")


def text_identity(folders: list[tuple[Path, float]]) -> str:
    """The base LoRAs' part of the text cache key: each one with a text-encoder part, by its content digest
    (its run folder's name), scale and encoders; "" when none has one (a denoiser-only base LoRA leaves the
    text caches alone)."""
    parts = [[folder.name, float(scale), [sub.name for sub in _text_folders(folder)]]
             for folder, scale in folders if _text_folders(folder)]
    return digest(parts)[:16] if parts else ""


def with_base_text(family, folders: list[tuple[Path, float]]):
    """``family`` (a :class:`~diffpipe.models.base.Family`) folding the text-encoder parts of the base LoRAs
    read into ``folders`` (``(adapter folder, scale)``) into each text encoder it loads, its text cache key
    following them; unchanged when none has a text-encoder part."""
    by_encoder: dict[str, list[tuple[Path, float]]] = {}
    for folder, scale in folders:
        for sub in _text_folders(folder):
            by_encoder.setdefault(sub.name, []).append((sub, scale))
    if not by_encoder:
        return family
    folds = {name: _TextFold(name, BaseDeltas.read(parts)) for name, parts in by_encoder.items()}
    return family.with_base_text(folds, text_identity(folders))


def holds_bases(lora: str | Path) -> bool:
    """Whether an exported LoRA (a file, or a PEFT folder) holds its base LoRAs (:data:`BASES_INCLUDED`)."""
    from safetensors import safe_open  # deferred: the digests of every stage import this module

    lora = Path(lora)
    file = lora / WEIGHTS_NAME if lora.is_dir() else lora
    if not file.is_file():
        return False
    with safe_open(str(file), framework="pt") as f:
        return BASES_INCLUDED in (f.metadata() or {})
