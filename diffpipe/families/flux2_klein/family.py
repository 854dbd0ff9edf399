"""Family ``flux2-klein``: FLUX.2 [klein] 4B / 9B (base and distilled), flow matching, Qwen3 text.

Components and names follow ``Flux2KleinPipeline``: ``vae`` (AutoencoderKLFlux2: its latent mode is
patchified 2x2 and normalised by the VAE's batch-norm statistics, exactly as ``_encode_vae_image``
does; the cache stores that token grid, ``[B, 4C, H/16, W/16]`` at real size), ``text_encoder``
(Qwen3ForCausalLM: each caption in the tokenizer's chat template, thinking off, padded to
``max_sequence_length``; the hidden states after layers 9, 18 and 27 stacked along the width, as the
pipeline's ``_get_qwen3_prompt_embeds`` computes them, which this family calls) + ``tokenizer``,
``transformer`` (Flux2Transformer2DModel: no guidance embedding, 4-axis positions for text and image
tokens), ``scheduler`` (flow matching with the resolution-dependent shift). The transformer sees
``sigma`` and predicts the velocity ``noise - x0``. FLUX.2 [dev] (Mistral 3 text) is the family ``flux2``.

``model.variant: edit`` trains editing with reference images (the same checkpoints and pipelines, their
``image`` argument; FLUX.2 [dev] inherits it): each item's control images (``datasets[].control_path``, a
list for several) are cached one by one as latents like the target's, packed into tokens and appended after
the target's with the positions the pipelines' ``prepare_image_latents`` gives them (time axis 10, 20, ...);
the transformer's output for them is dropped, so the loss covers the target. The pipelines resize a
reference above 1024x1024 pixels to that area; the cache keeps it at the target's size (the same for a
target up to 1024x1024).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from diffpipe.config import MAX_REFERENCES, SampleConfig
from diffpipe.families.flux2_klein import flavors
from diffpipe.families.flux2_klein.layers import flux2_layers
from diffpipe.models import _common as common
from diffpipe.models import targets
from diffpipe.models.base import Family, Prepared
from diffpipe.models.components import Models, TextBundle, TextPart, one_text_encoder
from diffpipe.models.llm_tokenizers import tiny_qwen3_tokenizer

MAX_LENGTH = 512  # Flux2KleinPipeline's default max_sequence_length
#: The text encoder layers whose hidden states are stacked (the pipeline's ``text_encoder_out_layers``).
TEXT_LAYERS = (9, 18, 27)


def chat_prompts(tokenizer: Any, captions: list[str]) -> list[str]:
    """The text ``_get_qwen3_prompt_embeds`` tokenizes: each caption as one user turn, thinking off."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                          add_generation_prompt=True, enable_thinking=False) for c in captions]


def tiny_batch_norm(vae: AutoencoderKLFlux2) -> AutoencoderKLFlux2:
    """The tiny VAE with non-trivial batch-norm statistics (a new one has mean 0, variance 1), so the
    normalisation of its latents is exercised."""
    n = vae.bn.num_features
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, n))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, n))
    return vae


class TinyBatchNormVae:
    """Mixin of the families on FLUX.2's VAE: the tiny flavor's VAE has non-trivial batch-norm statistics
    (:func:`tiny_batch_norm`); a folder's are its own."""

    def load_vae(self) -> AutoencoderKLFlux2:
        vae = super().load_vae()
        return tiny_batch_norm(vae) if self.cfg.flavor == "tiny" else vae


def bn_normalised(vae: AutoencoderKLFlux2, latents: torch.Tensor, eps: float) -> torch.Tensor:
    """The VAE's latent mode ``[B, C, h, w]`` patchified 2x2 and normalised by its batch-norm statistics."""
    tokens = Flux2KleinPipeline._patchify_latents(latents)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(tokens)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + eps).to(tokens)
    return (tokens - mean) / std


