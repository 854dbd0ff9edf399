"""Family ``kandinsky5``: Kandinsky 5.0 text-to-video (a text and a visual DiT stack), Qwen2.5-VL + CLIP text.

Components and names follow ``Kandinsky5T2VPipeline``: ``vae``
(AutoencoderKLHunyuanVideo: 8x spatial, 4x temporal compression, so clips
have ``4k+1`` frames; latents times ``scaling_factor``, as the pipeline
divides them before decoding), ``text_encoder``
(Qwen2_5_VLForConditionalGeneration: the last hidden states of the caption
inside the pipeline's video-description template, the template's tokens cut
off) + ``tokenizer``, ``text_encoder_2`` (CLIP, pooled output) +
``tokenizer_2``, ``transformer`` (Kandinsky5Transformer3DModel on
channel-last latents ``[B, F, h, w, C]``, beside zero visual-condition
channels and a zero mask when its ``visual_cond`` is set, fed ``sigma x
1000``, the pipeline's rotary positions and its resolution-dependent rotary
scale), ``scheduler`` (FlowMatchEulerDiscreteScheduler; training shifts ``t``
by its ``shift``). It predicts the velocity ``noise - x0``. Clips are
resampled to 24 fps.

Prompts have their own length: the pipeline encodes a prompt without
padding and its transformer has no text mask. The cache holds each caption
encoded alone by the pipeline's own ``encode_prompt`` (left-aligned in a row
of ``max_sequence_length``, ``prompt_embeds_mask`` marking its tokens), and
the loss runs the transformer once per distinct prompt length in a batch
(:func:`diffpipe.models._common.forward_by_text_length`), so every item sees
exactly what the pipeline gives its prompt. The template's length (the
pipeline's ``prompt_template_encode_start_idx``, which the stock pipeline
fixes at 128) is measured with the folder's tokenizer and set on the
pipelines built here, so the cache and the samples cut the template where
that tokenizer ends it: the tiny flavor's tokenizer spells it differently.

``model.variant: i2v`` trains the image-to-video checkpoints (``Kandinsky5I2VPipeline``; a local folder
saved with that pipeline is detected): each item's control image (usually ``control_from_first_frame``) is
cached as its one-frame latents, which replace the first noisy latent frame, marked in the condition mask,
as the pipeline builds its input; that frame is left out of the loss (the pipeline never updates it). The
cache holds the VAE's mean where the pipeline draws a sample of the image's latent distribution.

Only the regular-attention checkpoints train here: a transformer configured
with ``attention_type: nabla`` (the 10-second models' sparse attention) is
refused with a clear error.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5I2VPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
)
from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)

from diffpipe.config import SampleConfig
from diffpipe.families.hunyuanvideo.family import HunyuanVideoFamily
from diffpipe.families.kandinsky5 import flavors
from diffpipe.families.kandinsky5.layers import kandinsky5_layers
from diffpipe.families.qwenimage.family import tiny_qwen_tokenizer
from diffpipe.hub import pipeline_class
from diffpipe.models import _common as common
from diffpipe.models import _video as video
from diffpipe.models import objectives as obj
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import (
    Models,
    TextBundle,
    TextPart,
    clip_text_encoder,
    one_text_encoder,
)

MAX_LENGTH = 512  # Kandinsky5T2VPipeline's default max_sequence_length
I2V_MIN_FRAMES = 17  # Kandinsky5I2VPipeline.normalize_first_frame reads latent frames 4 and on


def _bare_pipeline() -> Kandinsky5T2VPipeline:
    return Kandinsky5T2VPipeline(transformer=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None,
                                 tokenizer_2=None, scheduler=None)


#: The pipeline's prompt template (its constructor sets it).
TEMPLATE = _bare_pipeline().prompt_template


def template_start(tokenizer: PreTrainedTokenizerBase, template: str = TEMPLATE) -> int:
    """The template's token count before the prompt, by ``tokenizer`` (the pipeline's
    ``prompt_template_encode_start_idx``)."""
    return len(tokenizer(template.split("{}")[0]).input_ids)


def folder_variant(cfg: Any, by_pipeline: dict[str, str], default: str, label: str) -> str:
    """The variant of a local folder (its ``model_index.json`` pipeline class in ``by_pipeline``, else
    ``default``), checked against ``model.variant``; the configured (or default) one otherwise."""
    found = None
    if cfg.flavor == "local":
        found = by_pipeline.get(pipeline_class(Path(cfg.path) / "model_index.json") or "", default)
    if found and cfg.variant and cfg.variant != found:
        raise ValueError(f"model.variant {cfg.variant!r}: the folder {cfg.path} holds {label} {found}")
    return found or cfg.variant or default


def _tiny_modulations(model: Kandinsky5Transformer3DModel, seed: int) -> Kandinsky5Transformer3DModel:
    """Fill the modulation layers the constructor zero-initialises (all gates at zero: no block would take
    part, no LoRA get a gradient); a trained model's are not zero."""
    with common.seeded(seed, "kandinsky5.transformer.modulation"), torch.no_grad():
        for name, p in model.named_parameters():
            if "modulation" in name:
                p.normal_(0.0, 0.1)
    return model


