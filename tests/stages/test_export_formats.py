"""Every export format, for every family: every key maps, the reference loader reproduces the trained delta.

One tiny family per module fixture; a LoRA with random ``up`` matrices and
alpha != rank (so a lost alpha shows) stands in for a trained adapter. The
expected weight deltas come from PEFT's own ``get_delta_weight`` on the
in-training model, independent of our conversion code. The denoiser's inputs
are the ones the family's own training loss passes (captured once), so every
family is exercised the same way.
"""

from __future__ import annotations

import contextlib
import json
import re

import comfy_rules
import numpy as np
import peft
import pytest
import torch
from diffusers.loaders.lora_conversion_utils import (
    _convert_hunyuan_video_lora_to_diffusers,
    _convert_kohya_flux_lora_to_diffusers,
    _convert_non_diffusers_lumina2_lora_to_diffusers,
)
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint
from family_tables import missing_rows, row
from peft.tuners.lora import LoraLayer
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.export import export_lora, import_lora
from diffpipe.export.convert import to_original
from diffpipe.export.keymaps import keymap_for_model, mapped_families
from diffpipe.families import family_names, get_family, spec
from diffpipe.models.spec import Absent
from diffpipe.paths import FORMATS
from diffpipe.training.adapter import (
    add_lora,
    apply_adapter,
    lora_state_dict,
    peft_config,
    save_adapter,
)

TOL = 1e-5
#: Every registered family whose spec has a key map: a new key map is tested without a list to edit.
FAMILIES = [n for n in family_names() if not isinstance(spec(n).keymap, Absent)]
# Beyond the defaults, the layers each key map treats specially: SD's shortcut convs and time
# embedding; SDXL's added-conditioning MLP; Flux's final modulation (halves swapped in the
# original) and single-block output (``proj_mlp`` stays out, so ``linear1`` is partly trained);
# Chroma's guidance approximator; SD3's patch conv and swapped modulations (final layer, last
# context block); Lumina 2's modulations; Qwen-Image's modulation and output; HiDream's MoE
# experts and output; Wan's Conv3d patch embedding and the layers outside its blocks; LTX-Video's
# renamed patch and timestep layers; HunyuanVideo's Conv3d patch embedding, swapped final
# modulation, token refiner and embedders; Mochi's Conv2d patch embedding, swapped final
# modulation, last-block text modulation and caption projection; Cosmos' AdaLN-LoRA modulations;
# CogVideoX's Conv2d patch embedding, renamed time embedding and block modulations; CogView4's
# swapped final modulation, block modulation (outside the block in the original) and the
# condition embedder; FLUX.2's swapped final modulation, shared modulations, embedders and a single
# block's output (``attn.to_out`` of a double block is a list, so named whole); ERNIE-Image's and
# Krea 2's embedders, modulations and output layers (Krea 2's renamed in the original, ERNIE-Image's not);
# AuraFlow's embedders, modulations (the final one's halves swapped) and output; Sana's embedders and output;
# Ideogram 4's embedders, block and final modulations and output (names its LoRA converter does not read).
EXTRA_TARGETS = {
    "sd": ["conv_shortcut", "time_embedding.linear_1"],
    "sdxl": ["conv_shortcut", "add_embedding.linear_1"],
    "flux": ["norm_out.linear", "proj_out"],
    "chroma": ["distilled_guidance_layer.in_proj", "proj_out"],
    "sd3": ["pos_embed.proj", "norm_out.linear", "norm1_context.linear"],
    "lumina2": ["norm1.linear", "norm_out.linear_1"],
    "qwenimage": ["img_mod.1", "norm_out.linear", "proj_out"],
    "hidream": ["experts.0.w1", "final_layer.linear"],
    "wan": ["patch_embedding", "time_proj", "proj_out"],
    "skyreels-v2": ["patch_embedding", "time_proj", "proj_out"],
    "flux-kontext": ["norm_out.linear", "proj_out"],
    "qwenimage-edit": ["img_mod.1", "norm_out.linear", "proj_out"],
    "ltxvideo": ["proj_in", "time_embed.linear", "caption_projection.linear_1"],
    "ltx2": ["proj_in", "time_embed.linear", "caption_projection.linear_1", "audio_proj_in",
             "av_cross_attn_video_scale_shift.linear"],
    "hunyuanvideo": [
        "x_embedder.proj",
        "norm_out.linear",
        "norm1_context.linear",
        "proj_in",
        "timestep_embedder.linear_1",
    ],
    "mochi": ["patch_embed.proj", "norm_out.linear", "norm1_context.linear_1", "caption_proj"],
    "cosmos2": ["patch_embed.proj", "norm1.linear_1", "norm_out.linear_2", "t_embedder.linear_1"],
    "cosmos2-video": ["patch_embed.proj", "norm_out.linear_2"],
    "cogvideox": ["patch_embed.proj", "time_embedding.linear_1", "norm1.linear", "norm2.linear", "norm_out.linear"],
    "cogview4": ["norm_out.linear", "norm1.linear", "condition_embedder.linear_1", "proj_out"],
    "zimage": ["layers.0.adaLN_modulation.0", "noise_refiner.0.adaLN_modulation.0", "all_final_layer.2-1.linear",
               "all_final_layer.2-1.adaLN_modulation.1", "all_x_embedder.2-1", "t_embedder.mlp.0", "cap_embedder.1"],
    "flux2-klein": ["norm_out.linear", "proj_out", "x_embedder", "context_embedder",
                    "time_guidance_embed.timestep_embedder.linear_1", "double_stream_modulation_img.linear",
                    "single_stream_modulation.linear", "single_transformer_blocks.0.attn.to_out"],
    "flux2": ["norm_out.linear", "proj_out", "time_guidance_embed.guidance_embedder.linear_1",
              "time_guidance_embed.guidance_embedder.linear_2", "double_stream_modulation_txt.linear"],
    "ernie-image": ["x_embedder.proj", "text_proj", "time_embedding.linear_1", "adaLN_modulation.1",
                    "final_norm.linear", "final_linear"],
    "krea2": ["img_in", "time_embed.linear_1", "time_mod_proj", "txt_in.linear_2", "text_fusion.projector",
              "final_layer.linear"],
    "auraflow": ["pos_embed.proj", "context_embedder", "time_step_proj.linear_1", "norm1.linear",
                 "norm1_context.linear", "ff_context.linear_1", "norm_out.linear", "proj_out"],
    "sana": ["patch_embed.proj", "time_embed.linear", "caption_projection.linear_1", "proj_out"],
    "ideogram4": ["input_proj", "llm_cond_proj", "t_embedding.mlp_in", "adaln_proj", "adaln_modulation",
                  "final_layer.linear", "final_layer.adaln_modulation"],
}

