"""``ltx2``: the tiny flavor's configs and the published model (see ``diffpipe.models.spec``)."""

from __future__ import annotations

from diffpipe.families.ltxvideo.flavors import TINY_SCHEDULER as LTX_TINY_SCHEDULER
from diffpipe.models import tiny
from diffpipe.models.spec import Published

# -- tiny flavor ----------------------------------------
#: Three spatio-temporal downsamplings without pixel patching: 8x spatial, 8x temporal (so ``8k+1`` frames).
TINY_VAE = {
    "latent_channels": 8,
    "block_out_channels": (8, 8, 8, 8),
    "decoder_block_out_channels": (8, 8, 8),
    "layers_per_block": (1, 1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1),
    "spatio_temporal_scaling": (True, True, True, False),
    "decoder_spatio_temporal_scaling": (True, True, True),
    "decoder_inject_noise": (False, False, False, False),
    "downsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal", "spatiotemporal"),
    "upsample_residual": (False, False, False),
    "upsample_factor": (1, 1, 1),
    "patch_size": 1,
}

#: The joint audio-video transformer: a video stream of width 16 and an audio stream of width 16.
TINY_TRANSFORMER = {
    "in_channels": 8,
    "out_channels": 8,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "cross_attention_dim": 16,
    "vae_scale_factors": (8, 8, 8),
    "audio_in_channels": 8,
    "audio_out_channels": 8,
    "audio_num_attention_heads": 2,
    "audio_attention_head_dim": 8,
    "audio_cross_attention_dim": 16,
    "num_layers": 2,
    "caption_channels": 32,
}

#: The audio side the pipeline samples with (mel spectrogram latents and a vocoder); never trained.
TINY_AUDIO_VAE = {"base_channels": 8, "ch_mult": (1, 2), "num_res_blocks": 1, "latent_channels": 2, "mel_bins": 16}
TINY_VOCODER = {
    "in_channels": 32,  # the audio VAE's 2 output channels x 16 mel bins
    "hidden_channels": 8,
    "upsample_kernel_sizes": [4, 4],
    "upsample_factors": [2, 2],
    "resnet_kernel_sizes": [3],
    "resnet_dilations": [[1]],
    "output_sampling_rate": 16000,
}

#: Gemma 3 (with the vision tower its class carries): the tiny Gemma decoder; 224 px images in 14 px
#: patches keep the default 256 image tokens a whole pooling of the 16x16 patch grid.
TINY_GEMMA = tiny.GEMMA
TINY_VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
               "image_size": 224, "patch_size": 14}
TINY_LENGTH = 64  # prompt tokens (a multiple of the connectors' 8 registers)

#: The text connectors read every hidden state of the tiny Gemma (its 2 layers and the embeddings).
TINY_CONNECTORS = {
    "caption_channels": TINY_GEMMA["hidden_size"],
    "text_proj_in_factor": TINY_GEMMA["num_hidden_layers"] + 1,
    "video_connector_num_attention_heads": 2,
    "video_connector_attention_head_dim": 16,
    "video_connector_num_layers": 1,
    "video_connector_num_learnable_registers": 8,
    "audio_connector_num_attention_heads": 2,
    "audio_connector_attention_head_dim": 16,
    "audio_connector_num_layers": 1,
    "audio_connector_num_learnable_registers": 8,
    "connector_rope_base_seq_len": TINY_LENGTH,
}

#: LTX-2's scheduler is LTX-Video's.
TINY_SCHEDULER = LTX_TINY_SCHEDULER


#: Published models, the flagship first.
PUBLISHED: list[Published] = [
    Published(
        "ltx-2-19b", "ltx2", "LTX2VideoTransformer3DModel", {}, 19e9, 2,
        "Lightricks/LTX-2: 'a 19B-parameter' audio-video DiT (ltx-2-19b-dev; the class defaults of diffusers' "
        "LTX2VideoTransformer3DModel: 48 blocks of a 4096-wide video and a 2048-wide audio stream)",
        text={"prompt_embeds": (1024, 3840), "prompt_attention_mask": (1024,)}, latent_channels=128,
        vae_factor=32,
    ),
]
