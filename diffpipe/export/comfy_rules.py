"""How ComfyUI reads a LoRA file: which file names land on which model weight, at which strength.

ComfyUI is not a dependency, so its rules are restated here in our own code from what its
public source does: ``comfy/lora.py`` (``model_lora_keys_unet``: which file names map to
which model weight; ``load_lora``: which tensors make a patch), ``comfy/weight_adapter``
(the patch arithmetic) and ``comfy/supported_models.py`` (the renames applied to a
HunyuanVideo checkpoint on load). The export's verify step (``export.verify``) and the tests
check our files against these rules, never against the export's own tables: a name ComfyUI
does not map is a LoRA that silently does nothing, a missing alpha is scale 1.0 and the
safetensors header is never read.
"""

from __future__ import annotations

import re

import torch

from diffpipe.models.keymap import Layer

# ComfyUI's HunyuanVideo model is built from Flux's layers: on load it renames the
# original checkpoint's weights by these substring replacements, in this order.
HUNYUAN_LOAD_RENAMES = [
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    ("_attn_proj.", "_attn.proj."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
]
# ...and its LoRA key map gives every model weight one more file name, by these replacements
# (the block layers' original names; the embedders keep ComfyUI's names).
HUNYUAN_LORA_RENAMES = [
    ("_mod.lin.", "_mod.linear."),
    ("_attn.qkv.", "_attn_qkv."),
    ("_attn.proj.", "_attn_proj."),
    ("mlp.0.", "mlp.fc1."),
    ("mlp.2.", "mlp.fc2."),
    (".modulation.lin.", ".modulation.linear."),
]


# ComfyUI's Z-Image model keeps the original checkpoint's names (fused ``attention.qkv``); its LoRA key
# map (``z_image_to_diffusers`` in ``comfy/utils.py``, used by ``model_lora_keys_unet`` for Lumina 2 models)
# gives each diffusers module name, under ``diffusion_model.`` and ``transformer.``, the model weight it
# lands on: these renames, and q, k, v as the first, second and third row blocks of ``qkv``.
ZIMAGE_RENAMES = [
    (".attention.to_out.0", ".attention.out"),
    ("all_x_embedder.2-1", "x_embedder"),
    ("all_final_layer.2-1.", "final_layer."),
]
_ZIMAGE_QKV = re.compile(r"(.+)\.attention\.to_([qkv])")


def _replace_all(name: str, rules: list[tuple[str, str]]) -> str:
    for old, new in rules:
        name = name.replace(old, new)
    return name


def model_weight(family: str, original: str) -> str:
    """The name of an original checkpoint layer's weight in ComfyUI's model (``diffusion_model.`` + ...)."""
    key = f"diffusion_model.{original}.weight"
    if family == "hunyuanvideo":
        key = _replace_all(key, HUNYUAN_LOAD_RENAMES)
    if family == "zimage":  # a third of the fused qkv is labelled by its part: ``...qkv.weight[q]``
        if m := _ZIMAGE_QKV.fullmatch(original):
            return f"diffusion_model.{m[1]}.attention.qkv.weight[{m[2]}]"
        key = _replace_all(key, ZIMAGE_RENAMES)
    return key


def lora_key_map(family: str, weights: list[str]) -> dict[str, str]:
    """File layer name -> ComfyUI model weight, for these model weights (``model_lora_keys_unet``)."""
    key_map = {}
    for w in weights:
        if family == "zimage":
            if w.endswith("]"):  # one part of the fused qkv: only its diffusers name maps to it
                block = w.removeprefix("diffusion_model.").removesuffix(f".attention.qkv.weight[{w[-2]}]")
                diffusers = f"{block}.attention.to_{w[-2]}"
            else:
                diffusers = w.removeprefix("diffusion_model.").removesuffix(".weight")
                for old, new in ZIMAGE_RENAMES:
                    diffusers = diffusers.replace(new, old)
            key_map[f"diffusion_model.{diffusers}"] = key_map[f"transformer.{diffusers}"] = w
            if w.endswith("]"):
                continue
        bare = w.removeprefix("diffusion_model.").removesuffix(".weight")
        key_map["lora_unet_" + bare.replace(".", "_")] = w
        key_map[f"diffusion_model.{bare}"] = w  # "generic lora format"
        if family == "hunyuanvideo":
            renamed = _replace_all(w, HUNYUAN_LORA_RENAMES).removeprefix("diffusion_model.").removesuffix(".weight")
            key_map[f"diffusion_model.{renamed}"] = w
            key_map[f"transformer.{renamed}"] = w
    return key_map


def placed_layers(family: str, layers: list[Layer]) -> dict[str, Layer]:
    """File layer name -> the key-map layer whose model weight ComfyUI patches with it.

    The model weight comes from the layer's original checkpoint name (``model_weight``), never from
    the names the export writes; SD 1.x/2.x also answer to sd-scripts' diffusers-path names, which
    ComfyUI maps back to the checkpoint (its ``unet_to_diffusers``)."""
    weight_of = {model_weight(family, la.original): la for la in layers}
    names = lora_key_map(family, list(weight_of))
    if family == "sd":
        names |= {la.kohya: model_weight(family, la.original) for la in layers}
    return {name: weight_of[w] for name, w in names.items()}


def lora_patches(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer name -> the weight delta ComfyUI adds at strength 1 (plain LoRA tensors).

    ``alpha / rank`` when the file has ``.alpha``, else 1.0; down/up under the kohya
    (``lora_down``/``lora_up``) or PEFT (``lora_A``/``lora_B``) names.
    """
    out = {}
    for key, up in tensors.items():
        for up_suffix, down_suffix in ((".lora_up.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_A.weight")):
            if key.endswith(up_suffix):
                name = key.removesuffix(up_suffix)
                down = tensors[name + down_suffix]
                alpha = tensors.get(name + ".alpha")
                scale = alpha.item() / down.shape[0] if alpha is not None else 1.0
                delta = up.flatten(1).double() @ down.flatten(1).double() * scale
                out[name] = delta.reshape(up.shape[0], *down.shape[1:]).float()
    return out


def lycoris_patches(tensors: dict[str, torch.Tensor]) -> dict[str, object]:
    """Layer name -> ``make(weight_shape)``: the delta ComfyUI adds for a LoKr or LoHa layer at strength 1.

    LoKr: ``kron(w1, w2)`` (each given whole or as ``_a @ _b``); ``alpha / dim`` only when the
    file has alpha and a factored matrix (dim: the rank of ``w2_b``, else of ``w1_b``), else 1.0.
    LoHa: ``(w1_a @ w1_b) * (w2_a @ w2_b)``; ``alpha / rank(w1_b)`` when the file has alpha, else 1.0.
    """
    names = {key.rsplit(".", 1)[0] for key in tensors if key.rsplit(".", 1)[-1].startswith(("lokr_", "hada_"))}
    out = {}
    for name in names:
        t = {k.rsplit(".", 1)[-1]: v.double() for k, v in tensors.items() if k.rsplit(".", 1)[0] == name}
        alpha = t.get("alpha")
        if "hada_w1_a" in t:
            scale = alpha.item() / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
            diff = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
        else:
            dim = None
            w1 = t.get("lokr_w1")
            if w1 is None:
                dim = t["lokr_w1_b"].shape[0]
                w1 = t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t.get("lokr_w2")
            if w2 is None:
                dim = t["lokr_w2_b"].shape[0]
                w2 = t["lokr_w2_a"] @ t["lokr_w2_b"]
            if w2.dim() == 4:
                w1 = w1[:, :, None, None]
            scale = alpha.item() / dim if alpha is not None and dim is not None else 1.0
            diff = torch.kron(w1, w2)

        def make(shape, diff=diff, scale=scale):
            return (scale * diff).reshape(shape).float()

        out[name] = make
    return out


# ComfyUI's CLIP LoRA key map (``model_lora_keys_clip`` in ``comfy/lora.py``): for each encoder layer ``b``
# and each of these modules ``c``, the weight ``text_model.encoder.layers.b.c`` of SD 1.x's CLIP-L answers to
# ``lora_te_text_model_encoder_layers_b_<LORA_CLIP_MAP[c]>`` (and ``lora_te1_``); SDXL's CLIP-L to ``lora_te1_``
# and its CLIP-G to ``lora_te2_``. No other text-encoder module has a kohya name there.
LORA_CLIP_MAP = {
    "mlp.fc1": "mlp_fc1", "mlp.fc2": "mlp_fc2", "self_attn.k_proj": "self_attn_k_proj",
    "self_attn.q_proj": "self_attn_q_proj", "self_attn.v_proj": "self_attn_v_proj",
    "self_attn.out_proj": "self_attn_out_proj",
}


def clip_lora_keys(encoders: dict[str, int], sdxl: bool) -> dict[str, tuple[str, str]]:
    """ComfyUI's LoRA names of the CLIP weights: name -> (encoder, weight path); ``encoders``: the
    pipeline's text encoders and their layer counts (``text_encoder``: CLIP-L, ``text_encoder_2``: CLIP-G)."""
    out = {}
    for encoder, layers in encoders.items():
        prefixes = (["lora_te2"] if encoder == "text_encoder_2" else ["lora_te1"] if sdxl else ["lora_te", "lora_te1"])
        for b in range(layers):
            for c, short in LORA_CLIP_MAP.items():
                for prefix in prefixes:
                    out[f"{prefix}_text_model_encoder_layers_{b}_{short}"] = (encoder, f"text_model.encoder.layers.{b}.{c}")
    return out


def clip_diffusers_lora_keys(encoders: dict[str, int]) -> dict[str, tuple[str, str]]:
    """ComfyUI's names for the CLIP weights in a diffusers-format LoRA file (the same map, its "diffusers lora"
    entries): ``<encoder>.text_model.encoder.layers.b.c`` for ``text_encoder`` and ``text_encoder_2``, the module
    path as transformers 4 named it; a key without ``text_model.`` answers to no weight there."""
    return {f"{encoder}.text_model.encoder.layers.{b}.{c}": (encoder, f"text_model.encoder.layers.{b}.{c}")
            for encoder, layers in encoders.items() for b in range(layers) for c in LORA_CLIP_MAP}
