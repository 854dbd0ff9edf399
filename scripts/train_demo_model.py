"""Train the demo's small SD-style model from synthetic shapes and save it as a diffusers folder.

Run it (21 minutes on one thread of a 2-core x86-64 CPU machine shared with other jobs, load average 1-3;
4,000 VAE steps, then 6,000 denoiser steps):

    OMP_NUM_THREADS=1 python scripts/train_demo_model.py --out config/demo_model

The weights shipped in config/demo_model come from this command (written to a scratch folder, then
copied). scripts/check_demo_model.py on them: the background colour follows the prompt in 0.995 of
border pixels and the shape colour in 0.604 of shape pixels (chance about 0.17 each; the earlier
factor-8 version of this recipe: 0.815 and 0.347; the epsilon-prediction model before it: 0.254 and 0.237).
The demo's learning check passes on them (tests/demo_learning.py, config/demo.yaml's settings: the
share of the six prompts' samples drawn in the prompt's shape colour is 0.052 for the base, 0.152 with
the LoRA, 0.293 in the training images: a gain of 0.099 against the 0.05 it asks for).

The base model learns to draw *small* shapes (a side of 12 to 20 pixels of 64): circles, squares and
triangles in six colours on six backgrounds, captioned as the demo's images are ("a red circle on a
blue background"). The demo's 16 training images (config/demo_data) hold *large* shapes (26 to 48
pixels), so a LoRA trained on them has something to learn that the base does not already do; the
demo workflow test measures it (tests/demo_learning.py). ``scripts/check_demo_model.py`` measures
whether the samples follow their prompts.

Three parts, each from a fixed seed, so the same command on the same machine writes the same weights:
1. the VAE (``AutoencoderKL``, factor 4: 64 px -> 16x16x4 latents) as an autoencoder on the images;
2. the scaling factor, 1 / std of the latents' modes (what the pipeline divides by before decoding);
3. the UNet and a CLIP text encoder (the tiny flavor's sizes; the tokenizer is the tiny CLIP one plus
   merges that make every caption word a single token, :func:`demo_tokenizer`) together as a conditional DDPM
   (v-prediction on SD 1.x betas rescaled to zero terminal SNR, sampled with trailing DDIM steps;
   10 % empty captions so guidance works; learning rate warmed up, then cosine-decayed), with an
   exponential moving average of the weights, which is what is saved. With SD's own betas and epsilon
   prediction the samples ignored their prompts (background colour right in 25 % of samples, chance
   17 %): the last training step still shows the image, so the prompt was never needed to choose it.

The weights are made by this script from synthetic data only (no downloaded data or weights); they are
distributed under the project's licence, Apache-2.0 (pyproject.toml).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from PIL import Image, ImageDraw
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from diffpipe.data.dataset.demo import COLORS, SHAPES
from diffpipe.families.sd.flavors import TINY_SCHEDULER, TINY_UNET
from diffpipe.models import tiny
from diffpipe.models._common import TINY_CLIP
from diffpipe.models.tokenizers import BOS, CLIP_MAX_LENGTH, EOS, clip_vocab_and_merges

SIZE = 64
BASE_SIDES = (12, 20)  # the base model's shapes; the demo images' are 26..48 px (demo_item)
VAE_SIDES = (8, 56)  # the VAE learns every size, so it also encodes the demo images' large shapes
# Factor 4 (64 px -> 16x16x4 latents), narrow: the model is trained on one shared CPU core. At factor 8
# a 12-20 px shape covered about two latent pixels, and the samples' shape colour followed the prompt in
# only a third of them; three levels (8, 16, 32 channels) give it six to twenty-five.
VAE = {**tiny.kl_vae(levels=4), "block_out_channels": (8, 16, 32),
       "down_block_types": ("DownEncoderBlock2D",) * 3, "up_block_types": ("UpDecoderBlock2D",) * 3}
UNET = {**TINY_UNET, "sample_size": SIZE // 4}
CROP = 32  # the VAE is convolutional: it learns on 32 px crops, a quarter of the work
# v-prediction on betas rescaled to zero terminal SNR, sampled from the last step (Lin et al. 2024): with
# SD's own betas the last step keeps ~7 % of the image, so training never asks the model to choose a
# background colour from the prompt, and samples started from pure noise ignored it.
SCHEDULER = {**TINY_SCHEDULER, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True,
             "timestep_spacing": "trailing"}


def base_item(rng: random.Random, sides: tuple[int, int] = BASE_SIDES) -> tuple[np.ndarray, str]:
    """One image (uint8 HWC) and its caption: a shape (side in ``sides``) of one colour on another."""
    shape = rng.choice(SHAPES)
    fg = rng.choice(list(COLORS))
    bg = rng.choice([c for c in COLORS if c != fg])
    img = Image.new("RGB", (SIZE, SIZE), COLORS[bg])
    side = rng.randint(*sides)
    x0, y0 = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    box = (x0, y0, x0 + side - 1, y0 + side - 1)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse(box, fill=COLORS[fg])
    elif shape == "square":
        draw.rectangle(box, fill=COLORS[fg])
    else:
        draw.polygon([((box[0] + box[2]) // 2, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLORS[fg])
    return np.asarray(img), f"a {fg} {shape} on a {bg} background"


def base_dataset(n: int, seed: int, sides: tuple[int, int] = BASE_SIDES) -> tuple[torch.Tensor, list[str]]:
    """``n`` images as ``[n,3,64,64]`` in [-1,1] and their captions."""
    rng = random.Random(seed)
    items = [base_item(rng, sides) for _ in range(n)]
    pixels = torch.from_numpy(np.stack([a for a, _ in items])).permute(0, 3, 1, 2).float() / 127.5 - 1
    return pixels, [c for _, c in items]


def train_vae(pixels: torch.Tensor, steps: int, seed: int, log) -> AutoencoderKL:
    """The VAE as an autoencoder on random crops: L1 + MSE reconstruction, a small KL term (as SD's VAE)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(**VAE)
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    for step in range(1, steps + 1):
        i, j = torch.randint(SIZE - CROP + 1, (2,), generator=g).tolist()
        x = pixels[torch.randint(len(pixels), (8,), generator=g), :, i:i + CROP, j:j + CROP]
        dist = vae.encode(x).latent_dist
        rec = vae.decode(dist.sample(generator=g)).sample
        loss = F.l1_loss(rec, x) + F.mse_loss(rec, x) + 1e-6 * dist.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for group in opt.param_groups:  # cosine decay to a tenth
            group["lr"] = 2e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        if step % 50 == 0 or step == steps:
            log(f"vae step {step}/{steps} loss {loss.item():.4f}")
    return vae.eval()


@torch.no_grad()
def encode_all(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """The latents' modes (unscaled; what the demo's latent cache stores), in batches."""
    return torch.cat([vae.encode(pixels[i:i + 256]).latent_dist.mode() for i in range(0, len(pixels), 256)])


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """``word``'s pieces under the merges ``ranks`` (lowest rank first), as CLIP's BPE splits it."""
    pieces = [*word[:-1], word[-1] + "</w>"]
    while len(pieces) > 1:
        pairs = [(ranks.get(p, math.inf), i) for i, p in enumerate(zip(pieces, pieces[1:], strict=False))]
        rank, i = min(pairs)
        if rank == math.inf:
            break
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def demo_tokenizer(folder: Path) -> CLIPTokenizer:
    """The tiny CLIP tokenizer plus merges that make every caption word one token.

    The shared tokenizer splits most colour and shape words into characters ("yellow": six tokens), and
    the tiny text encoder then has to spell before it can tell colours apart. Merges are appended, so
    the words the shared tokenizer already has keep their ids; each new merge joins a word's first two
    pieces until it is one. Written to ``folder`` (vocab.json, merges.txt); saved with the model.
    """
    vocab, merges = clip_vocab_and_merges()
    tokens = [t for t in vocab if t not in (BOS, EOS)]
    words = ["a", "on", "background", *SHAPES, *COLORS]
    for word in words:
        while len(pieces := _bpe(word, {m: r for r, m in enumerate(merges)})) > 1:
            merges.append((pieces[0], pieces[1]))
            if pieces[0] + pieces[1] not in tokens:  # a merge the shared list has, outranked there
                tokens.append(pieces[0] + pieces[1])
    folder.mkdir(parents=True, exist_ok=True)
    vocab_json = {t: i for i, t in enumerate([*tokens, BOS, EOS])}
    (folder / "vocab.json").write_text(json.dumps(vocab_json, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer.from_pretrained(str(folder), model_max_length=CLIP_MAX_LENGTH)
    for word in words:  # the real tokenizer agrees with _bpe
        if len(tokenizer.tokenize(word)) != 1:
            raise SystemExit(f"demo tokenizer splits {word!r}: {tokenizer.tokenize(word)}")
    return tokenizer


def text_encoder(tokenizer, seed: int) -> CLIPTextModel:
    """A CLIP text encoder of the tiny flavor's size, its special ids matching ``tokenizer``."""
    torch.manual_seed(seed)
    config = CLIPTextConfig(**TINY_CLIP, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            max_position_embeddings=tokenizer.model_max_length)
    return CLIPTextModel(config)


def token_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """The pipeline's prompt token ids of ``captions`` (padded to 77)."""
    return tokenizer(captions, padding="max_length", max_length=tokenizer.model_max_length,
                     truncation=True, return_tensors="pt").input_ids


def train_denoiser(latents, encoder, ids, caption_ids, *, steps: int, batch: int, lr: float, seed: int, log):
    """The UNet and ``encoder`` together as a conditional DDPM on ``latents`` (scaled), prompt token
    ids ``ids`` (row ``caption_ids[i]`` for latent ``i``; the last row is the empty prompt).

    v-prediction on the zero-terminal-SNR schedule (:data:`SCHEDULER`), unweighted; learning rate
    warmed up then cosine-decayed to a tenth; returns the weights' exponential moving averages.
    """
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**UNET)
    encoder.train()
    emas = copy.deepcopy(unet).eval(), copy.deepcopy(encoder).eval()
    params = [*unet.parameters(), *encoder.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    abar = DDPMScheduler.from_config(SCHEDULER).alphas_cumprod
    g = torch.Generator().manual_seed(seed)
    warmup, empty = min(200, steps // 10 + 1), len(ids) - 1
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * min(step / warmup, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        idx = torch.randint(len(latents), (batch,), generator=g)
        drop = torch.rand(batch, generator=g) < 0.1  # empty prompts, for classifier-free guidance
        x0, noise = latents[idx], torch.randn((batch, *latents.shape[1:]), generator=g)
        t = torch.randint(0, 1000, (batch,), generator=g)
        a = abar[t].view(-1, 1, 1, 1)
        # Each distinct prompt of the batch through the encoder once (there are 91 in all).
        prompts, which = torch.unique(torch.where(drop, empty, caption_ids[idx]), return_inverse=True)
        context = encoder(ids[prompts])[0][which]
        pred = unet(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, encoder_hidden_states=context).sample
        loss = F.mse_loss(pred, a.sqrt() * noise - (1 - a).sqrt() * x0)  # v (Salimans & Ho 2022)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.995, (1 + step) / (10 + step))
        with torch.no_grad():
            for model, ema in zip((unet, encoder), emas, strict=True):
                for p, e in zip(model.parameters(), ema.parameters(), strict=True):
                    e.lerp_(p, 1 - decay)
        if step % 50 == 0 or step == steps:
            log(f"unet step {step}/{steps} loss {loss.item():.4f}")
    return emas


def save(out: Path, vae, unet, encoder, tokenizer, info: dict) -> None:
    """The diffusers folder, written beside ``out`` and renamed into place: the stock pipeline's
    ``save_pretrained`` (safetensors) plus ``training.json`` (the command's settings)."""
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=DDIMScheduler.from_config(SCHEDULER), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    tmp = out.with_name(out.name + ".tmp")
    for folder in (tmp, out):  # replaced only when this script wrote it (its training.json): never a user's folder
        if folder.exists() and not (folder / "training.json").is_file():
            raise SystemExit(f"{folder} exists and was not written by this script (no training.json); move it away")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    (tmp / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        for keep in ("README.md", "LICENSE"):  # the folder's hand-written files stay
            if (out / keep).exists():
                shutil.copy2(out / keep, tmp / keep)
        shutil.rmtree(out)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("config/demo_model"))
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--vae-steps", type=int, default=4000)
    ap.add_argument("--unet-steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=16, help="denoiser batch size")
    ap.add_argument("--lr", type=float, default=1e-3, help="denoiser peak learning rate")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    pixels, captions = base_dataset(args.images, args.seed)
    vae = train_vae(base_dataset(args.images, args.seed + 2, VAE_SIDES)[0], args.vae_steps, args.seed, log)
    modes = encode_all(vae, pixels)
    scale = float(1.0 / modes.std())
    vae.register_to_config(scaling_factor=scale)
    log(f"latent std {modes.std().item():.4f} -> scaling_factor {scale:.4f}")
    with tempfile.TemporaryDirectory() as folder:  # save_pretrained writes it into the model folder
        tokenizer = demo_tokenizer(Path(folder))
    encoder = text_encoder(tokenizer, args.seed + 1)
    unique = sorted(set(captions))
    ids = token_ids(tokenizer, [*unique, ""])
    caption_ids = torch.tensor([unique.index(c) for c in captions])
    unet, encoder = train_denoiser(modes * scale, encoder, ids, caption_ids, steps=args.unet_steps,
                                   batch=args.batch, lr=args.lr, seed=args.seed, log=log)
    info = {"command": "scripts/train_demo_model.py",
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "seconds": round(time.time() - start), "torch": torch.__version__, "threads": torch.get_num_threads()}
    save(args.out, vae, unet, encoder, tokenizer, info)
    log(f"saved {args.out}")


if __name__ == "__main__":
    main()