class Kandinsky5Family(Family):
    vae_per_frame = False
    #: The i2v variant's pipeline instances are Kandinsky5I2VPipeline.
    models = Models(AutoencoderKLHunyuanVideo, Kandinsky5Transformer3DModel, FlowMatchEulerDiscreteScheduler,
                    Kandinsky5T2VPipeline, flavors)
    text_parts: ClassVar[dict[str, TextPart]] = {
        **one_text_encoder(AutoTokenizer, lambda: tiny_qwen_tokenizer(flavors.TINY_LENGTH),
                           Qwen2_5_VLForConditionalGeneration,
                           Qwen2_5_VLConfig, flavors.TINY_TEXT, "kandinsky5.text_encoder", ids=("pad", "eos"),
                           vision=flavors.TINY_VISION),
        **clip_text_encoder("kandinsky5.text_encoder_2"),
    }
    #: ``t2v`` (text-to-video) and ``i2v`` (the image-to-video checkpoints: the first latent frame is the
    #: control image's latents, marked in the condition mask); a local folder's is read from its pipeline class.
    variants: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    is_video = True
    fps = 24.0
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: The pipeline's prompt template (its ``prompt_template``).
    template: ClassVar[str] = TEMPLATE
    #: Attention (self and cross) and feed-forward linears of every block, the text blocks' included.
    default_lora_targets: ClassVar[list[str]] = [
        *(f"{attn}.{proj}" for attn in ("self_attention", "cross_attention")
          for proj in ("to_query", "to_key", "to_value", "out_layer")),
        "feed_forward.in_layer", "feed_forward.out_layer",
    ]

    # -- configs and geometry: HunyuanVideo's VAE and the same flow-matching scheduler ------------
    frame_rule = HunyuanVideoFamily.frame_rule
    flow_shift = HunyuanVideoFamily.flow_shift

    def __init__(self, cfg):
        super().__init__(cfg)
        self.variant = folder_variant(cfg, {Kandinsky5I2VPipeline.__name__: "i2v"}, "t2v", "Kandinsky 5")
        #: The image-to-video checkpoints train on control images (instance attributes: one variant).
        self.uses_control = self.variant == "i2v"
        self.pipeline_class = Kandinsky5I2VPipeline if self.uses_control else Kandinsky5T2VPipeline

    @cached_property
    def _template_start(self) -> int:
        return template_start(self.load_tokenizer(), self.template)  # measured once: a folder's tokenizer loads in about a second

    def text_settings(self) -> dict[str, Any]:
        """Prompt tokens kept after the template, and the template's measured length."""
        return {**super().text_settings(), "template_start": self._template_start}

    def load_denoiser(self) -> Kandinsky5Transformer3DModel:
        model = super().load_denoiser()
        kind = common.unwrap(model).config.attention_type
        if kind != "regular":
            raise ValueError(f"kandinsky5: the transformer's attention_type is {kind!r}; diffpipe trains the "
                             "regular-attention checkpoints only (the 5-second models), not sparse 'nabla' ones")
        return _tiny_modulations(model, self.cfg.seed) if self.cfg.flavor == "tiny" else model

    def _with_template(self, pipe: Kandinsky5T2VPipeline, start: int) -> Kandinsky5T2VPipeline:
        pipe.prompt_template_encode_start_idx = start
        return pipe

    def text_pipeline(self, encoders: TextBundle) -> Kandinsky5T2VPipeline:
        return self._with_template(super().text_pipeline(encoders), encoders.template_start)

    def load_pipeline(self) -> Kandinsky5T2VPipeline:
        return self._with_template(super().load_pipeline(), self.text_settings()["template_start"])

    # -- encoding ------------------------------------------------------------------
    def encode_text(self, encoders: TextBundle, captions: list[str], encode: Any = None) -> dict[str, torch.Tensor]:
        """Each caption alone through the pipeline's ``encode_prompt`` (it pads a batch to its longest
        prompt, which its transformer would read): left-aligned rows, a mask, the pooled CLIP output.
        ``encode(pipe, i, caption, width, device) -> (qwen states, pooled)`` replaces that call (the editing
        variant passes the item's image)."""
        pipe = self.text_pipeline(encoders)
        device = next(encoders.text_encoder.parameters()).device
        width = encoders.max_sequence_length
        embeds = torch.zeros(len(captions), width, encoders.text_encoder.config.text_config.hidden_size)
        mask = torch.zeros(len(captions), width)
        pooled = []
        with torch.no_grad():
            for i, caption in enumerate(captions):
                if encode is None:
                    qwen, clip, _ = pipe.encode_prompt([caption], max_sequence_length=width, device=device,
                                                       dtype=torch.float32)
                else:
                    qwen, clip = encode(pipe, i, caption, width, device)
                n = qwen.shape[1]
                embeds[i, :n], mask[i, :n] = qwen[0].float().cpu(), 1.0
                pooled.append(clip.float().cpu())
        return {"prompt_embeds": embeds, "prompt_embeds_mask": mask, "pooled_prompt_embeds": torch.cat(pooled)}

    def token_limits(self, encoders: TextBundle) -> dict[str, int]:
        return {"qwen2.5-vl": encoders.max_sequence_length, "clip": encoders.tokenizer_2.model_max_length}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        # The Qwen tokens the pipeline keeps: the templated prompt's, less the template's start.
        templated = encoders.tokenizer([self.template.format(c) for c in self.caption_prompts(captions)]).input_ids
        start = template_start(encoders.tokenizer, self.template)
        return {
            "qwen2.5-vl": [len(x) - start for x in templated],
            "clip": [len(x) for x in encoders.tokenizer_2(list(captions)).input_ids],
        }

    def caption_prompts(self, captions: list[str]) -> list[str]:
        return [prompt_clean(c) for c in captions]

    # -- training ------------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Channel-last noisy latents (+ zero condition channels and mask), ``sigma x 1000``, each prompt's
        Qwen states at its own length and pooled CLIP; the channel-last target ``noise - x0``.
        ``extra``: the prompt lengths, the rotary positions and scale the pipeline uses at this size.

        ``i2v``: the first latent frame is the control image's latents (``control``, ``[B, C, 1, h, w]``)
        and the condition mask marks it, as ``Kandinsky5I2VPipeline.prepare_latents`` builds the input;
        the pipeline never updates that frame, so the loss leaves it out."""
        if self.variant == "i2v":
            video.require_first_frame(control, "i2v")
        o = objective
        x0 = video.check_video_latents(latents, self.name)
        t, noise = video.draw(o, x0, generator, t, noise)
        sigma = obj.shift_timesteps(t, o.shift or self.flow_shift)
        device, (_, _, f, h, w) = x0.device, x0.shape
        noisy = obj.flow_interpolate(x0, noise, sigma)
        if self.variant == "i2v":
            noisy = torch.cat([control[:, :, :1].to(noisy), noisy[:, :, 1:]], dim=2)
        noisy = noisy.permute(0, 2, 3, 4, 1)
        if self._denoiser_config.get("visual_cond"):
            cond_mask = noisy.new_zeros(*noisy.shape[:-1], 1)
            if self.variant == "i2v":
                cond_mask[:, :1] = 1
            noisy = torch.cat([noisy, torch.zeros_like(noisy), cond_mask], dim=-1)
        embeds = text["prompt_embeds"]
        lengths = common.prompt_lengths(embeds, text["prompt_embeds_mask"])
        inputs = {
            "hidden_states": noisy.to(dtype),
            "encoder_hidden_states": embeds.to(device=device, dtype=dtype),
            "timestep": (sigma * self._scheduler_config.get("num_train_timesteps", 1000)).to(dtype),
            "pooled_projections": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
        }
        s = self.vae_factor
        extra = {
            "lengths": lengths,
            "visual_rope_pos": [torch.arange(n, device=device) for n in (f, h // 2, w // 2)],
            "scale_factor": self.rope_scale(h * s, w * s),
        }
        weights = self.loss_mask(mask, x0, o)
        if self.variant == "i2v":  # the given first frame is not denoised
            keep = torch.ones_like(x0[:, :1])
            keep[:, :, 0] = 0
            weights = keep.expand(x0.shape) * (1 if weights is None else weights)
        return Prepared(inputs, obj.flow_target(x0, noise).permute(0, 2, 3, 4, 1),
                        mask=None if weights is None else weights.permute(0, 2, 3, 4, 1), extra=extra)

    def rope_scale(self, height: int, width: int) -> tuple[float, float, float]:
        """The rotary scale the pipeline picks for a clip of this size."""
        return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The transformer's output, each item on its own prompt length (it cannot mask text)."""
        extra = prepared.extra

        def run(part: dict[str, torch.Tensor], n: int) -> torch.Tensor:
            text = part["encoder_hidden_states"][:, :n]  # left-aligned: the prompt's tokens are the first n
            return denoiser(**part | {"encoder_hidden_states": text},
                            text_rope_pos=torch.arange(n, device=text.device), visual_rope_pos=extra["visual_rope_pos"],
                            scale_factor=extra["scale_factor"], sparse_params=None, return_dict=True).sample

        return common.forward_by_text_length(run, prepared.inputs, extra["lengths"])

    # -- pipeline parallelism ---------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (with the text blocks), one layer per visual block, output (``layers.py``)."""
        return kandinsky5_layers(common.unwrap(denoiser))

    def layer_inputs(self, prepared: Prepared) -> tuple[torch.Tensor, ...]:
        """``(noisy, sigma * 1000, prompt states, pooled, rope scale)``: one prompt length per micro-batch."""
        n = common.one_prompt_length(self.name, prepared.extra["lengths"])
        i = prepared.inputs
        scale = torch.tensor(prepared.extra["scale_factor"], dtype=torch.float32, device=i["hidden_states"].device)
        return (i["hidden_states"], i["timestep"], i["encoder_hidden_states"][:, :n],
                i["pooled_projections"], scale)

    # -- sampling ------------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        if self.variant == "i2v" and not cfg.images:
            raise ValueError("sample.images: Kandinsky 5 i2v samples start from an image; give one per sample.prompts")
        kwargs = super().sample_kwargs(cfg)
        if self.variant == "i2v" and kwargs["num_frames"] < I2V_MIN_FRAMES:
            # The pipeline renormalises the first 4 latent frames by the ones after them: none, and it decodes NaN.
            raise ValueError(f"sample.frames {cfg.frames}: Kandinsky 5 i2v samples need at least {I2V_MIN_FRAMES} "
                             "frames (5 latent frames)")
        return {
            **kwargs,
            "max_sequence_length": self.max_sequence_length,
        }