def _pack(x: torch.Tensor, *_shape: int) -> torch.Tensor:
    """``Flux2KleinPipeline._pack_latents``: ``[B, C, h, w]`` -> ``[B, h*w, C]`` (the latents are patchified
    already)."""
    return Flux2KleinPipeline._pack_latents(x)


def reference_tokens(control: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference latents ``[B, C, R, h, w]`` (cached like the target: patchified, normalised) -> their packed
    tokens one after the other ``[B, R*h*w, C]`` and positions ``[B, R*h*w, 4]``, as the FLUX.2 pipelines'
    ``prepare_image_latents`` builds them from their list of images (time axis 10, 20, ... per reference)."""
    refs = [control[:, :, k] for k in range(control.shape[2])]
    ids = Flux2KleinPipeline._prepare_image_ids([r[:1] for r in refs]).to(control.device)
    tokens = torch.cat([Flux2KleinPipeline._pack_latents(r) for r in refs], dim=1)
    return tokens, ids.expand(control.shape[0], -1, -1)


class Flux2KleinFamily(TinyBatchNormVae, Family):
    models = Models(AutoencoderKLFlux2, Flux2Transformer2DModel, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                    flavors)
    text_parts: ClassVar[dict[str, TextPart]] = one_text_encoder(
        AutoTokenizer, lambda: tiny_qwen3_tokenizer(flavors.TINY_LENGTH), Qwen3ForCausalLM, Qwen3Config,
        flavors.TINY_QWEN3,
        "flux2-klein.text_encoder", stream="qwen3")
    #: The pipeline's static method that encodes captions, and the text encoder layers it stacks.
    prompt_embeds_method: ClassVar[str] = "_get_qwen3_prompt_embeds"
    text_layers: ClassVar[tuple[int, ...]] = TEXT_LAYERS
    patch = 2  # the VAE's latents are patchified 2x2 before the transformer (whose patch_size is 1)
    prompt_tokens = (flavors.TINY_LENGTH, MAX_LENGTH)
    #: Attention of both streams and their feed-forwards in the double blocks, and the single blocks'
    #: fused QKV + MLP input projection.
    default_lora_targets: ClassVar[list[str]] = [
        *targets.attention(), *targets.added_projections(), "ff.linear_in", "ff.linear_out",
        "ff_context.linear_in", "ff_context.linear_out", "attn.to_qkv_mlp_proj"]

    variants: ClassVar[tuple[str, ...]] = ("edit",)

    def __init__(self, cfg):
        super().__init__(cfg)
        #: ``variant: edit`` trains editing with reference images (instance attributes: one variant).
        self.variant = cfg.variant
        self.uses_control = self.variant == "edit"
        self.max_references = MAX_REFERENCES if self.uses_control else 1  # the datasets' limit

    def shift_for(self, x0: torch.Tensor) -> float:
        # One token per cached latent cell. (Sampling's shift also depends on the step count,
        # ``compute_empirical_mu``; training has none, so it uses the scheduler's resolution rule.)
        return self.timestep_shift(x0.shape[-2] * x0.shape[-1])

    # -- encoding --------------------------------------------------------------
    def encode_pixels(self, vae: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
        """``Flux2KleinPipeline._encode_vae_image``: the latent mode patchified 2x2, then ``(x - mean) / std``
        with the VAE's batch-norm statistics; ``[B, 4C, 1, h/2, w/2]``. The pipeline's decode inverts it."""
        return bn_normalised(vae, common.vae_latents(vae, pixels)[:, :, 0], vae.config.batch_norm_eps)[:, :, None]

    def encode_control(self, vae: torch.nn.Module, control: torch.Tensor, *, frames: int) -> dict[str, torch.Tensor]:
        """References ``[B, 3, R, H, W]`` (one per frame) each encoded as an image -> ``[B, C, R, h, w]``."""
        return {"control": torch.cat([self.encode_pixels(vae, control[:, :, k : k + 1])
                                      for k in range(control.shape[2])], dim=2)}

    def encode_text(self, encoders: TextBundle, captions: list[str]) -> dict[str, torch.Tensor]:
        """The pipeline's own encoding (``prompt_embeds_method``), the ``text_layers`` stacked."""
        device = next(encoders.text_encoder.parameters()).device
        with torch.no_grad():
            embeds = getattr(self.pipeline_class, self.prompt_embeds_method)(
                encoders.text_encoder, encoders.tokenizer, list(captions), dtype=torch.float32, device=device,
                max_sequence_length=encoders.max_sequence_length, hidden_states_layers=self.text_layers)
        return {"prompt_embeds": embeds.float()}

    def count_tokens(self, encoders: TextBundle, captions: list[str]) -> dict[str, list[int]]:
        return {"qwen3": [len(ids) for ids in encoders.tokenizer(chat_prompts(encoders.tokenizer, captions)).input_ids]}

    # -- training ----------------------------------------------------------------
    def prepare(self, latents, text, generator, *, objective, t=None, noise=None, mask=None,
                dtype=torch.float32, control: torch.Tensor | None = None) -> Prepared:
        """Packed noisy tokens, ``sigma`` (the pipeline's timestep / 1000), the caption states and the text
        and image positions the pipeline builds; the packed target ``noise - x0``. Under ``variant: edit``
        the references' tokens and positions go in ``extra["reference"]`` (appended in :meth:`predict`)."""
        f = self.flow_draw(latents, generator, objective, t, noise, _pack)
        device = f.x0.device
        embeds = text["prompt_embeds"].to(device=device, dtype=dtype)
        inputs = {
            "hidden_states": f.noisy.to(dtype),
            "timestep": f.sigma.to(dtype),
            "encoder_hidden_states": embeds,
            "txt_ids": Flux2KleinPipeline._prepare_text_ids(embeds).to(device),
            "img_ids": Flux2KleinPipeline._prepare_latent_ids(f.x0).to(device),
        }
        p = self.flow_prepared(f, inputs, mask, objective)
        if self.uses_control:
            p.extra["reference"] = reference_tokens(self.reference_image(control, latents))
        return p

    def reference_image(self, control: torch.Tensor | None, latents: torch.Tensor) -> torch.Tensor:
        """The reference latents ``[B, C, R, h, w]`` on the latents' device (one reference: ``R = 1``)."""
        if control is not None and control.ndim == 5 and 1 <= control.shape[2] <= self.max_references:
            return control.to(latents.device).float()
        return super().reference_image(control, latents)[:, :, None]

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward with the references' tokens after the target's (``variant: edit``); the target's output."""
        if "reference" not in prepared.extra:
            return super().predict(denoiser, prepared)
        tokens, ids = prepared.extra["reference"]
        x, img_ids = prepared.inputs["hidden_states"], prepared.inputs["img_ids"]
        inputs = {**prepared.inputs, "hidden_states": torch.cat([x, tokens.to(x)], dim=1),
                  "img_ids": torch.cat([img_ids, ids.to(img_ids)], dim=1)}
        return super().predict(denoiser, dataclasses.replace(prepared, inputs=inputs))[:, : x.shape[1]]

    # -- sampling ----------------------------------------------------------------
    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        return {**super().sample_kwargs(cfg), "max_sequence_length": self.max_sequence_length}

    # -- pipeline parallelism ------------------------------------------------------
    def pipeline_layers(self, denoiser: torch.nn.Module) -> list[torch.nn.Module]:
        """Embedding (with the shared modulations), one layer per double and single block, output.

        Input tuple ``(packed noisy, sigma, prompt_embeds, txt_ids, img_ids)``; output ``(packed prediction,)``.
        """
        if self.uses_control:
            raise ValueError(f"{self.name} variant edit: pipeline parallelism is not implemented (the layers would "
                             "carry the reference tokens); set train.pipeline_stages: 1")

        return flux2_layers(common.unwrap(denoiser))
