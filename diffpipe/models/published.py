"""Published denoiser configurations, written out so nothing has to be downloaded.

Each entry is the ``config.json`` of the model's denoiser folder as published
on the Hugging Face Hub (keys that equal the diffusers class's defaults are
left out), the parameter count its authors give, and the per-sample shapes of
the text conditioning the denoiser reads. ``diffpipe estimate`` and the
meta-device tests build the denoiser from these on the ``meta`` device: real
shapes, no memory, no weights.

``params`` is the published figure and ``params_digits`` how many significant
digits it was published with (``2`` for a headline figure like "20B"): a
check passes when the meta-device count, rounded to those digits, equals it,
or is within 1% of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Published:
    """One published model: its family, denoiser class and config, and what its authors state."""

    name: str
    family: str
    cls: str  # diffusers class name of the denoiser
    config: dict[str, Any]
    params: float  # the published parameter count of the denoiser
    params_digits: int  # significant digits the figure was published with
    source: str  # where the figure is published
    #: Per-sample shapes of the text conditioning (without the batch axis), as the family's loss reads it.
    text: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: VAE latent channels and spatial downsampling (image side / latent side).
    latent_channels: int = 4
    vae_factor: int = 8

    def build_meta(self) -> torch.nn.Module:
        """The denoiser at its published size, on the ``meta`` device (no memory, no weights)."""
        import diffusers

        with torch.device("meta"):
            return getattr(diffusers, self.cls)(**self.config)

    def params_match(self, count: int) -> bool:
        """Whether ``count`` matches the published figure (see the module docstring)."""
        rounded = float(f"{count:.{self.params_digits}g}")
        return rounded == self.params or abs(count - self.params) <= 0.01 * self.params


_SD_UNET = {"sample_size": 64, "cross_attention_dim": 768, "attention_head_dim": 8}
_SD2_UNET = {
    "sample_size": 96,
    "cross_attention_dim": 1024,
    "attention_head_dim": [5, 10, 20, 20],
    "use_linear_projection": True,
}
_SDXL_UNET = {
    "sample_size": 128,
    "block_out_channels": [320, 640, 1280],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": [5, 10, 20],
    "transformer_layers_per_block": [1, 2, 10],
    "cross_attention_dim": 2048,
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816,
}
_SD3_MEDIUM = {
    "sample_size": 128,
    "num_layers": 24,
    "num_attention_heads": 24,
    "caption_projection_dim": 1536,
    "pos_embed_max_size": 192,
}
_SD35_LARGE = {
    "sample_size": 128,
    "num_layers": 38,
    "num_attention_heads": 38,
    "caption_projection_dim": 2432,
    "pos_embed_max_size": 192,
    "qk_norm": "rms_norm",
}
_FLUX = {"in_channels": 64, "num_layers": 19, "num_single_layers": 38, "axes_dims_rope": [16, 56, 56]}
_SD3_TEXT = {"prompt_embeds": (333, 4096), "pooled_prompt_embeds": (2048,)}
_FLUX_TEXT = {"prompt_embeds": (512, 4096), "pooled_prompt_embeds": (768,)}

PUBLISHED: dict[str, Published] = {
    p.name: p
    for p in [
        Published(
            "sd15", "sd", "UNet2DConditionModel", _SD_UNET, 859.52e6, 5,
            "Stable Diffusion v1 model card / stable-diffusion-v1-5 unet (859.52M)",
            text={"prompt_embeds": (77, 768)},
        ),
        Published(
            "sd21", "sd", "UNet2DConditionModel", _SD2_UNET, 865.91e6, 5,
            "stabilityai/stable-diffusion-2-1 unet (865.91M)",
            text={"prompt_embeds": (77, 1024)},
        ),
        Published(
            "sdxl-base-1.0", "sdxl", "UNet2DConditionModel", _SDXL_UNET, 2.567e9, 4,
            "SDXL report (Podell et al. 2023): 2.6B UNet; stable-diffusion-xl-base-1.0 unet 2.567B",
            text={"prompt_embeds": (77, 2048), "pooled_prompt_embeds": (1280,)},
        ),
        Published(
            "sd3-medium", "sd3", "SD3Transformer2DModel", _SD3_MEDIUM, 2.0e9, 2,
            "stable-diffusion-3-medium model card: 2 billion parameter MMDiT",
            text=_SD3_TEXT, latent_channels=16,
        ),
        Published(
            "sd3.5-large", "sd3", "SD3Transformer2DModel", _SD35_LARGE, 8.1e9, 2,
            "stable-diffusion-3.5-large model card: 8.1 billion parameters",
            text=_SD3_TEXT, latent_channels=16,
        ),
        Published(
            "flux1-dev", "flux", "FluxTransformer2DModel", {**_FLUX, "guidance_embeds": True},
            11.90e9, 4, "black-forest-labs/FLUX.1-dev transformer (11.90B; '12 billion parameter')",
            text=_FLUX_TEXT, latent_channels=16,
        ),
        Published(
            "flux1-schnell", "flux", "FluxTransformer2DModel", {**_FLUX, "guidance_embeds": False},
            12e9, 2, "black-forest-labs/FLUX.1-schnell model card: 12 billion parameter",
            text=_FLUX_TEXT, latent_channels=16,
        ),
        Published(
            "flux1-kontext-dev", "flux-kontext", "FluxTransformer2DModel", {**_FLUX, "guidance_embeds": True},
            12e9, 2, "black-forest-labs/FLUX.1-Kontext-dev model card: 12 billion parameter",
            text=_FLUX_TEXT, latent_channels=16,
        ),
        Published(
            "chroma1-hd", "chroma", "ChromaTransformer2DModel", _FLUX, 8.9e9, 2,
            "lodestones/Chroma1-HD model card: 8.9B parameters",
            text={"prompt_embeds": (512, 4096), "prompt_attention_mask": (512,)}, latent_channels=16,
        ),
        Published(
            "lumina-image-2.0", "lumina2", "Lumina2Transformer2DModel", {"cap_feat_dim": 2304}, 2.6e9, 2,
            "Alpha-VLLM/Lumina-Image-2.0 model card: 2.6B parameters (Gemma-2-2B text, 2304 wide)",
            text={"prompt_embeds": (256, 2304), "prompt_attention_mask": (256,)}, latent_channels=16,
        ),
        Published(
            "qwen-image", "qwenimage", "QwenImageTransformer2DModel", {}, 20e9, 2,
            "Qwen/Qwen-Image model card: 20B MMDiT",
            text={"prompt_embeds": (512, 3584), "prompt_embeds_mask": (512,)}, latent_channels=16,
        ),
        Published(
            "qwen-image-edit", "qwenimage-edit", "QwenImageTransformer2DModel", {}, 20e9, 2,
            "Qwen/Qwen-Image-Edit model card: the 20B Qwen-Image MMDiT, same transformer config",
            # 512 caption tokens + up to 1456 vision tokens of the ~1024² control image.
            text={"prompt_embeds": (1968, 3584), "prompt_embeds_mask": (1968,)}, latent_channels=16,
        ),
        Published(
            "hidream-i1-full", "hidream", "HiDreamImageTransformer2DModel",
            {"patch_size": 2, "in_channels": 16, "out_channels": 16, "caption_channels": [4096, 4096],
             "axes_dims_rope": (64, 32, 32), "llama_layers": list(range(32)) + [31] * 16},
            17e9, 2, "HiDream-ai/HiDream-I1-Full model card: 17B parameters",
            text={"prompt_embeds_t5": (128, 4096), "prompt_embeds_llama3": (32, 128, 4096),
                  "pooled_prompt_embeds": (2048,)}, latent_channels=16,
        ),
        Published(
            "wan2.1-t2v-1.3b", "wan", "WanTransformer3DModel",
            {"num_attention_heads": 12, "attention_head_dim": 128, "ffn_dim": 8960, "num_layers": 30},
            1.42e9, 3,
            "Wan-AI/Wan2.1-T2V-1.3B(-Diffusers): dim 1536, 12 heads, ffn 8960, 30 layers; 1.42B parameters "
            "in its transformer weights (the model card's headline: '1.3B')",
            text={"prompt_embeds": (512, 4096)}, latent_channels=16,
        ),
        Published(
            "wan2.2-ti2v-5b", "wan", "WanTransformer3DModel",
            {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30,
             "in_channels": 48, "out_channels": 48},
            5e9, 1,
            "Wan-AI/Wan2.2-TI2V-5B(-Diffusers) model card: 5B dense model (dim 3072, 30 layers, 48-channel "
            "Wan2.2-VAE with 16x16 spatial compression)",
            text={"prompt_embeds": (512, 4096)}, latent_channels=48, vae_factor=16,
        ),
        Published(
            "wan2.2-t2v-a14b", "wan", "WanTransformer3DModel",
            {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40},
            14e9, 2,
            "Wan-AI/Wan2.2-T2V-A14B(-Diffusers) model card: two 14B experts (high and low noise), 14B active "
            "per step; each expert (transformer, transformer_2) is this denoiser",
            text={"prompt_embeds": (512, 4096)}, latent_channels=16,
        ),
        Published(
            "wan2.1-i2v-14b", "wan", "WanTransformer3DModel",
            {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 40,
             "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120},
            16.39e9, 4,
            "Wan-AI/Wan2.1-I2V-14B-480P(-Diffusers) transformer config (dim 5120, 40 heads, ffn 13824, 40 layers, "
            "36 input channels, 1280-dim CLIP image embedder with image key/value projections in every block): "
            "the 14B T2V transformer plus about 2.1B of image-conditioning weights (headline: '14B')",
            text={"prompt_embeds": (512, 4096)}, latent_channels=16,
        ),
        Published(
            "ltx-video-2b-v0.9", "ltxvideo", "LTXVideoTransformer3DModel", {}, 1.9e9, 2,
            "Lightricks/LTX-Video: 'a 1.9-billion-parameter' DiT (LTX-Video report, HaCohen et al. 2024; "
            "the '2B' of ltx-video-2b-v0.9)",
            text={"prompt_embeds": (128, 4096), "prompt_attention_mask": (128,)}, latent_channels=128,
            vae_factor=32,
        ),
        Published(
            "cogvideox-2b", "cogvideox", "CogVideoXTransformer3DModel", {}, 2e9, 1,
            "THUDM/CogVideoX-2b model card: 'CogVideoX-2B' (a one-digit headline; the transformer has 1.69B)",
            text={"prompt_embeds": (226, 4096)}, latent_channels=16,
        ),
        Published(
            "hunyuanvideo", "hunyuanvideo", "HunyuanVideoTransformer3DModel", {}, 13e9, 2,
            "tencent/HunyuanVideo (hunyuanvideo-community/HunyuanVideo): '13 billion parameters' (2 digits; "
            "the transformer has 12.82B)",
            text={"prompt_embeds": (256, 4096), "prompt_attention_mask": (256,), "pooled_prompt_embeds": (768,)},
            latent_channels=16,
        ),
        Published(
            "mochi-1-preview", "mochi", "MochiTransformer3DModel", {}, 10e9, 2,
            "genmo/mochi-1-preview model card: '10 billion parameter diffusion model' (AsymmDiT)",
            text={"prompt_embeds": (256, 4096), "prompt_attention_mask": (256,)}, latent_channels=12,
        ),
        Published(
            "cogview4-6b", "cogview4", "CogView4Transformer2DModel",
            {"num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 32}, 6e9, 1,
            "THUDM/CogView4-6B: 'CogView-4 model, which has 6B parameters' (THUDM/CogView4 README; a one-digit "
            "headline, the transformer has 6.37B)",
            text={"prompt_embeds": (512, 4096), "prompt_embeds_mask": (512,)}, latent_channels=16,
        ),
        Published(
            "cosmos-predict2-2b-t2i", "cosmos2", "CosmosTransformer3DModel",
            {"num_attention_heads": 16, "num_layers": 28, "rope_scale": (1.0, 4.0, 4.0),
             "extra_pos_embed_type": None},
            2e9, 1,
            "nvidia/Cosmos-Predict2-2B-Text2Image: 'text to image generation (2 billion parameters)' (Cosmos "
            "Predict2 model matrix; a one-digit headline, the transformer has 1.96B)",
            text={"prompt_embeds": (512, 1024)}, latent_channels=16,
        ),
        Published(
            "cosmos-predict2-14b-t2i", "cosmos2", "CosmosTransformer3DModel",
            {"num_attention_heads": 40, "num_layers": 36, "rope_scale": (1.0, 4.0, 4.0),
             "extra_pos_embed_type": None},
            14e9, 2,
            "nvidia/Cosmos-Predict2-14B-Text2Image: 'text to image generation (14 billion parameters)' (Cosmos "
            "Predict2 model matrix; the transformer has 14.27B)",
            text={"prompt_embeds": (512, 1024)}, latent_channels=16,
        ),
        Published(
            "cosmos-predict2-2b-video2world", "cosmos2-video", "CosmosTransformer3DModel",
            {"in_channels": 17, "num_attention_heads": 16, "num_layers": 28, "rope_scale": (1.0, 3.0, 3.0),
             "extra_pos_embed_type": None},
            2e9, 1,
            "nvidia/Cosmos-Predict2-2B-Video2World ('Video + Text based future visual world generation', Cosmos-"
            "Predict2 README; the 2B of its name, one digit; 16 latent + 1 condition-mask input channels, 1.96B)",
            text={"prompt_embeds": (512, 1024)}, latent_channels=16,
        ),
        Published(
            "cosmos-predict2-14b-video2world", "cosmos2-video", "CosmosTransformer3DModel",
            {"in_channels": 17, "num_attention_heads": 40, "num_layers": 36, "rope_scale": (20 / 24, 2.0, 2.0),
             "extra_pos_embed_type": None},
            14e9, 2,
            "nvidia/Cosmos-Predict2-14B-Video2World ('Video + Text based future visual world generation', Cosmos-"
            "Predict2 README; the 14B of its name; the transformer has 14.27B)",
            text={"prompt_embeds": (512, 1024)}, latent_channels=16,
        ),
        # Published sizes of families without an adapter yet (docs/families.md's table; no estimate).
        Published(
            "hunyuanimage-2.1", "hunyuanimage", "HunyuanImageTransformer2DModel", {"text_embed_2_dim": 1472},
            17e9, 2, "tencent/HunyuanImage-2.1 model card: 17B parameters",
        ),
    ]
}


def published(name: str) -> Published:
    """The published model ``name``; a clear error naming the known ones."""
    if name not in PUBLISHED:
        raise ValueError(f"unknown published model {name!r}; known: {', '.join(sorted(PUBLISHED))}")
    return PUBLISHED[name]


def for_family(family: str) -> list[Published]:
    """The published models of one family (the first is its flagship)."""
    return [p for p in PUBLISHED.values() if p.family == family]