_EXTRA_ROW = ("EXTRA_TARGETS in tests/stages/test_export_formats.py",
              "[the layers its key map treats specially, beyond the default LoRA targets]")


def _extra_targets(name: str) -> list[str]:
    return row(EXTRA_TARGETS, name, *_EXTRA_ROW)


def _forward_inputs(family) -> tuple[tuple, dict]:
    """The denoiser's arguments in the family's training loss, on two tiny encoded samples."""
    g = torch.Generator().manual_seed(0)
    side = 2 * family.pixel_multiple
    frames = family.frame_rule[0] + family.frame_rule[1] if family.is_video else 1
    pixels = torch.rand(2, 3, frames, side, side, generator=g) * 2 - 1
    captions = ["a red fox", "two blue cups on a table"]
    extra = {}
    with torch.no_grad():
        latents = family.encode_pixels(family.load_vae(), pixels)
        if family.text_uses_control:  # the control image is the other item's target
            images = [Image.fromarray(((p[:, 0].permute(1, 2, 0) + 1) * 127.5).byte().numpy()) for p in pixels]
            text = family.encode_text(family.load_text_encoders(), captions, images[::-1])
        else:
            text = family.encode_text(family.load_text_encoders(), captions)
    if family.uses_control:
        extra["control"] = latents.flip(0)
    denoiser = family.load_denoiser()
    captured = {}

    def hook(module, args, kwargs):
        captured["inputs"] = (args, {k: v for k, v in kwargs.items() if k != "return_dict"})

    handle = denoiser.register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        family.loss(denoiser, latents, text, g, t=torch.tensor([0.3, 0.7]), **extra)
    handle.remove()
    return captured["inputs"]


def _out(denoiser, inputs):
    args, kwargs = inputs
    with torch.no_grad():
        out = denoiser(*args, **kwargs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one output per image


def _deltas(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weight delta of every LoRA layer, computed by PEFT (the active adapter)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, LoraLayer):
            (adapter,) = mod.active_adapters
            out[name.removeprefix("base_model.model.")] = mod.get_delta_weight(adapter).detach().float()
    return out


def _assert_deltas(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str):
    zero = {k for k, v in got.items() if k not in expected and v.abs().max() == 0}
    assert set(got) - zero == set(expected), f"{what}: modules differ: {sorted(set(got) ^ set(expected))[:5]}"
    for k, d in expected.items():
        diff = (got[k] - d).abs().max().item()
        assert diff <= TOL, f"{what}: {k} delta off by {diff:.2e}"


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request, tmp_path_factory):
    name = request.param
    family = get_family(ModelConfig(family=name, flavor="tiny"))
    inputs = _forward_inputs(family)
    denoiser = family.load_denoiser()
    base_out = _out(denoiser, inputs)
    targets = family.lora_targets(None) + _extra_targets(name)
    lora_cfg = peft_config(LoraConfig(rank=4, alpha=6.0, targets=targets), targets)
    add_lora(denoiser, lora_cfg)
    g = torch.Generator().manual_seed(1)
    for pname, p in denoiser.named_parameters():
        if "lora_B" in pname:
            p.data = torch.randn(p.shape, generator=g) * 0.1
    root = tmp_path_factory.mktemp(f"export-{name}")
    meta = {"family": name, "flavor": "tiny", "step": 7, "epoch": 1}  # what training records
    save_adapter(root / "adapter", lora_state_dict(denoiser), lora_cfg, meta)
    result = export_lora(root / "adapter", root / "export", family, list(FORMATS))
    return {
        "family": family,
        "denoiser": denoiser,
        "inputs": inputs,
        "base_out": base_out,
        "trained_out": _out(denoiser, inputs),
        "deltas": _deltas(denoiser),
        "root": root,
        "files": result.files,
        "card": result.card,
        "pipe": family.load_pipeline(),
    }


@contextlib.contextmanager
def _lora_in_pipeline(pipe, source, **kwargs):
    """The pipeline's denoiser with ``source`` loaded by ``load_lora_weights``; unloaded afterwards."""
    pipe.load_lora_weights(source, **kwargs)
    try:
        yield getattr(pipe, next(n for n in ("unet", "transformer") if hasattr(pipe, n)))
    finally:
        pipe.unload_lora_weights()


def test_lora_changes_the_output(trained):
    assert (trained["trained_out"] - trained["base_out"]).abs().max() > 1e-3


def test_export_read_every_file_back(trained):
    """The export's verify step (``export/verify.json``) read each file by its reader's rules: the
    diffusers and PEFT loaders placed every trained module, ComfyUI's key map every layer, and the merged
    folder held every trained layer at base + delta."""
    report = json.loads((trained["root"] / "export" / "verify.json").read_text())
    assert report["ok"], report
    assert set(report["files"]) == {p.name for p in trained["files"].values()}
    for name, entry in report["files"].items():
        if entry["format"] in ("diffusers", "peft", "merged"):  # merged: each trained layer read back (#41)
            assert entry["placed"] == len(trained["deltas"]), (name, entry)
        else:  # one layer per original layer: fused layers hold several modules
            assert 0 < entry["placed"] <= len(trained["deltas"]), (name, entry)


# -- key maps against diffusers' single-file converters ------------------------------------------
def _fused_original(model: torch.nn.Module, keymap) -> dict[str, torch.Tensor]:
    """The model's LoRA-able weights renamed (and fused) into the original checkpoint by our table."""
    sd = model.state_dict()
    original = {}
    for layer in keymap.layers:
        for param in ("weight", "bias"):
            if f"{layer.segments[0].module}.{param}" in sd:
                parts = [sd[f"{s.module}.{param}"][s.start : s.start + s.size] for s in layer.segments]
                original[f"{layer.original}.{param}"] = torch.cat(parts)
    return original


