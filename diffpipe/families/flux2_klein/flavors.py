"""``flux2-klein``: the tiny flavor's configs and the published models (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
TINY_LENGTH = 128  # the tiny tokenizer spells the chat template's words out character by character

#: FLUX.2's VAE (AutoencoderKLFlux2) at tiny width: factor 2, 4 latent channels, patchified 2x2 into 16
#: channels and normalised by its batch-norm statistics.
TINY_VAE = {
    "block_out_channels": (32, 64),
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "latent_channels": 4,
    "layers_per_block": 1,
    "sample_size": 64,
}

#: The pipeline stacks the text encoder's hidden states after layers 9, 18 and 27 (its default
#: ``text_encoder_out_layers``), so the tiny Qwen3 keeps 28 narrow layers; the real ones have 36.
TINY_QWEN3 = {**tiny.LLAMA, "head_dim": 8, "num_hidden_layers": 28}

TINY_TRANSFORMER = {
    "patch_size": 1,
    "in_channels": 16,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 3 * TINY_QWEN3["hidden_size"],
    "timestep_guidance_channels": 32,
    "axes_dims_rope": (4, 4, 4, 4),
    "guidance_embeds": False,
}

#: FLUX.2 [klein]'s scheduler: flow matching with the resolution-dependent (dynamic) shift.
TINY_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                  "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def _klein(heads: int, double: int, single: int, text_width: int) -> dict:
    return {"num_attention_heads": heads, "attention_head_dim": 128, "num_layers": double,
            "num_single_layers": single, "in_channels": 128, "joint_attention_dim": 3 * text_width,
            "mlp_ratio": 3.0, "guidance_embeds": False}


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "flux2-klein-4b", "flux2-klein", "Flux2Transformer2DModel", _klein(24, 5, 20, 2560), 4e9, 1,
        "black-forest-labs/FLUX.2-klein-4B and -base-4B model cards: 4B (5 double, 20 single blocks, 3072 wide; "
        "Qwen3-4B text, hidden states of 3 layers stacked: 7680)",
        text={"prompt_embeds": (512, 7680)}, latent_channels=128, vae_factor=16,
    ),
    Published(
        "flux2-klein-9b", "flux2-klein", "Flux2Transformer2DModel", _klein(32, 8, 24, 4096), 9e9, 1,
        "black-forest-labs/FLUX.2-klein-9B and -base-9B model cards: 9B (8 double, 24 single blocks, 4096 wide; "
        "Qwen3-8B text: 12288)",
        text={"prompt_embeds": (512, 12288)}, latent_channels=128, vae_factor=16,
    ),
]
