"""``diffpipe init``: a commented config that works, from a folder of images and a model.

What it decides, and from what:
- the family: ``tiny:<family>`` names the offline tiny model; a local diffusers
  folder is recognised by its ``model_index.json`` ``_class_name``, matched
  against the registered families' own pipeline classes;
- the resolution: the family's usual training side, lowered (to a multiple of
  32) when the images are smaller; the aspect-ratio buckets: one square bucket
  when every image is square, else the nine classic ones;
- sample prompts: a few of the dataset's own captions (with the trigger word);
- LoRA settings: rank 16 and lr 1e-4 for published models, the demo's settings
  for the tiny ones; about 1,500 training samples in all;
- the memory ``diffpipe estimate`` gives for the result, as a comment; ``train.memory: auto`` when a CUDA GPU
  is detected (not for the tiny models: the planner sizes their published model).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml
from PIL import Image

from diffpipe import hub
from diffpipe.config import ConfigError, ModelConfig, ValidationConfig
from diffpipe.resolve import parse_config

#: Training side (pixels) a family's published models are usually trained at.
_USUAL_SIDE = {"sd": 512}
_DEFAULT_SIDE = 1024
_TINY_SIDE = 64  # the tiny models learn nothing at any size: keep their runs fast
#: Images read for sizes and captions (enough for a median; a large folder is not walked twice).
_SCAN_LIMIT = 2000
_SAMPLE_PROMPTS = 3


@dataclass
class Scan:
    """What the images in a dataset folder look like."""

    images: int
    sides: list[tuple[int, int]]  # (width, height) of the images read
    captions: list[str]  # first line of the first few caption files, in file order

    @property
    def all_square(self) -> bool:
        return all(w == h for w, h in self.sides)


def resolve_model(model: str, family: str | None = None) -> ModelConfig:
    """``tiny:<family>``, ``tiny`` (with ``family``), a local diffusers folder or a Hugging Face id -> the model section.

    An id is resolved like ``model.path`` (see :mod:`diffpipe.hub`): only its ``model_index.json`` is read here.
    """
    from diffpipe.families import family_names, pipeline_families  # deferred: imports torch (start-up time)

    if model == "tiny" or model.startswith("tiny:"):
        name = model.partition(":")[2] or family or "sd"
        if family and family != name:
            raise ConfigError(f"--model {model} names family {name!r} but --family is {family!r}; give one")
        if name not in family_names():
            raise ConfigError(f"--model {model}: unknown family {name!r}; choose from {', '.join(family_names())}")
        return ModelConfig(family=name, flavor="tiny")
    try:  # a missing, empty or incomplete folder, or a name that is no id: refused before any download
        if (folder := hub.local_model_folder(model, key="--model")) is not None:
            hub.check_complete(folder, model, key="--model")
    except ConfigError as err:
        raise ConfigError(f"{err} (or pass tiny:<family> for the offline tiny model)") from None
    index_file = hub.model_index(model)
    class_name = hub.pipeline_class(index_file)
    detected = pipeline_families().get(class_name) if class_name else None
    if class_name is not None and detected is None and family is None:
        raise ConfigError(f"{index_file}: pipeline {class_name!r} is not a family diffpipe trains; pass "
                          f"--family (one of {', '.join(family_names())}) if it is one of them")
    if class_name is None and family is None:
        raise ConfigError(f"--model {model}: {index_file} is missing, so the family cannot be detected; "
                          "pass a diffusers model folder, or --family")
    if family and detected and family != detected:
        raise ConfigError(f"--family {family}: the model {model} holds a {detected} model ({index_file})")
    name = family or detected
    if name not in family_names():
        raise ConfigError(f"--family {name}: unknown family; choose from {', '.join(family_names())}")
    return ModelConfig(family=name, flavor="local", path=model)


def scan_dataset(folder: str | Path, caption_ext: str = ".txt") -> Scan:
    """Image sizes (headers only) and a few captions from ``folder``, walked in name order."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"dataset folder {folder} does not exist or is not a folder")
    exts = set(ValidationConfig().image_exts)
    sides, captions, count = [], [], 0
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root) / name
            if path.suffix.lower() not in exts or name.startswith("."):
                continue
            count += 1
            if len(sides) < _SCAN_LIMIT:
                try:
                    with Image.open(path) as im:
                        sides.append(im.size)
                except (OSError, ValueError, Image.DecompressionBombError):
                    pass  # `diffpipe validate` names it; a scan only needs typical sizes
            caption = path.with_suffix(caption_ext)
            if len(captions) < _SAMPLE_PROMPTS and caption.is_file():
                line = next((x.strip() for x in caption.read_text(errors="replace").splitlines() if x.strip()), "")
                if line:
                    captions.append(line)
    if not count:
        raise ConfigError(f"dataset folder {folder} holds no images ({', '.join(sorted(exts))})")
    return Scan(count, sides, captions)