def _flux_norms(sd: dict[str, torch.Tensor], double: int, single: int) -> dict[str, torch.Tensor]:
    """QK-norm scales (not LoRA targets, outside the table) under their BFL names."""
    out = {}
    for i in range(double):
        for stream, ours in (("img", ""), ("txt", "added_")):
            for qk, name in (("q", "query"), ("k", "key")):
                out[f"double_blocks.{i}.{stream}_attn.norm.{name}_norm.scale"] = sd[
                    f"transformer_blocks.{i}.attn.norm_{ours}{qk}.weight"
                ]
    for i in range(single):
        for qk, name in (("q", "query"), ("k", "key")):
            out[f"single_blocks.{i}.norm.{name}_norm.scale"] = sd[
                f"single_transformer_blocks.{i}.attn.norm_{qk}.weight"
            ]
    return out


def _mochi_norms(sd: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """QK-norm scales and rotary frequencies (not LoRA targets, outside the table) under Mochi's names."""
    out = {"pos_frequencies": sd["pos_frequencies"]}
    for i in range(n):
        for o, d in (
            ("q_norm_x", "norm_q"),
            ("k_norm_x", "norm_k"),
            ("q_norm_y", "norm_added_q"),
            ("k_norm_y", "norm_added_k"),
        ):
            out[f"blocks.{i}.attn.{o}.weight"] = sd[f"transformer_blocks.{i}.attn1.{d}.weight"]
    return out


def _tiny(name, **changes):
    if not changes:
        return lambda: get_family(ModelConfig(family=name, flavor="tiny")).load_denoiser()

    def build():  # the tiny flavor's config with ``changes``, random weights
        tiny = get_family(ModelConfig(family=name, flavor="tiny")).load_denoiser()
        torch.manual_seed(0)
        return type(tiny).from_config({**tiny.config, **changes})

    return build


def _meta(cls_name, **kwargs):
    def build():
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, cls_name)(**kwargs)

    return build


# family -> (denoiser, extra original tensors the converter pops). Converters that hard-code the
# flagship's sizes (Flux, Chroma: inner dim 3072; Lumina 2: q/k/v 2304/768/768) get a full-size
# skeleton on the meta device (shapes, no memory); the others run on the tiny model's values.
SINGLE_FILE_CASES = {
    "sd": (_tiny("sd"), None),
    "sdxl": (_tiny("sdxl"), None),
    "flux": (
        _meta("FluxTransformer2DModel", num_layers=1, num_single_layers=1, guidance_embeds=True),
        lambda sd: _flux_norms(sd, 1, 1),
    ),
    "chroma": (
        _meta("ChromaTransformer2DModel", num_layers=1, num_single_layers=1, approximator_layers=1),
        lambda sd: (
            _flux_norms(sd, 1, 1)
            | {"distilled_guidance_layer.norms.0.scale": sd["distilled_guidance_layer.norms.0.weight"]}
        ),
    ),
    "sd3": (_tiny("sd3"), lambda sd: {"pos_embed": sd["pos_embed.pos_embed"]}),
    "sd3.5-medium": (
        _meta("SD3Transformer2DModel", num_layers=2, dual_attention_layers=(0,), qk_norm="rms_norm"),
        lambda sd: {"pos_embed": sd["pos_embed.pos_embed"]},
    ),
    "lumina2": (_meta("Lumina2Transformer2DModel", num_layers=1, num_refiner_layers=1), None),
    "qwenimage": (_tiny("qwenimage"), None),
    "hidream": (_tiny("hidream"), None),
    "wan": (_tiny("wan"), None),
    "wan-i2v": (_meta("WanTransformer3DModel", num_layers=1, image_dim=1280, added_kv_proj_dim=5120), None),
    "flux-kontext": (
        _meta("FluxTransformer2DModel", num_layers=1, num_single_layers=1, guidance_embeds=True),
        lambda sd: _flux_norms(sd, 1, 1),
    ),
    "qwenimage-edit": (_tiny("qwenimage-edit"), None),
    "ltxvideo": (_tiny("ltxvideo"), None),
    "ltx2": (_tiny("ltx2"), None),
    # HunyuanVideo's converter hard-codes the inner size (3072) of ``linear1``; Mochi's, 48 blocks
    # (tiny ones here, so the swapped halves are checked by value).
    "hunyuanvideo": (
        _meta("HunyuanVideoTransformer3DModel", num_layers=1, num_single_layers=1, num_refiner_layers=1),
        None,
    ),
    "mochi": (_tiny("mochi", num_layers=48), lambda sd: _mochi_norms(sd, 48)),
    "flux2-klein": (_tiny("flux2-klein"), lambda sd: _flux_norms(sd, 1, 1)),
    "flux2": (_tiny("flux2"), lambda sd: _flux_norms(sd, 1, 1)),
    "ernie-image": (_tiny("ernie-image"), None),
    "krea2": (_tiny("krea2"), None),
    # What the converters read beside the LoRA-able layers (positions, tokens, norms, modulation tables).
    "auraflow": (_tiny("auraflow"), lambda sd: {"positional_encoding": sd["pos_embed.pos_embed"],
                                                "register_tokens": sd["register_tokens"]}),
    "sana": (_tiny("sana"), lambda sd: {
        "pos_embed": torch.zeros(1), "y_embedder.y_embedding": torch.zeros(1),
        "attention_y_norm.weight": sd["caption_norm.weight"], "final_layer.scale_shift_table": sd["scale_shift_table"],
        **{f"blocks.{k.split('.')[1]}.scale_shift_table": v for k, v in sd.items()
           if k.startswith("transformer_blocks.") and k.endswith(".scale_shift_table")}}),
    "cosmos2": (_tiny("cosmos2"), None),
    "cosmos2-video": (_tiny("cosmos2-video"), None),
}


@pytest.mark.parametrize("case", list(SINGLE_FILE_CASES))
def test_key_map_matches_diffusers_single_file_converter(case):
    """Renaming (and fusing) the denoiser's weights into original names with our table, the
    converter diffusers' ``from_single_file`` uses for that class gives every weight back."""
    family = case if case in mapped_families() else case.split("-")[0].removesuffix(".5")
    build, extras = SINGLE_FILE_CASES[case]
    model = build()
    keymap = keymap_for_model(family, model)
    keymap.check_covers(model)
    sd = model.state_dict()
    original = _fused_original(model, keymap) | (extras(sd) if extras else {})
    if family in ("sd", "sdxl"):
        back = convert_ldm_unet_checkpoint(
            {f"model.diffusion_model.{k}": v for k, v in original.items()}, dict(model.config)
        )
    else:
        convert = SINGLE_FILE_LOADABLE_CLASSES[type(model).__name__]["checkpoint_mapping_fn"]
        back = convert(dict(original), config=dict(model.config))
    mapped = {k for k in sd if k.rsplit(".", 1)[0] in keymap.by_module}
    assert mapped <= set(back), sorted(mapped - set(back))[:5]
    for k in mapped:
        if sd[k].is_meta:
            assert back[k].shape == sd[k].shape, k
        else:
            assert torch.equal(back[k], sd[k]), k


