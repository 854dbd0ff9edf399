"""Family ``hidream``: HiDream-I1 (sparse mixture-of-experts DiT), four text encoders.

Components and names follow ``HiDreamImagePipeline``: ``vae``,
``text_encoder`` / ``text_encoder_2`` (CLIP-L / CLIP-G with projection:
pooled outputs, concatenated) with ``tokenizer`` / ``tokenizer_2``,
``text_encoder_3`` (T5) + ``tokenizer_3``, ``text_encoder_4`` (Llama 3.1:
every layer's hidden states) + ``tokenizer_4``, ``transformer``
(HiDreamImageTransformer2DModel), ``scheduler``. Text is encoded by the
pipeline's own ``encode_prompt`` on a pipeline holding only the text
components, so the cache equals what sampling computes. The Llama states are
cached batch-first (``[B, layers, L, D]``). The model predicts ``x0 - noise``
at the scheduler's timestep (``sigma * 1000``), as the pipeline's ``-noise_pred``
shows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    HiDreamImagePipeline,
    HiDreamImageTransformer2DModel,
)
from transformers import (
    AutoTokenizer,
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from diffpipe.config import SampleConfig
from diffpipe.families.hidream.flavors import (
    TINY_LENGTH,
    TINY_LLAMA,
    TINY_SCHEDULER,
    TINY_T5,
    TINY_TRANSFORMER,
    TINY_VAE,
)
from diffpipe.families.sd3.family import _tiny_clip
from diffpipe.models import _common as common
from diffpipe.models._draws import draw_image
from diffpipe.models.base import Family, Prepared
from diffpipe.models.llm_tokenizers import llm_tokenizer
from diffpipe.models.tokenizers import clip_tokenizer, t5_tokenizer, tokenizer_fingerprint
from diffpipe.training import objectives as obj
from diffpipe.utils import digest

MAX_LENGTH = 128  # the pipeline's default max_sequence_length
_TEXT_PARTS = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "tokenizer_3", "text_encoder_3",
               "tokenizer_4", "text_encoder_4")


def unpatchify(patches: torch.Tensor, shape: torch.Size, p: int) -> torch.Tensor:
    """``[B, C, S, p*p]`` (the transformer's training-mode output) -> ``[B, C, H, W]``.

    Patches are row-major over the ``H/p x W/p`` grid, each ``(p1, p2)``; padding beyond the grid is dropped.
    """
    b, c, h, w = shape
    ph, pw = h // p, w // p
    x = patches[:, :, : ph * pw].reshape(b, c, ph, pw, p, p)
    return x.permute(0, 1, 2, 4, 3, 5).reshape(b, c, h, w)


@dataclass
class HiDreamText:
    tokenizer: CLIPTokenizer
    text_encoder: CLIPTextModelWithProjection
    tokenizer_2: CLIPTokenizer
    text_encoder_2: CLIPTextModelWithProjection
    tokenizer_3: T5TokenizerFast
    text_encoder_3: T5EncoderModel
    tokenizer_4: PreTrainedTokenizerBase
    text_encoder_4: LlamaForCausalLM
    max_sequence_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> HiDreamText:
        for enc in (self.text_encoder, self.text_encoder_2, self.text_encoder_3, self.text_encoder_4):
            enc.to(device=device, dtype=dtype)
        return self

    def parts(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _TEXT_PARTS}


class HiDreamFamily(Family):
    name = "hidream"
    vae_class = AutoencoderKL
    denoiser_name = "transformer"
    #: Attention of both streams and the shared expert of every MoE feed-forward
    #: (the routed experts are left alone, as in diffusers' HiDream LoRA example).
    default_lora_targets: ClassVar[list[str]] = ["to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t",
                                                 "to_out_t", "shared_experts.w1", "shared_experts.w2",
                                                 "shared_experts.w3"]

    @cached_property
    def _vae_config(self) -> dict[str, Any]:
        return dict(TINY_VAE) if self.cfg.flavor == "tiny" else dict(
            AutoencoderKL.load_config(self.cfg.path, subfolder="vae"))

    @cached_property
    def _scheduler_config(self) -> dict[str, Any]:
        return dict(TINY_SCHEDULER) if self.cfg.flavor == "tiny" else dict(
            FlowMatchEulerDiscreteScheduler.load_config(self.cfg.path, subfolder="scheduler"))

    @property
    def pixel_multiple(self) -> int:
        return 2 ** (len(self._vae_config["block_out_channels"]) - 1) * 2

    @cached_property
    def max_sequence_length(self) -> int:
        """Tokens per prompt: the pipeline's 128, or less if the T5 tokenizer's limit is lower."""
        if self.cfg.flavor == "tiny":
            return TINY_LENGTH
        t5 = T5TokenizerFast.from_pretrained(self.cfg.path, subfolder="tokenizer_3")
        return min(int(t5.model_max_length), MAX_LENGTH)

    # -- components ------------------------------------------------------------
    def load_vae(self) -> AutoencoderKL:
        return common.component(AutoencoderKL, self.cfg, self.name, "vae", TINY_VAE)

    def load_tokenizers(self) -> HiDreamText:
        msl = self.max_sequence_length
        if self.cfg.flavor == "tiny":
            return HiDreamText(clip_tokenizer(), None, clip_tokenizer(), None, t5_tokenizer(msl), None,
                               llm_tokenizer(msl, bos="<|begin_of_text|>", eos="<|eot_id|>"), None, msl)
        p = self.cfg.path
        return HiDreamText(CLIPTokenizer.from_pretrained(p, subfolder="tokenizer"), None,
                           CLIPTokenizer.from_pretrained(p, subfolder="tokenizer_2"), None,
                           T5TokenizerFast.from_pretrained(p, subfolder="tokenizer_3"), None,
                           AutoTokenizer.from_pretrained(p, subfolder="tokenizer_4"), None, msl)

    def load_text_encoders(self) -> HiDreamText:
        e, seed = self.load_tokenizers(), self.cfg.seed
        if self.cfg.flavor == "tiny":
            e.text_encoder = _tiny_clip(e.tokenizer, seed, "hidream.text_encoder")
            e.text_encoder_2 = _tiny_clip(e.tokenizer_2, seed, "hidream.text_encoder_2")
            t5 = T5Config(**TINY_T5, vocab_size=len(e.tokenizer_3), pad_token_id=e.tokenizer_3.pad_token_id,
                          eos_token_id=e.tokenizer_3.eos_token_id, decoder_start_token_id=e.tokenizer_3.pad_token_id)
            llama = LlamaConfig(**TINY_LLAMA, vocab_size=len(e.tokenizer_4), pad_token_id=e.tokenizer_4.pad_token_id,
                                bos_token_id=e.tokenizer_4.bos_token_id, eos_token_id=e.tokenizer_4.eos_token_id)
            with common.seeded(seed, "hidream.text_encoder_3"):
                e.text_encoder_3 = T5EncoderModel(t5).eval()
            with common.seeded(seed, "hidream.text_encoder_4"):
                e.text_encoder_4 = LlamaForCausalLM(llama).eval()
            return e
        e.text_encoder = common.pretrained_text_encoder(CLIPTextModelWithProjection, self.cfg, "text_encoder")
        e.text_encoder_2 = common.pretrained_text_encoder(CLIPTextModelWithProjection, self.cfg, "text_encoder_2")
        e.text_encoder_3 = common.pretrained_text_encoder(T5EncoderModel, self.cfg, "text_encoder_3")
        e.text_encoder_4 = common.pretrained_text_encoder(LlamaForCausalLM, self.cfg, "text_encoder_4")
        return e

    def load_denoiser(self) -> HiDreamImageTransformer2DModel:
        return common.component(HiDreamImageTransformer2DModel, self.cfg, self.name, "transformer", TINY_TRANSFORMER)

    def inference_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return FlowMatchEulerDiscreteScheduler.from_config(self._scheduler_config)

    def load_pipeline(self) -> HiDreamImagePipeline:
        pipe = HiDreamImagePipeline(scheduler=self.inference_scheduler(), vae=self.load_vae(),
                                    transformer=self.load_denoiser(), **self.load_text_encoders().parts())
        if self.cfg.flavor == "tiny":
            # The pipeline renders every size rescaled to the area of a default_sample_size square
            # (1024 px for the real model); the tiny model's is 64 px, within its max_resolution.
            pipe.default_sample_size = 32
        return pipe

    @property
    def pipeline_class(self) -> type:
        return HiDreamImagePipeline

    # -- identities ------------------------------------------------------------
    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity((self.name, self.cfg.seed, "text"),
                                        lambda: self._text_identity(self.load_text_encoders()))
        p, tok = self.cfg.path, self.load_tokenizers()
        return digest({
            **{f"tokenizer{s}": tokenizer_fingerprint(getattr(tok, f"tokenizer{s}")) for s in ("", "_2", "_3", "_4")},
            "text_encoder": common.transformers_folder_identity(
                CLIPTextModelWithProjection, CLIPTextConfig, p, "text_encoder", variant=self.cfg.weight_variant),
            "text_encoder_2": common.transformers_folder_identity(
                CLIPTextModelWithProjection, CLIPTextConfig, p, "text_encoder_2", variant=self.cfg.weight_variant),
            "text_encoder_3": common.transformers_folder_identity(T5EncoderModel, T5Config, p, "text_encoder_3", variant=self.cfg.weight_variant),
            "text_encoder_4": common.transformers_folder_identity(LlamaForCausalLM, LlamaConfig, p, "text_encoder_4", variant=self.cfg.weight_variant),
            "max_sequence_length": self.max_sequence_length,
        })

    @staticmethod
    def _text_identity(e: HiDreamText) -> str:
        return digest({
            **{f"tokenizer{s}": tokenizer_fingerprint(getattr(e, f"tokenizer{s}")) for s in ("", "_2", "_3", "_4")},
            **{f"text_encoder{s}": common.module_identity(getattr(e, f"text_encoder{s}"))
               for s in ("", "_2", "_3", "_4")},
            "max_sequence_length": e.max_sequence_length,
        })

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        frames = pixels.shape[2]
        param = next(vae.parameters())
        with torch.no_grad():
            x = common.frames_to_batch(pixels).to(device=param.device, dtype=param.dtype)
            latents = vae.encode(x).latent_dist.mode()
        latents = (latents.float() - (vae.config.shift_factor or 0.0)) * vae.config.scaling_factor
        return common.batch_to_frames(latents, frames)

    def encode_text(self, encoders: HiDreamText, captions: list[str]) -> dict[str, torch.Tensor]:
        # The pipeline's own encode_prompt, on a pipeline of the text components alone.
        pipe = HiDreamImagePipeline(scheduler=None, vae=None, transformer=None, **encoders.parts())
        with torch.no_grad():
            t5, _, llama, _, pooled, _ = pipe.encode_prompt(
                prompt=list(captions), do_classifier_free_guidance=False,
                max_sequence_length=encoders.max_sequence_length)
        return {"prompt_embeds_t5": t5.float(), "prompt_embeds_llama3": llama.transpose(0, 1).float(),
                "pooled_prompt_embeds": pooled.float()}

    def token_limits(self, encoders: HiDreamText) -> dict[str, int]:
        msl = encoders.max_sequence_length
        return {"clip_l": min(msl, 218), "clip_g": min(msl, 218), "t5": min(msl, encoders.tokenizer_3.model_max_length),
                "llama": min(msl, encoders.tokenizer_4.model_max_length)}

    def count_tokens(self, encoders: HiDreamText, captions: list[str]) -> dict[str, list[int]]:
        c = list(captions)
        return {name: [len(x) for x in getattr(encoders, f"tokenizer{s}")(c).input_ids]
                for name, s in (("clip_l", ""), ("clip_g", "_2"), ("t5", "_3"), ("llama", "_4"))}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32) -> Prepared:
        """Flow-matching inputs with the four text encoders' embeddings (Llama's ``[layers, B, L, D]``).

        The target is ``x0 - noise``: the pipeline steps with ``-pred`` as the velocity ``noise - x0``.
        """
        o = objective
        x0 = common.single_frame(latents, self.name).float()
        device = x0.device
        t, noise = draw_image(o, x0, generator, t, noise, family=self.name)
        sigma = obj.shift_timesteps(t, o.shift or float(self._scheduler_config.get("shift", 1.0)))
        inputs = {
            "hidden_states": obj.flow_interpolate(x0, noise, sigma).to(dtype),
            "timesteps": (sigma * 1000).to(dtype),
            "encoder_hidden_states_t5": text["prompt_embeds_t5"].to(device=device, dtype=dtype),
            "encoder_hidden_states_llama3": text["prompt_embeds_llama3"].to(device=device, dtype=dtype).transpose(0, 1),
            "pooled_embeds": text["pooled_prompt_embeds"].to(device=device, dtype=dtype),
        }
        return Prepared(inputs, -obj.flow_target(x0, noise), mask=self.loss_mask(mask, x0, o))

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward in the image layout (train mode returns patches ``[B, C, S, p*p]``, S padded)."""
        pred = super().predict(denoiser, prepared)
        if pred.shape != prepared.target.shape:
            pred = unpatchify(pred, prepared.target.shape, common.unwrap(denoiser).config.patch_size)
        return pred

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding, one layer per double and single block, output.

        Input tuple ``(noisy, sigma * 1000, prompt_embeds_t5, llama [layers, B, L, D], pooled)``;
        output ``(prediction [B, C, H, W],)`` (the image layout in train mode too).
        """
        from diffpipe.families.hidream.layers import hidream_layers

        return hidream_layers(common.unwrap(denoiser))
