"""Family ``sd3``: Stable Diffusion 3 / 3.5 (MMDiT), three text encoders, flow matching.

Components and names follow ``StableDiffusion3Pipeline``: ``vae``,
``text_encoder`` / ``text_encoder_2`` (CLIP-L and CLIP-G with projection:
penultimate hidden states side by side, pooled outputs concatenated) with
``tokenizer`` / ``tokenizer_2``, ``text_encoder_3`` (T5) + ``tokenizer_3``,
``transformer`` (SD3Transformer2DModel), ``scheduler``
(FlowMatchEulerDiscreteScheduler, fixed shift 3). Training is rectified flow
with logit-normal timesteps by default, or the SD3 paper's timestep densities
and loss weightings (Esser et al. 2024, section 3.1) through
``train.objective.weighting_scheme`` (``logit_normal``, ``mode``,
``sigma_sqrt``, ``cosmap``, ``none``; pure functions in
:mod:`diffpipe.models.objectives`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextModelWithProjection,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from diffpipe.config import ObjectiveConfig, SampleConfig
from diffpipe.families.sd3 import flavors
from diffpipe.families.sd3.layers import sd3_layers
from diffpipe.models import _common as common
from diffpipe.models import objectives as obj
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextEncoder, TextPart, Tokenizer, clip_text_encoder
from diffpipe.models.tokenizers import t5_tokenizer

#: StableDiffusion3Pipeline's default T5 length.
T5_LENGTH = 256


class SD3Family(Family):
    vae_shift = True
    models = Models(AutoencoderKL, SD3Transformer2DModel, FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline,
                    flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        **clip_text_encoder("sd3.text_encoder", "text_encoder", cls=CLIPTextModelWithProjection, stream="clip_l"),
        **clip_text_encoder("sd3.text_encoder_2", cls=CLIPTextModelWithProjection, stream="clip_g"),
        "tokenizer_3": Tokenizer(T5TokenizerFast, lambda: t5_tokenizer(flavors.TINY_T5_LENGTH), "t5"),
        "text_encoder_3": TextEncoder(T5EncoderModel, T5Config,
                                      common.tiny_text_model(T5EncoderModel, T5Config, flavors.TINY_T5,
                                                             "sd3.text_encoder_3", common.T5_IDS)),
    }
    prompt_tokens = (flavors.TINY_T5_LENGTH, T5_LENGTH)
    prompt_tokenizer = "tokenizer_3"
    #: diffusers' SD3 DreamBooth LoRA example: attention of both streams
    #: (image ``to_*``, text ``add_*_proj`` / ``to_add_out``) and both
    #: feed-forwards of every joint block.
    default_lora_targets: ClassVar[list[str]] = targets.dual_stream()
    #: How many CLIP text encoders feed the pooled and sequence embeddings.
    clip_components: ClassVar[tuple[str, ...]] = ("text_encoder", "text_encoder_2")

    # -- encoding --------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        # Exactly StableDiffusion3Pipeline.encode_prompt (no clip_skip).
        e, clip_embeds, pooled = encoders, [], []
        with torch.no_grad():
            for tok, enc in ((e.tokenizer, e.text_encoder), (e.tokenizer_2, e.text_encoder_2)):
                ids = tok(captions, padding="max_length", max_length=tok.model_max_length, truncation=True,
                          return_tensors="pt").input_ids
                out = enc(ids.to(next(enc.parameters()).device), output_hidden_states=True)
                pooled.append(out[0])
                clip_embeds.append(out.hidden_states[-2])
            ids = e.tokenizer_3(captions, padding="max_length", max_length=e.max_sequence_length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
            t5 = e.text_encoder_3(ids.to(next(e.text_encoder_3.parameters()).device))[0]
        clip = torch.cat(clip_embeds, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return {"prompt_embeds": torch.cat([clip, t5], dim=-2).float(),
                "pooled_prompt_embeds": torch.cat(pooled, dim=-1).float()}

    # -- training ----------------------------------------------------------------
    def sample_t(self, o: ObjectiveConfig, b: int, generator: torch.Generator) -> torch.Tensor:
        """Training timesteps before the shift.

        ``train.objective.weighting_scheme`` when set (its density), else
        ``timestep_sampling`` (default logit-normal).
        """
        if o.weighting_scheme is not None:
            return obj.sample_weighting_scheme(o.weighting_scheme, b, generator, logit_mean=o.logit_mean,
                                               logit_std=o.logit_std, mode_scale=o.mode_scale,
                                               device=generator.device)
        if o.timestep_sampling == "uniform":
            return obj.sample_uniform(b, generator, device=generator.device)
        return obj.sample_logit_normal(b, generator, mean=o.logit_mean, std=o.logit_std, device=generator.device)

    def shift_for(self, x0: torch.Tensor) -> float:
        return float(self._scheduler_config.get("shift", 3.0))

    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs; ``weights`` by ``train.objective.weighting_scheme`` (None: unweighted)."""
        f = self.flow_draw(latents, generator, objective, t, noise, sample_t=self.sample_t)
        device = f.x0.device
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            # The pipeline passes the scheduler's timesteps: sigma * 1000.
            "timestep": (f.sigma * 1000).to(dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
            "encoder_hidden_states": text["prompt_embeds"].to(device=device, dtype=dtype),
        }
        return self.flow_prepared(f, inputs, mask, objective,
                                  weights=obj.weighting_scheme_weights(objective.weighting_scheme, f.sigma))

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per joint block, output (``layers.py``)."""
        return sd3_layers(common.unwrap(denoiser))