# -- key maps without a diffusers converter: the naming facts, restated here ----------------------
def _comfy_cogvideox_to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's CogVideoX model (``comfy/ldm/cogvideo/model.py``) names -> diffusers' names.

    Its blocks ``blocks.N`` hold ``q``/``k``/``v``/``attn_out``, ``ff_proj``/``ff_out`` and
    ``norm1``/``norm2.linear``; the time and ofs embedders are flat attributes
    (``time_embedding_linear_1``); nothing is fused or reordered.
    """
    block = {"q": "attn1.to_q", "k": "attn1.to_k", "v": "attn1.to_v", "attn_out": "attn1.to_out.0"}
    block |= {"ff_proj": "ff.net.0.proj", "ff_out": "ff.net.2", "norm1.linear": "norm1.linear"}
    block |= {"norm2.linear": "norm2.linear"}
    flat = {f"{e}_embedding_linear_{i}": f"{e}_embedding.linear_{i}" for e in ("time", "ofs") for i in (1, 2)}
    same = ("patch_embed.proj", "patch_embed.text_proj", "norm_out.linear", "proj_out")
    back = {}
    for key, value in original.items():
        name, param = key.rsplit(".", 1)
        if m := re.fullmatch(r"blocks\.(\d+)\.(.+)", name):
            name = f"transformer_blocks.{m[1]}.{block[m[2]]}"
        elif name in flat:
            name = flat[name]
        else:
            assert name in same, f"not a ComfyUI CogVideoX layer: {key}"
        back[f"{name}.{param}"] = value
    return back


def _sat_cogview4_to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """THUDM's SAT CogView4 checkpoint names (as diffusers' conversion script reads them) -> diffusers'.

    ``query_key_value`` splits into thirds (q, k, v); ``mixins.final_layer.adaln.1`` holds
    (shift, scale) where diffusers holds (scale, shift).
    """
    top = {"mixins.patch_embed.proj": "patch_embed.proj", "mixins.patch_embed.text_proj": "patch_embed.text_proj",
           "time_embed.0": "time_condition_embed.timestep_embedder.linear_1",
           "time_embed.2": "time_condition_embed.timestep_embedder.linear_2",
           "label_emb.0.0": "time_condition_embed.condition_embedder.linear_1",
           "label_emb.0.2": "time_condition_embed.condition_embedder.linear_2",
           "mixins.final_layer.linear": "proj_out"}  # fmt: skip
    block = {"attention.dense": "attn1.to_out.0", "mlp.dense_h_to_4h": "ff.net.0.proj",
             "mlp.dense_4h_to_h": "ff.net.2"}  # fmt: skip
    back = {}
    for key, value in original.items():
        name, param = key.rsplit(".", 1)
        if name in top:
            back[f"{top[name]}.{param}"] = value
        elif name == "mixins.final_layer.adaln.1":
            shift, scale = value.chunk(2)
            back[f"norm_out.linear.{param}"] = torch.cat([scale, shift])
        elif m := re.fullmatch(r"mixins\.adaln\.adaln_modules\.(\d+)\.1", name):
            back[f"transformer_blocks.{m[1]}.norm1.linear.{param}"] = value
        elif m := re.fullmatch(r"transformer\.layers\.(\d+)\.attention\.query_key_value", name):
            for part, chunk in zip(("to_q", "to_k", "to_v"), value.chunk(3), strict=True):
                back[f"transformer_blocks.{m[1]}.attn1.{part}.{param}"] = chunk
        else:
            m = re.fullmatch(r"transformer\.layers\.(\d+)\.(.+)", name)
            assert m and m[2] in block, f"not a SAT CogView4 layer: {key}"
            back[f"transformer_blocks.{m[1]}.{block[m[2]]}.{param}"] = value
    return back


def _ideogram4_original_to_diffusers(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ideogram 4's original names -> diffusers': each block's fused ``attention.qkv`` split in three
    (q, k, v rows) and ``attention.o`` renamed ``to_out.0`` (as diffusers' LoRA converter splits them);
    every other name is diffusers' own."""
    back = {}
    for key, value in original.items():
        name, param = key.rsplit(".", 1)
        if name.endswith(".attention.qkv"):
            for part, rows in zip(("to_q", "to_k", "to_v"), value.chunk(3), strict=True):
                back[f"{name.removesuffix('qkv')}{part}.{param}"] = rows
            continue
        if name.endswith(".attention.o"):
            name = name.removesuffix("o") + "to_out.0"
        back[f"{name}.{param}"] = value
    return back


NAMING_FACT_CASES = {
    "cogvideox": (_tiny("cogvideox"), _comfy_cogvideox_to_diffusers),
    # CogVideoX 1.5 image-to-video: temporal patches (a Linear patch embedding) and the ofs embedding.
    "cogvideox-1.5": (_tiny("cogvideox", patch_size_t=2, ofs_embed_dim=8), _comfy_cogvideox_to_diffusers),
    "cogview4": (_tiny("cogview4"), _sat_cogview4_to_diffusers),
    "ideogram4": (_tiny("ideogram4"), _ideogram4_original_to_diffusers),
}


@pytest.mark.parametrize("case", list(NAMING_FACT_CASES))
def test_key_map_matches_original_naming_facts(case):
    """Families diffusers ships no single-file converter for: the denoiser's weights renamed (and
    fused) into original names by our table, and back by the naming facts restated above, are the
    denoiser's own; the table names no layer outside those facts."""
    build, to_diffusers = NAMING_FACT_CASES[case]
    model = build()
    keymap = keymap_for_model(case.split("-")[0], model)
    keymap.check_covers(model)
    sd = model.state_dict()
    back = to_diffusers(_fused_original(model, keymap))
    mapped = {k for k in sd if k.rsplit(".", 1)[0] in keymap.by_module}
    assert set(back) == mapped, sorted(set(back) ^ mapped)[:5]
    for k in mapped:
        assert torch.equal(back[k], sd[k]), k


