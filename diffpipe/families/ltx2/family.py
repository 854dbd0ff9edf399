"""Family ``ltx2``: LTX-2, a joint audio-video DiT; diffpipe trains its video stream.

Components and names follow ``LTX2Pipeline``: ``vae`` (AutoencoderKLLTX2Video: causal 3-D VAE, 32x spatial
and 8x temporal compression at full size, so clips have ``8k+1`` frames; latents normalised by its
``latents_mean`` / ``latents_std`` and ``scaling_factor`` as the pipeline's ``_normalize_latents``),
``text_encoder`` (Gemma 3: every hidden state of the caption, left-padded to ``max_sequence_length``, as
the pipeline's ``encode_prompt``) + ``tokenizer``, ``connectors`` (LTX2TextConnectors: the frozen
transformers that turn those states into the video and audio streams' text; padding replaced by learned
registers), ``transformer`` (LTX2VideoTransformer3DModel on latents packed by the pipeline's
``_pack_latents``, fed ``sigma * 1000`` and the rotary positions of the clip at 24 fps, the pipeline's
default ``frame_rate``), ``scheduler`` (FlowMatchEulerDiscreteScheduler; training shifts ``t`` by
``exp(mu)`` for the clip's token count, as the pipeline's sampling does), and the audio side the
pipeline samples with (``audio_vae``, ``vocoder``). The transformer predicts the velocity ``noise - x0``.

**What is trained: the video stream.** The cache holds the connectors' video text (the frozen text path
ends there, so each caption is stored once at the transformer's text width) and no audio: the audio VAE
encodes mel spectrograms, and the pinned libraries compute none from a clip's sound. The transformer runs
with its modalities isolated (``isolate_modalities``: no audio-to-video or video-to-audio attention), so
the video prediction does not depend on the audio stream, which gets one placeholder token and whose
output is unused; this is the video-only training of Lightricks' own trainer. The default LoRA targets
are the video stream's layers; the audio stream and the cross-modal attention keep their weights. At
sampling the pipeline generates sound beside the video as before (the samples keep the video).

``model.variant: i2v`` trains image-to-video (``LTX2ImageToVideoPipeline``: the same weights; a local
folder saved with that pipeline is detected): each item's control image (usually
``control_from_first_frame``) is cached as its one-frame latents, which replace the first latent frame,
clean, with timestep 0 on its tokens, as the pipeline's ``prepare_latents`` and its per-token timestep
build the input; that frame is left out of the loss (the pipeline never updates it). The cache holds the
VAE's mode, as the pipeline encodes its image (``argmax``). ``model.first_frame_p`` gives the first frame
to each item with that probability only, the others training as text-to-video on the same clip, so one
LoRA serves both pipelines (Lightricks' trainer's ``first_frame_conditioning_p``).

LTX-2.3 folders load the same way: gated attention and prompt modulation in both streams (fed ``sigma``),
no caption projection in the transformer, and per-modality text projections in the connectors, whose video
output the cache then holds at the attention's width (tested on a tiny rebuild of that architecture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from transformers import AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration

from diffpipe.config import SampleConfig
from diffpipe.families.ltx2 import flavors
from diffpipe.families.ltx2.layers import ltx2_layers
from diffpipe.families.ltxvideo.family import LTXGeometry
from diffpipe.hub import pipeline_class
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Model, Models, TextBundle, TextEncoder, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import llm_tokenizer

MAX_LENGTH = 1024  # LTX2Pipeline's default max_sequence_length
AUDIO_VAE = Model(AutoencoderKLLTX2Audio, flavors.TINY_AUDIO_VAE)
VOCODERS = {cls.__name__: cls for cls in (LTX2Vocoder, LTX2VocoderWithBWE)}


def _tiny_connectors(tokenizer: Any, seed: int) -> torch.nn.Module:
    with common.seeded(seed, "ltx2.connectors"):
        return LTX2TextConnectors(**flavors.TINY_CONNECTORS).eval()


class LTX2Family(LTXGeometry, Family):
    #: The i2v variant's pipeline instances are LTX2ImageToVideoPipeline.
    models = Models(AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel, FlowMatchEulerDiscreteScheduler,
                    LTX2Pipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        **one_text_encoder(AutoTokenizer, lambda: llm_tokenizer(flavors.TINY_LENGTH), Gemma3ForConditionalGeneration,
                           Gemma3Config, flavors.TINY_GEMMA, "ltx2.text_encoder", vision=flavors.TINY_VISION,
                           stream="gemma"),
        "connectors": TextEncoder(LTX2TextConnectors, LTX2TextConnectors, _tiny_connectors, tokenizer="tokenizer"),
    }
    #: ``t2v``, and ``i2v`` (the first latent frame is the control image's, clean; the same checkpoint).
    variants: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    mixes_first_frame = True
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    is_video = True
    fps = 24.0
    #: The video stream's self and text attention and feed-forward of every block (not ``audio_*``, not the
    #: cross-modal attention: PEFT matches whole name parts, so ``attn1.to_q`` is not ``audio_attn1.to_q``).
    default_lora_targets: ClassVar[list[str]] = [*targets.attention("attn1"), *targets.attention("attn2"),
                                                 *targets.feed_forward()]

    def __init__(self, cfg):
        super().__init__(cfg)

        # One checkpoint serves both: a folder saved with the I2V pipeline defaults to i2v, any other to t2v.
        saved = pipeline_class(Path(cfg.path) / "model_index.json") if cfg.flavor == "local" else None
        self.variant = cfg.variant or ("i2v" if saved == LTX2ImageToVideoPipeline.__name__ else "t2v")
        #: The image-to-video variant trains on control images (instance attributes: one variant).
        self.uses_control = self.variant == "i2v"
        self.pipeline_class = LTX2ImageToVideoPipeline if self.uses_control else LTX2Pipeline
        if cfg.first_frame_p is not None and not self.uses_control:
            raise ValueError("model.first_frame_p: only ltx2 variant i2v gives first frames (it needs each "
                             "item's control image); set model.variant: i2v")

    # -- components ------------------------------------------------------------------
    def text_pipeline(self, encoders: Any) -> Any:
        return LTX2Pipeline(vae=None, audio_vae=None, transformer=None, vocoder=None, scheduler=None,
                            **encoders.parts)

    def load_pipeline(self) -> Any:
        """The stock pipeline with every component, the audio VAE and vocoder included (its samples
        generate sound beside the video)."""
        text = self.load_text_encoders()
        return self.pipeline_class(
            vae=self.load_vae(), transformer=self.load_denoiser(), scheduler=self.inference_scheduler(),
            audio_vae=self._model(AUDIO_VAE, "audio_vae"), vocoder=self._model(self._vocoder_model(), "vocoder"),
            **text.parts,
        )

    def _vocoder_model(self) -> Model:
        """The vocoder the folder's ``model_index.json`` names (LTX-2.3's has a bandwidth extension);
        ``LTX2Vocoder`` for the tiny flavor."""
        index = Path(self.cfg.path or "") / "model_index.json"
        name = json.loads(index.read_text()).get("vocoder", [None, None])[1] if self.cfg.path and index.is_file() \
            else None
        return Model(VOCODERS.get(name, LTX2Vocoder), flavors.TINY_VOCODER)

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        """The connectors' video text and mask for each caption, from the pipeline's own ``encode_prompt``
        (Gemma's stacked hidden states, left-padded) and its ``connectors`` call."""
        embeds, mask, _, _ = self.pipeline_prompt(encoders, captions)
        with torch.no_grad():
            text, _, text_mask = encoders.connectors(embeds, mask, padding_side=encoders.tokenizer.padding_side)
        return {"prompt_embeds": text.float(), "prompt_attention_mask": text_mask.float()}

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Packed flow-matching inputs of the video stream, its text and mask, the latent grid and frame
        rate, the modalities isolated (:meth:`predict` adds the audio placeholder). The grid is plain
        numbers (from shapes): the loss also runs on the meta device.

        ``i2v``: the first latent frame is the control image's latents (``control``, ``[B, C, 1, h, w]``),
        clean, its tokens at timestep 0 (the pipeline's ``timestep * (1 - conditioning_mask)``; the audio
        stream and the prompt modulation keep the clip's timestep), and left out of the loss; with
        ``model.first_frame_p``, only for the items drawn (the others as text-to-video)."""
        if self.variant == "i2v":
            video.require_first_frame(control, "i2v")
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        _, _, f, h, w = x0.shape
        c = self._denoiser_config
        p, pt = int(c.get("patch_size", 1)), int(c.get("patch_size_t", 1))

        def pack(x: torch.Tensor) -> torch.Tensor:
            return LTX2Pipeline._pack_latents(x, p, pt)

        sigma = obj.shift_timesteps(t, o.shift or self.timestep_shift((f // pt) * (h // p) * (w // p)))
        timestep = sigma * self._scheduler_config.get("num_train_timesteps", 1000)
        device = x0.device
        noisy = obj.flow_interpolate(x0, noise, sigma)
        weights = self.loss_mask(mask, x0, o)
        if self.variant == "i2v":
            given = torch.zeros_like(x0[:, :1])
            given[:, :, 0] = self._first_frame_items(x0.shape[0], generator).to(given).view(-1, 1, 1, 1)
            noisy = given * control[:, :, :1].to(noisy) + (1 - given) * noisy
            keep = (1 - given).expand(x0.shape)  # a given first frame is not denoised
            weights = keep if weights is None else keep * weights
        inputs = {
            "hidden_states": pack(noisy).to(dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
            "timestep": timestep,
            "sigma": timestep,  # the pipeline passes its timestep as both (LTX-2.3 reads sigma)
            "encoder_attention_mask": text["prompt_attention_mask"].to(device=device),
            "num_frames": f // pt,
            "height": h // p,
            "width": w // p,
            "fps": self.fps,
            "audio_num_frames": 1,
            "isolate_modalities": True,
            "use_cross_timestep": True,
        }
        if self.variant == "i2v":
            inputs["timestep"] = timestep[:, None] * (1 - pack(given).squeeze(-1))
            inputs["audio_timestep"] = timestep
        return Prepared(inputs, pack(obj.flow_target(x0, noise)), mask=None if weights is None else pack(weights))

    def _first_frame_items(self, batch: int, generator: torch.Generator) -> torch.Tensor:
        """``[B]`` 1 for the items given their first frame: all, or each with probability
        ``model.first_frame_p`` (drawn from ``generator`` after the timesteps and noise)."""
        p = self.cfg.first_frame_p
        if p is None or p >= 1:
            return torch.ones(batch)
        return (torch.rand(batch, generator=generator, device=generator.device) < p).float().cpu()

    def audio_placeholder(self, denoiser: torch.nn.Module, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """The audio stream's inputs while the video stream trains: one zero latent token and one zero text
        token (at the width of the audio text: the caption projection's input for LTX-2.0, the audio
        attention's for 2.3), sized from the denoiser's own config (the estimate runs a published one)."""
        c = common.unwrap(denoiser).config
        b = hidden_states.shape[0]
        text_width = c.caption_channels if c.use_prompt_embeddings else c.audio_cross_attention_dim
        return {"audio_hidden_states": hidden_states.new_zeros(b, 1, c.audio_in_channels),
                "audio_encoder_hidden_states": hidden_states.new_zeros(b, 1, text_width),
                "audio_encoder_attention_mask": hidden_states.new_ones(b, 1, dtype=torch.float32)}

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The video stream's prediction; the audio stream's, on its placeholder, is dropped."""
        inputs = prepared.inputs
        return denoiser(**inputs, **self.audio_placeholder(denoiser, inputs["hidden_states"]), return_dict=False)[0]

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(packed noisy, text, video timestep, text mask, (F, h, w), fps, clip timestep)``: the video
        timestep is per token under ``i2v``; the clip's (``sigma * 1000``) drives the audio stream and the
        prompt modulation."""
        i = prepared.inputs
        device = i["hidden_states"].device
        return (i["hidden_states"], i["encoder_hidden_states"], i["timestep"], i["encoder_attention_mask"],
                torch.tensor([i["num_frames"], i["height"], i["width"]], device=device),
                torch.tensor(i["fps"], device=device), i.get("audio_timestep", i["timestep"]))

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        if self.variant == "i2v" and not cfg.images:
            raise ValueError("sample.images: LTX-2 i2v samples start from an image; give one per sample.prompts")
        return {**super().sample_kwargs(cfg), "frame_rate": self.fps, "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per block, output (``layers.py``): the video stream with the audio
        placeholder carried along and the modalities isolated, as the loss runs it. Input tuple
        :meth:`layer_inputs`; output ``(packed prediction,)``."""
        return ltx2_layers(common.unwrap(denoiser))