def choose_resolution(model: ModelConfig, scan: Scan) -> int:
    """The family's usual side, or less (a multiple of 32) when the images are smaller."""
    usual = _TINY_SIDE if model.flavor == "tiny" else _USUAL_SIDE.get(model.family, _DEFAULT_SIDE)
    if not scan.sides:
        return usual
    typical = math.sqrt(statistics.median(w * h for w, h in scan.sides))
    return max(32, min(usual, int(typical) // 32 * 32))


def _q(text: str) -> str:
    """A YAML scalar for ``text`` (JSON strings are YAML double-quoted scalars)."""
    return json.dumps(text, ensure_ascii=False)


#: Characters that end a line in YAML (and control characters): none may reach the comments and commands init writes.
_LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def _one_line(what: str, value: str | None) -> None:
    """Refuse a name with a line break: written into a comment, the rest of it would be live YAML."""
    if value is not None and _LINE_BREAKS.search(value):
        raise ConfigError(f"{what} {value!r} holds a line break or another control character, which the config "
                          "init writes cannot hold in its comments and commands; rename it")


def _estimate_comment(text: str) -> str:
    try:
        from diffpipe.estimate import estimate_memory  # deferred: imports torch (start-up time)

        cfg = parse_config(yaml.safe_load(text))
        table = estimate_memory(cfg).table()
    except Exception as err:  # an estimate is advice: its failure must not stop init
        table = f"not available here: {type(err).__name__}: {err}"
    return "".join(f"#   {line}\n" for line in table.splitlines())


def init_config(dataset: str | Path, model: str, *, family: str | None = None, trigger: str | None = None,
                output_dir: str | None = None, estimate: bool = True, name_of_file: str = "<this file>") -> str:
    """The text of a commented config for ``dataset`` and ``model`` (checked by parsing it)."""
    for what, value in (("dataset folder", str(dataset)), ("--model", model), ("--output-dir", output_dir),
                        ("--out", name_of_file)):
        _one_line(what, value)
    mcfg = resolve_model(model, family)
    scan = scan_dataset(dataset)
    dataset = str(dataset).rstrip("/") or "/"
    name = Path(dataset).resolve().name or "data"
    resolution = choose_resolution(mcfg, scan)
    tiny = mcfg.flavor == "tiny"
    prefix = f"{trigger}, " if trigger else ""
    prompts = [prefix + c for c in scan.captions] or [prefix + "a photo"]
    config = shlex.quote(name_of_file)  # commands to copy into a shell
    text = (
        f"# Written by `diffpipe init {shlex.quote(dataset)} --model {shlex.quote(model)}` for {scan.images} images.\n"
        f"# Run it:   diffpipe run -c {config}\n"
        "# Every key: docs/configuration.md, the config reference (or `diffpipe schema --markdown`).\n"
        f"# Check the machine against it: diffpipe doctor -c {config}\n"
        f"output_dir: {_q(output_dir or f'runs/{name}')}\n\n"
        f"model:\n{_model_lines(mcfg)}\n"
        f"datasets:\n{_dataset_lines(name, dataset, resolution, scan, prefix)}\n"
        "cache:\n"
        f"  shards: {min(8, max(1, scan.images // 500))}   # one cache job each; more shards, more jobs at once\n\n"
        f"train:\n{_train_lines(tiny, scan.images, None if tiny else detected_gpu())}\n"
        "export:\n"
        "  formats: [diffusers, comfyui]   # also: peft, kohya, merged\n\n"
        "sample:\n"
        "  prompts:   # a few of the dataset's own captions\n"
        + "".join(f"    - {_q(p)}\n" for p in prompts)
        + f"  width: {resolution}\n  height: {resolution}\n"
    )
    try:
        parse_config(yaml.safe_load(text), "the config diffpipe init wrote", base=Path.cwd())
    except ConfigError as err:
        raise ConfigError(f"{err}\n(choose another folder with --output-dir)") from None
    if estimate:
        sized = " (the tiny model is sized as its family's published one)" if tiny else ""
        text += (f"\n# GPU memory, from `diffpipe estimate -c {config}` (1 GPU){sized}:\n"
                 + _estimate_comment(text))
    return text


def _model_lines(mcfg: ModelConfig) -> str:
    """The ``model:`` section's lines: the tiny flavor, a Hugging Face id or a local folder."""
    if mcfg.flavor == "tiny":
        return (f"  family: {mcfg.family}\n  flavor: tiny        # random weights built offline: for trying the "
                "workflow, learns nothing useful\n")
    if hub.is_model_id(mcfg.path):
        return (f"  family: {mcfg.family}   # detected from the model's model_index.json\n"
                f"  path: {_q(mcfg.path)}   # Hugging Face id, read through the Hugging Face cache\n")
    return (f"  family: {mcfg.family}   # detected from {mcfg.path}/model_index.json\n  flavor: local\n"
            f"  path: {_q(mcfg.path)}\n")


def _dataset_lines(name: str, dataset: str, resolution: int, scan: Scan, prefix: str) -> str:
    """The one dataset's lines: its folder, the resolution and buckets its images suggest, the trigger word."""
    median = int(math.sqrt(statistics.median(w * h for w, h in scan.sides))) if scan.sides else "?"
    buckets = ("    aspect_ratios: [1.0]   # every image found is square\n" if scan.all_square else
               "    # aspect ratios: the nine classic buckets from 1:2 to 2:1 (images of other shapes found)\n")
    caption_line = (f"    caption_prefix: {_q(prefix)}   # trigger word put before every caption\n" if prefix else
                    '    # caption_prefix: "mytoken, "   # a trigger word put before every caption\n')
    return (f"  - name: {_q(name)}\n"
            f"    path: {_q(dataset)}\n"
            f"    resolution: {resolution}   # median image is about {median} px a side\n"
            f"{buckets}{caption_line}")


def detected_gpu() -> str | None:
    """The name of this machine's first CUDA GPU; None without one."""
    import torch  # deferred: init on a machine without a GPU need not wait for it (start-up time)

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _train_lines(tiny: bool, images: int, gpu: str | None = None) -> str:
    """The ``train:`` section's lines: about 1,500 samples seen (the tiny model: a quick try at a higher rate);
    ``memory: auto`` where a GPU was detected (``gpu``: its name)."""
    batch = 4 if tiny else 1
    steps_per_epoch = max(1, images)
    epochs = 20 if tiny else max(1, min(100, math.ceil(1500 / steps_per_epoch)))
    rank, lr = (8, 1e-3) if tiny else (16, 1e-4)
    return (f"  epochs: {epochs}   # about {epochs * steps_per_epoch} samples seen in all\n"
            f"  batch_size: {batch}\n"
            f"  lr: {lr}\n"
            "  lora:\n"
            f"    rank: {rank}\n"
            f"    alpha: {rank}\n"
            + (f"  memory: auto   # detected: {_LINE_BREAKS.sub(' ', gpu)}; memory keys left unset are planned for its "
               "free memory at train time (`diffpipe plan-memory -c CONFIG` shows the plan)\n" if gpu else ""))
