"""Sample images (or clips) from the stock diffusers pipeline with an exported LoRA loaded.

Video families' samples are MP4 files (H.264 when the installed PyAV has it,
else MPEG-4 Part 2) at the family's frame rate; the grid shows first frames.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from diffusers.hooks import apply_group_offloading
from PIL import Image

from diffpipe.config import ModelConfig, SampleConfig
from diffpipe.data.cache.video import write_mp4
from diffpipe.data.dataset.media import DEFAULT_MAX_PIXELS, decoded_frames, open_image, open_video
from diffpipe.families import get_family
from diffpipe.families.sampling import resolve_sample
from diffpipe.models._common import cuda_defaults
from diffpipe.paths import EXPORT_NAMES, export_name
from diffpipe.training.adapter import WEIGHTS_NAME, apply_adapter
from diffpipe.training.base_loras import BaseDeltas, holds_bases, with_base_text
from diffpipe.training.finite import check_safetensors_file
from diffpipe.training.plots import caption_grid
from diffpipe.utils import atomic_path


def _render(pipe, family, cfg: SampleConfig, kwargs: dict) -> list[list[Image.Image]]:
    """The frames of every prompt's sample (one frame for images), each from the same seed.

    ``sample.images``: each prompt's conditioning image, passed as the family's
    ``sample_image_arg``; ``sample.last_images``: its last frame (``last_image``);
    ``sample.videos``: its input clip (``video``, a list of frames).
    """
    for i, image in enumerate(cfg.images or []):
        if isinstance(image, list) and len(image) > family.max_references:
            raise ValueError(f"sample.images[{i}]: {len(image)} images for one prompt; {family.name} takes at most "
                             f"{family.max_references} (several are for Qwen-Image-Edit `variant: 2509 | 2511` and flux2 / flux2-klein `variant: edit`)")
    if cfg.videos and not family.continues_video:
        raise ValueError(f"sample.videos: {family.name} samples do not continue a clip (SkyReels V2 df-v2v's do)")
    out = []
    for i, prompt in enumerate(cfg.prompts):
        gen = torch.Generator().manual_seed(cfg.seed)
        extra = {family.sample_image_arg: _open_image(cfg.images[i])} if cfg.images else {}
        if cfg.last_images:
            extra["last_image"] = _open_image(cfg.last_images[i])
        if cfg.videos:
            extra["video"] = _open_video(cfg.videos[i])
        result = pipe(prompt=prompt, generator=gen, **kwargs, **extra)  # by name: edit pipelines take `image` first
        if family.is_video:
            out.append(list(result.frames[0]))
        else:  # Kandinsky5T2IPipeline's output names its list ``image``
            out.append([(result.images if hasattr(result, "images") else result.image)[0]])
    return out


def _open_image(path: str | list[str]) -> Image.Image | list[Image.Image]:
    # The same header check as validation: a sample image is user input too (a decompression bomb).
    if isinstance(path, list):  # a prompt's several reference images
        return [_open_image(p) for p in path]
    try:
        with open_image(path, DEFAULT_MAX_PIXELS) as img:
            return img.convert("RGB")
    except OSError as err:
        raise ValueError(f"sample: cannot read the image {path}: {err}") from err


def _open_video(path: str) -> list[Image.Image]:
    """A sample's input clip as RGB frames (the header checked like a dataset clip's)."""
    try:
        with open_video(path, DEFAULT_MAX_PIXELS) as (container, stream):
            return [f.to_image().convert("RGB") for f in decoded_frames(container, stream, DEFAULT_MAX_PIXELS)]
    except (OSError, ValueError) as err:
        raise ValueError(f"sample: cannot read the clip {path}: {err}") from err


def _save(sample: list[Image.Image], stem: Path, family) -> None:
    if family.is_video:
        write_mp4(sample, stem.with_suffix(".mp4"), family.fps)
    else:
        sample[0].save(stem.with_suffix(".png"))


def render_samples(model_cfg: ModelConfig, cfg: SampleConfig, lora_file: str | Path, out_dir: str | Path, *,
                   base_loras: list[tuple[Path, float]] | None = None) -> list[Path]:
    """Render every prompt with and without the LoRA (same seed) and save PNGs (MP4s) plus a grid.

    ``base_loras``: ``(adapter folder, scale)`` of ``model.base_loras``, folded into the denoiser and the text
    encoders first, unless ``lora_file`` holds them already (``export.include_base_loras``: then the top row is
    the model without any LoRA).

    The grid's top row is the base model, the bottom row the LoRA (first
    frames for video): a quick look at what training changed. ``out_dir`` is written
    whole: a folder diffpipe wrote before is replaced, any other non-empty one is
    refused (see :func:`diffpipe.utils.atomic_path`). A run that trained several
    parts (Wan 2.2 A14B, ``model.expert: both``) loads each part's file, found
    beside ``lora_file`` by its export name.
    """
    family = get_family(model_cfg)
    cfg = resolve_sample(family, cfg)  # null steps / guidance scale: the model's defaults
    out_dir = Path(out_dir)
    _check_finite(family, Path(lora_file))  # before minutes of loading and rendering the base model
    # Entered first: a folder of the user's is refused before minutes of rendering.
    with atomic_path(out_dir, is_dir=True) as tmp:
        family, pipe = sample_pipeline(model_cfg, lora_file, base_loras)
        pipe.set_progress_bar_config(disable=True)
        place(pipe, cfg.offload)
        kwargs = family.sample_kwargs(cfg)
        base = _render(pipe, family, cfg, kwargs)
        if Path(lora_file).is_dir():  # a PEFT folder: LoKr and LoHa, which load_lora_weights cannot read
            if len(family.denoiser_parts) > 1:
                raise ValueError(f"sample: {lora_file} is one PEFT folder; a run with several trained parts "
                                 "samples from its diffusers files")
            apply_adapter(getattr(pipe, family.denoiser_attr), lora_file)
        else:
            for file, load_kwargs in _part_files(family, Path(lora_file)):
                family.load_lora(pipe, file, **load_kwargs)  # each into its expert, if several
        tuned = _render(pipe, family, cfg, kwargs)
        for i, sample in enumerate(tuned):
            _save(sample, tmp / f"sample-{i:02d}", family)
        _grid([b[0] for b in base], [t[0] for t in tuned], cfg.prompts).save(tmp / "grid.png")
    return sorted(p for p in out_dir.iterdir() if p.suffix in (".png", ".mp4"))


def sample_pipeline(model_cfg: ModelConfig, lora_file: str | Path,
                    base_loras: list[tuple[Path, float]] | None = None) -> tuple[Any, Any]:
    """The family and the stock pipeline both rows of the samples render from, before ``lora_file`` loads: the
    base LoRAs (``(adapter folder, scale)``) folded into its denoiser and text encoders, the base the LoRA was
    trained over; none when ``lora_file`` holds them already (``export.include_base_loras``)."""
    if base_loras and holds_bases(lora_file):  # the file brings them itself: folding them too would double them
        base_loras = None
    family = with_base_text(get_family(model_cfg), base_loras or [])
    pipe = family.load_pipeline()
    if base_loras:
        BaseDeltas.read(base_loras).fold_all(getattr(pipe, family.denoiser_attr))
    return family, pipe


#: ``sample.offload: auto`` keeps every weight on the GPU below this share of its free memory (the rest is
#: for activations: a video's attention, the VAE's decode).
AUTO_OFFLOAD_SHARE = 0.8


def place(pipe, offload: str, *, device: torch.device | None = None, keep: Collection[str] = ()) -> str:
    """Put the pipeline's components where they sample (``sample.offload``), except the ones named in
    ``keep`` (the training sampler's trained modules, which training placed); returns the placement used
    (``none`` or ``group``). ``device``: the GPU when there is one, else the CPU. ``none``: each component
    on ``device``; ``group``: its weights in CPU memory, each block brought to ``device`` for its forward
    (diffusers' group offloading; on the CPU the hooks onload to the CPU)."""
    cuda_defaults()
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modules = {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module) and name not in keep}
    if offload == "auto":
        weights = sum(t.nbytes for c in modules.values() for t in [*c.parameters(), *c.buffers()])
        fits = device.type != "cuda" or weights < AUTO_OFFLOAD_SHARE * torch.cuda.mem_get_info(device)[0]
        offload = "none" if fits else "group"
    for module in modules.values():
        if offload == "group":
            group = {"onload_device": device, "offload_type": "block_level", "num_blocks_per_group": 1}
            if hasattr(module, "enable_group_offload"):  # a diffusers model
                module.enable_group_offload(**group)
            else:
                apply_group_offloading(module, **group)
        else:
            module.to(device)
    return offload


def _check_finite(family, lora_file: Path) -> None:
    """Refuse a LoRA holding NaN or inf values (a diverged training), naming its tensors."""
    if lora_file.is_dir():
        files = [lora_file / WEIGHTS_NAME, *sorted(lora_file.glob(f"text_encoder*/{WEIGHTS_NAME}"))]
    elif lora_file.is_file():
        files = [file for file, _ in _part_files(family, lora_file)]
    else:
        return  # the loaders name a missing file
    for file in files:
        if file.is_file():
            check_safetensors_file(file, what="sample")


def _part_files(family, lora_file: Path) -> list[tuple[Path, dict]]:
    """Each trained part's diffusers file and ``load_lora_weights`` arguments; the first is ``lora_file``."""
    parts = family.denoiser_parts
    out = [(lora_file, parts[0].load_kwargs)]
    for part in parts[1:]:
        # pytorch_lora_weights.safetensors -> pytorch_lora_weights_low_noise.safetensors (any other name alike)
        name = (export_name("diffusers", part.suffix) if lora_file.name == EXPORT_NAMES["diffusers"]
                else f"{lora_file.stem}{part.suffix}{lora_file.suffix}")
        file = lora_file.with_name(name)
        if not file.is_file():
            raise FileNotFoundError(f"sample: the {part.label or part.attr} LoRA {file} is missing (export writes "
                                    f"it beside {lora_file.name}); run `diffpipe export` again")
        out.append((file, part.load_kwargs))
    return out


def _grid(base: list[Image.Image], tuned: list[Image.Image], prompts: list[str]) -> Image.Image:
    """The base model's image above the LoRA's for every prompt, the prompt under its column."""
    return caption_grid([("base model (no LoRA)", base), ("with the LoRA", tuned)], prompts)


class TrainingSampler:
    """Renders the sample prompts from the in-training weights (rank 0, ZeRO below 3).

    The stock pipeline is built once with the training denoiser swapped in, so
    what it renders is exactly the current weights, LoRA included. Global RNG
    state is saved and restored around it, so sampling never changes training.
    """

    def __init__(self, family, cfg: SampleConfig, denoiser: torch.nn.Module, out_dir: Path, *,
                 text_encoders: dict[str, torch.nn.Module] | None = None):
        # Null steps / guidance scale: the model's defaults, as `diffpipe sample` resolves them.
        self.family, self.cfg, self.denoiser, self.out_dir = family, resolve_sample(family, cfg), denoiser, Path(out_dir)
        self.text_encoders = text_encoders or {}  # trained beside the denoiser: swapped in as well
        self._pipe = None

    def _pipeline(self):
        if self._pipe is None:
            pipe = self.family.load_pipeline()
            parts = [p.attr for p in self.family.denoiser_parts]
            for attr in parts:  # several parts: the trained module holds each under its pipeline name
                setattr(pipe, attr, getattr(self.denoiser, attr) if len(parts) > 1 else self.denoiser)
            for name, encoder in self.text_encoders.items():
                setattr(pipe, name, encoder)
            # The frozen components join the training device, or stay in CPU memory with group offloading
            # when they would not fit beside training (sample.offload).
            place(pipe, self.cfg.offload, device=next(self.denoiser.parameters()).device,
                  keep=[*parts, *self.text_encoders])
            pipe.set_progress_bar_config(disable=True)
            self._pipe = pipe
        return self._pipe

    def __call__(self, step: int) -> tuple[Path, Image.Image]:
        """Render every prompt (fixed seed) and save one row as ``step-NNNNNN.png``."""
        trained = [self.denoiser, *self.text_encoders.values()]
        was_training = [m.training for m in trained]
        rng = torch.get_rng_state()
        for m in trained:
            m.eval()
        try:
            with torch.no_grad():
                samples = _render(self._pipeline(), self.family, self.cfg, self.family.sample_kwargs(self.cfg))
        finally:
            for m, flag in zip(trained, was_training, strict=True):
                m.train(flag)
            torch.set_rng_state(rng)
        images = [s[0] for s in samples]  # first frames of clips
        if self.family.is_video:
            for i, clip in enumerate(samples):
                out = self.out_dir / f"step-{step:06d}-{i:02d}.mp4"
                with atomic_path(out) as tmp:
                    write_mp4(clip, tmp, self.family.fps)
        w, h = images[0].size
        row = Image.new("RGB", (w * len(images), h), "white")
        for i, img in enumerate(images):
            row.paste(img, (i * w, 0))
        out = self.out_dir / f"step-{step:06d}.png"
        with atomic_path(out) as tmp:
            row.save(tmp, format="PNG")
        return out, row