# -- per format: every key maps, reference loader reproduces the delta and the output -------------
#: Families whose diffusers file ComfyUI reads whole (it maps their ``transformer.`` names); written out
#: here, independent of the specs the model card reads.
COMFY_READS_DIFFUSERS = {"flux", "flux-kontext", "chroma", "sd3", "qwenimage", "qwenimage-edit", "hidream", "zimage"}
BASE_MODEL_VERSION = {
    "sd": "sd_v1",
    "sdxl": "sdxl_base_v1-0",
    "flux": "flux1",
    "chroma": "chroma",
    "sd3": "sd3",
    "lumina2": "lumina2",
    "qwenimage": "qwen_image",
    "hidream": "hidream",
    "wan": "wan",
    "skyreels-v2": "wan",
    "flux-kontext": "flux1",
    "qwenimage-edit": "qwen_image",
    "ltxvideo": "ltx_video",
    "ltx2": "ltx2",
    "hunyuanvideo": "hunyuan_video",
    "mochi": "mochi",
    "cosmos2": "cosmos_predict2",
    "cosmos2-video": "cosmos_predict2",
    "cogvideox": "cogvideox",
    "cogview4": "cogview4",
    "zimage": "z_image",
    "flux2-klein": "flux2",
    "flux2": "flux2",
    "ernie-image": "ernie_image",
    "krea2": "krea2",
    "auraflow": "auraflow",
    "sana": "sana",
    "ideogram4": "ideogram4",
}
_BASE_ROW = ("BASE_MODEL_VERSION in tests/stages/test_export_formats.py",
             '"<ss_base_model_version sd-scripts or musubi-tuner write for it>"')


def test_every_family_with_a_key_map_has_its_rows():
    """Every registered family with a key map is exported here: each needs its rows in both tables."""
    missing = missing_rows(FAMILIES, EXTRA_TARGETS, *_EXTRA_ROW) + missing_rows(FAMILIES, BASE_MODEL_VERSION,
                                                                               *_BASE_ROW)
    assert not missing, "\n".join(missing)


def test_every_format_written_with_metadata_and_card(trained):
    files = trained["files"]
    assert set(files) == set(FORMATS)
    for fmt in ("diffusers", "comfyui", "kohya"):
        with safe_open(str(files[fmt]), framework="pt") as f:
            meta = f.metadata()
        base = json.loads(meta["diffpipe.base_model"])
        assert base["family"] == trained["family"].name and len(base["weights_sha256"]) == 64
        assert json.loads(meta["diffpipe.lora"])["alpha"] == 6.0
        assert json.loads(meta["diffpipe.training"]) == {"step": 7, "epoch": 1}
        assert len(meta["diffpipe.tensors_sha256"]) == 64
    with safe_open(str(files["kohya"]), framework="pt") as f:
        meta = f.metadata()
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "6.0" and meta["ss_steps"] == "7"
    assert {
        "ss_base_model_version",
        "ss_training_started_at",
        "ss_num_train_images",
        "modelspec.architecture",
        "modelspec.title",
        "modelspec.resolution",
        "modelspec.sai_model_spec",
    } <= set(meta)
    assert meta["ss_base_model_version"] == row(BASE_MODEL_VERSION, trained["family"].name, *_BASE_ROW)
    card = trained["card"].read_text()
    assert all(fmt in card for fmt in FORMATS)
    # How to load: A1111/Forge only where they run the model; CogView4's original names only in our import.
    name = trained["family"].name
    assert ("<lora:kohya_lora:1>" in card) == (name in ("sd", "sdxl", "flux", "flux-kontext"))
    assert ("import-lora comfyui_lora.safetensors" in card) == (name == "cogview4")
    # The diffusers file in ComfyUI: read whole, in part, or not at all (then the card names the file to use).
    assert ("ComfyUI reads it too" in card) == (name in COMFY_READS_DIFFUSERS)
    assert ("use `comfyui_lora.safetensors` there" in card) == (name not in COMFY_READS_DIFFUSERS | {"cogview4"})


def test_diffusers_file_loads_in_pipeline_at_trained_strength(trained):
    with _lora_in_pipeline(trained["pipe"], str(trained["files"]["diffusers"])) as denoiser:
        _assert_deltas(_deltas(denoiser), trained["deltas"], "diffusers/load_lora_weights")
        torch.testing.assert_close(_out(denoiser, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


def test_peft_folder_loads_with_peft(trained):
    family = trained["family"]
    model = peft.PeftModel.from_pretrained(family.load_denoiser(), str(trained["files"]["peft"]))
    _assert_deltas(_deltas(model), trained["deltas"], "peft/PeftModel.from_pretrained")
    torch.testing.assert_close(
        _out(model.base_model.model, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5
    )


def _split_rows(layer, delta: torch.Tensor) -> dict[str, torch.Tensor]:
    """An original layer's delta as its modules' deltas (rows by the table's segments)."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    row = 0
    for seg in layer.segments:
        parts.setdefault(seg.module, []).append((seg.start, delta[row : row + seg.size]))
        row += seg.size
    return {m: torch.cat([t for _, t in sorted(p, key=lambda x: x[0])]) for m, p in parts.items()}


@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_original_name_formats_place_every_layer_at_trained_strength_in_comfyui(trained, fmt):
    """ComfyUI's key map and LoRA arithmetic (``tests/comfy_rules.py``): every layer lands on
    the model weight of its original layer, at PEFT's delta (header ignored, missing alpha = 1.0)."""
    name = trained["family"].name
    if name == "cogview4":
        pytest.skip("ComfyUI has no CogView4 model")
    if (name, fmt) == ("zimage", "kohya"):
        pytest.skip("ComfyUI maps Z-Image's diffusers names only under diffusion_model./transformer.: "
                    "the comfyui file is the one for ComfyUI")
    keymap = keymap_for_model(name, trained["family"].load_denoiser())
    weight_of = {comfy_rules.model_weight(name, la.original): la for la in keymap.layers}
    key_map = comfy_rules.lora_key_map(name, list(weight_of))
    if name == "sd":  # ComfyUI also maps sd-scripts' diffusers-path names for SD (``unet_to_diffusers``)
        key_map |= {la.kohya: comfy_rules.model_weight(name, la.original) for la in keymap.layers}
    patches = comfy_rules.lora_patches(load_file(str(trained["files"][fmt])))
    unplaced = sorted(set(patches) - set(key_map))
    assert not unplaced, f"ComfyUI would not load {len(unplaced)} layer(s), e.g. {unplaced[:3]}"
    got: dict[str, torch.Tensor] = {}
    for layer_name, delta in patches.items():
        layer = weight_of[key_map[layer_name]]
        for module, d in _split_rows(layer, delta).items():
            got[module] = d.reshape(trained["deltas"].get(module, d).shape)
    _assert_deltas(got, trained["deltas"], f"{fmt}/ComfyUI rules")


def test_diffusers_file_needs_no_alpha(trained):
    """Readers that ignore the header (ComfyUI, which maps ``transformer.`` names for Flux, Chroma,
    SD3, Qwen-Image, HiDream) read ``lora_B @ lora_A`` at scale 1: that must be the trained delta."""
    prefix = trained["family"].denoiser_name + "."
    tensors = {k.removeprefix(prefix): v for k, v in load_file(str(trained["files"]["diffusers"])).items()}
    assert not any(k.endswith(".alpha") for k in tensors)
    got = {k: v.reshape(trained["deltas"][k].shape) for k, v in comfy_rules.lora_patches(tensors).items()}
    _assert_deltas(got, trained["deltas"], "diffusers file without its header")


def _comfy_as_kohya(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ComfyUI's own equivalence: ``diffusion_model.<path>`` == ``lora_unet_<path with _>``."""
    renamed = {}
    for key, value in tensors.items():
        layer, _, suffix = key.removeprefix("diffusion_model.").partition(".lora_")
        if not suffix:
            layer, suffix = key.removeprefix("diffusion_model.").removesuffix(".alpha"), "alpha"
        else:
            suffix = "lora_" + suffix
        renamed["lora_unet_" + layer.replace(".", "_") + "." + suffix] = value
    return renamed


# What each family's stock pipeline reads, per format (diffusers' converters as the reference):
# a key filter where the converter covers only some layers, and the pipeline kwargs. Families
# absent here have no diffusers loader for that format at tiny size (Flux, Flux Kontext, Chroma,
# Lumina 2: sizes hard-coded, checked at full size below; SD3, HiDream, Lumina 2, LTX-Video and
# HunyuanVideo kohya, Mochi, Cosmos, CogVideoX and CogView4: none): ``diffpipe import-lora`` is their reference
# (``test_import_round_trip``).
def _wan_blocks(key: str) -> bool:  # musubi-tuner's Wan layout: the blocks' attention and MLP only
    return key.startswith("lora_unet_blocks_")


def _no_patch_embedding(key: str) -> bool:  # diffusers' Wan converter has no patch_embedding entry
    return ".patch_embedding." not in key


def _ltx_renamed(key: str) -> bool:  # diffusers' LTX converter does not rename these two
    return not key.startswith(("diffusion_model.patchify_proj.", "diffusion_model.adaln_single."))


def _hunyuan_tiny(key: str) -> bool:
    """What diffusers' HunyuanVideo converter reads at tiny size: not ``linear1`` (sizes hard-coded,
    checked at full size below), the final modulation or the refiner's ``self_attn_qkv`` (it splits
    ``down`` as it splits ``up``: a LoRA there does not load from any file), nor the embedders the
    ComfyUI file names by ComfyUI's names (``time_in.in_layer``; diffusers reads ``time_in.mlp.0``)."""
    return not (
        (key.startswith("diffusion_model.single_blocks.") and ".linear1." in key)
        or key.startswith("diffusion_model.final_layer.adaLN_modulation.1.")
        or ".self_attn_qkv." in key
        or ".in_layer." in key and not key.startswith("diffusion_model.vector_in.")
        or ".out_layer." in key and not key.startswith("diffusion_model.vector_in.")
    )


def _flux2_non_diffusers(key: str) -> bool:
    """diffusers' reader of FLUX.2's original names maps the final modulation without swapping its halves."""
    return not key.startswith("diffusion_model.final_layer.adaLN_modulation.1.")


def _flux2_kohya(key: str) -> bool:  # what diffusers' FLUX.2 kohya converter maps: no modulation layers
    return "modulation" not in key


def _flux2_dev_kohya(key: str) -> bool:  # nor FLUX.2 [dev]'s guidance embedder
    return _flux2_kohya(key) and "guidance_in" not in key


def _ideogram4_blocks(key: str) -> bool:  # diffusers' Ideogram 4 converter reads the blocks' layers only
    return key.startswith("diffusion_model.layers.")


PIPELINE_READS = {
    ("sd", "kohya"): (None, False),
    ("sd", "comfyui"): (None, True),
    ("sdxl", "kohya"): (None, False),
    ("sdxl", "comfyui"): (None, True),
    ("qwenimage", "kohya"): (None, False),
    ("qwenimage", "comfyui"): (None, False),
    ("hidream", "comfyui"): (None, False),
    ("wan", "kohya"): (_wan_blocks, False),
    ("wan", "comfyui"): (_no_patch_embedding, False),
    ("skyreels-v2", "kohya"): (_wan_blocks, False),
    ("skyreels-v2", "comfyui"): (_no_patch_embedding, False),
    ("qwenimage-edit", "kohya"): (None, False),
    ("qwenimage-edit", "comfyui"): (None, False),
    ("ltxvideo", "comfyui"): (_ltx_renamed, False),
    ("ltx2", "comfyui"): (None, False),
    ("hunyuanvideo", "comfyui"): (_hunyuan_tiny, False),
    ("zimage", "kohya"): (None, False),
    ("zimage", "comfyui"): (None, False),
    ("flux2-klein", "comfyui"): (_flux2_non_diffusers, False),
    ("flux2-klein", "kohya"): (_flux2_kohya, False),
    ("flux2", "comfyui"): (_flux2_non_diffusers, False),
    ("flux2", "kohya"): (_flux2_dev_kohya, False),
    ("ideogram4", "comfyui"): (_ideogram4_blocks, False),
}


@pytest.mark.parametrize("fmt", ["comfyui", "kohya"])
def test_original_name_formats_load_in_stock_pipeline(trained, fmt):
    """The file (or the part its converter covers) through the stock pipeline's ``load_lora_weights``."""
    family = trained["family"]
    if (family.name, fmt) not in PIPELINE_READS:
        pytest.skip(f"diffusers reads no {fmt} {family.name} LoRA (none at all, or none at tiny size); import-lora is the reference")
    keep, as_kohya = PIPELINE_READS[family.name, fmt]
    pipe = trained["pipe"]
    tensors = load_file(str(trained["files"][fmt]))
    if keep is not None:
        tensors = {k: v for k, v in tensors.items() if keep(k)}
    layers = {
        (f"diffusion_model.{la.comfy_name}" if fmt == "comfyui" else la.kohya): la
        for la in keymap_for_model(family.name, family.load_denoiser()).layers
    }
    names = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.removesuffix(".alpha") for k in tensors}
    expected = {k: v for k, v in trained["deltas"].items() if any(k in layers[n].modules for n in names)}
    assert expected, "the converter must cover some trained layers"
    kwargs = {}
    if as_kohya:
        tensors = _comfy_as_kohya(tensors)
        if family.name == "sd":
            kwargs["unet_config"] = pipe.unet.config  # original block numbering -> diffusers
    with _lora_in_pipeline(pipe, tensors, **kwargs) as denoiser:
        _assert_deltas(_deltas(denoiser), expected, f"{fmt}/load_lora_weights")
        if len(expected) == len(trained["deltas"]):
            torch.testing.assert_close(_out(denoiser, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", ["diffusers", "peft", "comfyui", "kohya"])
def test_import_round_trip(trained, fmt, tmp_path):
    family = trained["family"]
    result = import_lora(trained["files"][fmt], tmp_path / "adapter", family)
    assert result.format == fmt
    model = apply_adapter(family.load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], f"{fmt}/import-lora")
    torch.testing.assert_close(_out(model, trained["inputs"]), trained["trained_out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trained", ["flux", "ltx2"], indirect=True)
def test_group_offloaded_samples_equal_the_plain_ones(trained, tmp_path):
    """``sample.offload: group`` (diffusers' group offloading of every component, onloading to the CPU
    here, the LoRA loaded after the hooks) renders exactly the samples of the pipeline without hooks;
    ``auto`` keeps everything in place without a GPU."""
    from diffpipe.config import SampleConfig
    from diffpipe.training.sample import TrainingSampler, place, render_samples

    family = trained["family"]
    sample = {"prompts": ["a red circle"], "steps": 2, "width": 32, "height": 32, "frames": 9}
    grids = {}
    for offload in ("none", "group"):
        files = render_samples(family.cfg, SampleConfig(**sample, offload=offload), trained["files"]["diffusers"],
                               tmp_path / offload)
        grids[offload] = np.asarray(Image.open(files[0]))
    assert np.array_equal(grids["none"], grids["group"])
    pipe = family.load_pipeline()
    assert place(pipe, "auto") == "none" and place(pipe, "group") == "group"
    assert _group_hooked(pipe.transformer) and _group_hooked(pipe.vae)
    # The in-training sampler leaves the trained denoiser where training put it, hooks on the frozen parts.
    rows, pipes = {}, {}
    for offload in ("none", "group"):
        sampler = TrainingSampler(family, SampleConfig(**sample, offload=offload), trained["denoiser"],
                                  tmp_path / f"train-{offload}")
        rows[offload] = np.asarray(sampler(7)[1])
        pipes[offload] = sampler._pipeline()
    assert np.array_equal(rows["none"], rows["group"])
    assert not _group_hooked(trained["denoiser"]) and _group_hooked(pipes["group"].vae)


def _group_hooked(module) -> bool:
    return any(getattr(m, "_diffusers_hook", None) is not None and m._diffusers_hook.get_hook("group_offloading")
               is not None for m in module.modules())


def test_merged_pipeline_equals_base_plus_lora(trained):
    family = trained["family"]
    # Cosmos2: the stock pipeline's safety checker is passed explicitly (see diffpipe.families.cosmos2.family).
    extra = {"safety_checker": family.safety_checker()} if family.name.startswith("cosmos2") else {}
    merged = family.pipeline_class.from_pretrained(str(trained["files"]["merged"]), **extra)
    denoiser = getattr(merged, family.denoiser_attr)
    base = family.load_denoiser().state_dict()
    for key, value in denoiser.state_dict().items():
        module = key.removesuffix(".weight")
        expected = base[key] + trained["deltas"][module] if module in trained["deltas"] else base[key]
        assert (value - expected).abs().max() <= TOL, key
    torch.testing.assert_close(_out(denoiser, trained["inputs"]), trained["trained_out"], rtol=1e-4, atol=1e-5)


def test_import_rejects_unmapped_layer(trained, tmp_path):
    from safetensors.torch import save_file

    tensors = load_file(str(trained["files"]["comfyui"]))
    tensors["diffusion_model.no_such_block.lora_down.weight"] = torch.zeros(4, 8)
    tensors["diffusion_model.no_such_block.lora_up.weight"] = torch.zeros(8, 4)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="no_such_block"):
        import_lora(tmp_path / "bad.safetensors", tmp_path / "out", trained["family"])


# -- full size: diffusers' converters that hard-code the flagship's split sizes ------------------
# (family, denoiser class + kwargs, targets the converter covers, its converter)
FULL_SIZE = {
    "flux": (
        "FluxTransformer2DModel",
        {"num_layers": 1, "num_single_layers": 1, "guidance_embeds": True},
        [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_out.0",
            "ff.net.2",
            "norm1.linear",
            "norm_out.linear",
            "proj_out",
            "x_embedder",
        ],
    ),
    "chroma": (
        "ChromaTransformer2DModel",
        {"num_layers": 1, "num_single_layers": 1, "approximator_layers": 1},
        [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.add_q_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
            "ff_context.net.0.proj",
            "proj_mlp",
            "proj_out",
            "x_embedder",
            "context_embedder",
        ],
    ),
    # Not the refiner's attention or the final modulation, which that converter misreads (see
    # ``_hunyuan_tiny``); full names keep the double blocks' q, k, v apart from the refiner's.
    "hunyuanvideo": (
        "HunyuanVideoTransformer3DModel",
        {"num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1},
        [
            *(f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v", "add_q_proj", "add_v_proj")),
            *(f"single_transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v")),
            "proj_mlp",
            "proj_out",
            "norm.linear",
            "norm1_context.linear",
            "ff_context.net.2",
            "context_embedder.proj_in",
            "timestep_embedder.linear_1",
        ],
    ),
    # diffusers' Lumina 2 converter expects every block layer (and no others)
    "lumina2": (
        "Lumina2Transformer2DModel",
        {"num_layers": 1, "num_refiner_layers": 1},
        [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "feed_forward.linear_1",
            "feed_forward.linear_2",
            "feed_forward.linear_3",
            "norm1.linear",
        ],
    ),
}


@pytest.mark.parametrize(
    ("family", "fmt"),
    [
        ("flux", "comfyui"),
        ("flux", "kohya"),
        ("chroma", "comfyui"),
        ("chroma", "kohya"),
        ("lumina2", "comfyui"),
        ("hunyuanvideo", "comfyui"),
    ],
)
def test_full_size_export_reads_back_with_diffusers_converter(family, fmt):
    """Our fused layers (block-structured) read by the converter the stock pipeline uses.

    Flux and Chroma (``FluxLoraLoaderMixin``): ``_convert_kohya_flux_lora_to_diffusers``;
    Lumina 2: ``_convert_non_diffusers_lumina2_lora_to_diffusers``; HunyuanVideo:
    ``_convert_hunyuan_video_lora_to_diffusers``. A full-size transformer (one block
    of each kind) on the meta device gives the shapes; the LoRA tensors are small
    (rank 2). Deltas are compared through random probes: ``delta @ x``.
    """
    import diffusers

    from diffpipe.export.convert import Lora
    from diffpipe.models.keymap import kohya_name

    cls_name, kwargs, targets = FULL_SIZE[family]
    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**kwargs)
    keymap = keymap_for_model(family, model)
    g = torch.Generator().manual_seed(0)
    mods = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets):
            mods[name] = Lora(
                torch.randn(2, m.in_features, generator=g),
                torch.randn(m.out_features, 2, generator=g),
                3.0 if "to_q" in name else 6.0,
            )  # one differing scale: folded into its up block
    loras, _ = to_original(mods, keymap)
    sd = {}
    for layer, lora in loras.items():
        name = f"diffusion_model.{layer.original}" if fmt == "comfyui" else layer.kohya
        down, up = ("lora_A", "lora_B") if fmt == "comfyui" and keymap.peft_names else ("lora_down", "lora_up")
        sd |= {f"{name}.{down}.weight": lora.down, f"{name}.{up}.weight": lora.up}
        if layer.alpha_key:
            sd[f"{name}.alpha"] = torch.tensor(lora.alpha)
    if fmt == "kohya":
        assert all(layer.kohya == kohya_name(layer.original) for layer in keymap.layers)
    if family == "lumina2":
        converted = _convert_non_diffusers_lumina2_lora_to_diffusers(sd)
    elif family == "hunyuanvideo":
        converted = _convert_hunyuan_video_lora_to_diffusers(sd)
    else:
        converted = _convert_kohya_flux_lora_to_diffusers(sd)
    got = {}
    for key, down in converted.items():
        if key.endswith(".lora_A.weight"):
            module = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            got[module] = (down, converted[key.replace("lora_A", "lora_B")])
    assert set(mods) <= set(got), sorted(set(mods) - set(got))[:5]
    for module, (down, up) in got.items():
        x = torch.randn(down.shape[1], 3, generator=g)
        result = up @ (down @ x)  # the converter folds alpha / rank into the tensors
        expected = mods[module].scale * mods[module].up @ (mods[module].down @ x) if module in mods else 0 * result
        assert (result - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item()), module


def test_import_of_fused_lora_without_layout_is_exact(trained, tmp_path):
    """A fused LoRA from another tool (no block layout recorded): each part shares ``down``; still exact."""
    from safetensors.torch import save_file

    src = trained["files"]["kohya"]
    save_file(load_file(str(src)), str(tmp_path / "foreign.safetensors"))  # same tensors, no diffpipe header
    import_lora(tmp_path / "foreign.safetensors", tmp_path / "adapter", trained["family"])
    model = apply_adapter(trained["family"].load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], "kohya without layout/import-lora")


# The CLI and the DeepSpeed-checkpoint path do not depend on the family: one UNet, one transformer.
@pytest.mark.parametrize("trained", ["sd", "flux"], indirect=True)
def test_cli_export_and_import_lora(trained, tmp_path):
    """``diffpipe export ADAPTER --format a,b`` (family read from the adapter) and ``diffpipe import-lora``."""
    from typer.testing import CliRunner

    from diffpipe.cli import app

    runner = CliRunner()
    name = trained["family"].name
    result = runner.invoke(
        app, ["export", str(trained["root"] / "adapter"), "--format", "comfyui,kohya", "--out", str(tmp_path / "exp")]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "exp" / "comfyui_lora.safetensors").exists() and (tmp_path / "exp" / "README.md").exists()
    bad = runner.invoke(app, ["export", str(trained["root"] / "adapter"), "--format", "onnx"])
    assert bad.exit_code == 2 and "onnx" in bad.output
    result = runner.invoke(
        app,
        ["import-lora", str(tmp_path / "exp" / "kohya_lora.safetensors"), str(tmp_path / "imported"), "--family", name],
    )
    assert result.exit_code == 0, result.output
    model = apply_adapter(trained["family"].load_denoiser(), tmp_path / "imported")
    _assert_deltas(_deltas(model), trained["deltas"], "cli import-lora")


@pytest.mark.parametrize("trained", ["sd", "flux"], indirect=True)
def test_cli_exports_a_deepspeed_checkpoint(trained, tmp_path):
    """``diffpipe export RUN/train/checkpoints/step-N``: the LoRA tensors of a DeepSpeed checkpoint."""
    import yaml
    from typer.testing import CliRunner

    from diffpipe.cli import app

    family = trained["family"]
    run = tmp_path / "run"
    ckpt = run / "train" / "checkpoints" / "step-000007"
    ckpt.mkdir(parents=True)
    # DeepSpeed saves the module state dict (frozen weights excluded) and our client state.
    module = {k: v for k, v in trained["denoiser"].state_dict().items() if "lora_" in k}
    torch.save({"module": module, "step": 7}, ckpt / "mp_rank_00_model_states.pt")
    targets = family.lora_targets(None) + _extra_targets(family.name)
    cfg = {
        "output_dir": str(run),
        "datasets": [{"name": "d", "path": str(tmp_path / "data")}],  # apart from the run folder
        "model": {"family": family.name},
        "train": {"lora": {"rank": 4, "alpha": 6.0, "targets": targets}},
    }
    (run / "resolved-config.yaml").write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(app, ["export", str(ckpt), "--format", "comfyui"])
    assert result.exit_code == 0, result.output
    exported = run / "export" / "step-000007" / "comfyui_lora.safetensors"
    import_lora(exported, tmp_path / "adapter", family)
    model = apply_adapter(family.load_denoiser(), tmp_path / "adapter")
    _assert_deltas(_deltas(model), trained["deltas"], "deepspeed checkpoint export")
