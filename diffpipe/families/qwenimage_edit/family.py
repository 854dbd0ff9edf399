"""Family ``qwenimage-edit``: Qwen-Image-Edit, Qwen-Image conditioned on a control (input) image.

The components of ``qwenimage`` (the 20B MMDiT with the same config, the
Qwen-Image VAE, Qwen2.5-VL) plus the vision-language ``processor``, in
``QwenImageEditPipeline``. Each training item is a target image with a
control image (``datasets[].control_path`` or ``control_column``). The
pipeline uses the control image twice, and so does this family:

- its VAE latents are packed into 2x2 tokens and appended after the target's
  tokens, with their own ``img_shapes`` entry; the transformer's output for
  them is dropped, so the loss (and a loss mask) covers the target only;
- the text encoder sees it: the prompt template holds an image slot that the
  processor fills with the image's vision tokens, so the text embeddings
  depend on the image. The family sets ``text_uses_control``: the plan keys
  each text entry by caption and control image, and the text cache hands the
  whole control image to :meth:`QwenImageEditFamily.encode_text`, which
  resizes it as the pipeline does (to about 1024² pixels at its aspect ratio)
  before the processor sees it.

The cached embeddings are padded to ``max_sequence_length`` caption tokens
plus the most vision tokens an image can bring, masked like ``qwenimage``'s.
Caption dropout is refused (an empty caption would still need each item's
image). Samples edit ``sample.images``, one per prompt (:meth:`QwenImageEditFamily.sample_kwargs`).

``model.variant: 2509 | 2511`` is Qwen-Image-Edit-Plus (``QwenImageEditPlusPipeline``; 2511's
transformer sets ``zero_cond_t``: the references' tokens see timestep 0): up to
``MAX_REFERENCES`` reference images per item (``datasets[].control_path`` as a list of
folders). They reach the family as the frames of the control latents ``[B, C, R, h, w]``
(each encoded as an image of its own), are appended after the target's tokens in order,
each with its own ``img_shapes`` entry, and the text encoder sees each as "Picture k:"
resized to about 384² pixels, as the pipeline does. The references are cached at the
target's bucket (the pipeline resizes each to about 1024² pixels at its own aspect ratio;
the two agree for a target of about 1024² whose references share its aspect ratio, which
validation checks). A local folder's variant is read from its ``model_index.json`` (and
its transformer's ``zero_cond_t``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImageTransformer2DModel
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from PIL import Image
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize
from transformers.processing_utils import ProcessorMixin

from diffpipe.config import MAX_REFERENCES, ModelConfig, SampleConfig
from diffpipe.families.qwenimage.family import MAX_LENGTH, QwenImageFamily
from diffpipe.families.qwenimage.flavors import TINY_TEXT, TINY_TRANSFORMER, TINY_VISION
from diffpipe.families.qwenimage_edit.flavors import TINY_LENGTH, TINY_PIXELS
from diffpipe.models import _common as common
from diffpipe.models.base import Family, Prepared, ReferenceTokens
from diffpipe.models.components import Model
from diffpipe.models.llm_tokenizers import llm_tokenizer
from diffpipe.models.tokenizers import tokenizer_fingerprint
from diffpipe.utils import digest

# QwenImageEditPipeline's prompt template and how many leading tokens it drops.
TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input where "
    "appropriate.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
DROP = 64
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
#: The pipeline resizes the input image to about this many pixels before anything sees it.
PROMPT_IMAGE_AREA = 1024 * 1024
#: Qwen-Image-Edit-Plus: the template without a slot; each reference is a numbered picture before the
#: caption, resized to about ``PLUS_IMAGE_AREA`` pixels for the text encoder.
PLUS_TEMPLATE = TEMPLATE.replace(IMAGE_SLOT, "")
PICTURE = "Picture {}: " + IMAGE_SLOT
PLUS_IMAGE_AREA = 384 * 384
#: ``model.variant`` -> whether its transformer sets ``zero_cond_t`` (2511: references at timestep 0).
PLUS_VARIANTS = {"2509": False, "2511": True}
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


class ImageOnlyQwenVLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without its video processor, which needs torchvision.

    The edit pipeline passes images only; everything it calls (the prompt
    expansion of ``<|image_pad|>`` and the image processor) is the stock
    class's. Used when torchvision is not installed.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)


@dataclass
class EditText:
    tokenizer: PreTrainedTokenizerBase
    processor: Qwen2VLProcessor
    text_encoder: Qwen2_5_VLForConditionalGeneration | None
    #: Caption tokens allowed (what validation checks captions against).
    max_sequence_length: int
    #: Length every cached embedding is padded to: captions plus the most vision tokens.
    padded_length: int

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> EditText:
        self.text_encoder.to(device=device, dtype=dtype)
        return self


def tiny_edit_tokenizer(max_length: int = 4096) -> PreTrainedTokenizerBase:
    return llm_tokenizer(
        max_length, bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>", *VISION_TOKENS), add_bos=False
    )


def _load_processor(path: str, tokenizer: PreTrainedTokenizerBase, subfolder: str = "processor") -> Qwen2VLProcessor:
    """The folder's processor (in ``subfolder``) as the stock pipeline loads it; image-only without torchvision."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, subfolder=subfolder)
        return ImageOnlyQwenVLProcessor(image_processor=image_processor, tokenizer=tokenizer)
    return Qwen2VLProcessor.from_pretrained(path, subfolder=subfolder)


def tiny_processor(max_length: int = 4096) -> ImageOnlyQwenVLProcessor:
    """The tiny flavor's processor: the tiny tokenizer (``max_length`` its limit) with the vision tokens, a
    small pixel range."""
    return ImageOnlyQwenVLProcessor(image_processor=Qwen2VLImageProcessorPil(**TINY_PIXELS),
                                    tokenizer=tiny_edit_tokenizer(max_length))


def tiny_vl_text_encoder(tok: PreTrainedTokenizerBase, seed: int, component: str) -> Qwen2_5_VLForConditionalGeneration:
    """A tiny Qwen2.5-VL that reads images: the vision tokens' ids are ``tok``'s (the model finds the image
    slot and its rope positions by them)."""
    ids = {
        key: tok.convert_tokens_to_ids(token)
        for key, token in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    text = {**TINY_TEXT, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=TINY_VISION, vocab_size=len(tok), **ids)
    with common.seeded(seed, component):
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def detect_variant(path: str) -> str | None:
    """A local folder's Edit-Plus variant (``2509``, ``2511``), or None for Qwen-Image-Edit."""
    try:
        index = json.loads((Path(path) / "model_index.json").read_text())
    except (OSError, ValueError):
        return None
    if index.get("_class_name") != QwenImageEditPlusPipeline.__name__:
        return None
    config = QwenImageTransformer2DModel.load_config(path, subfolder="transformer")
    return "2511" if config.get("zero_cond_t") else "2509"


def vision_token_bound(image_processor: Any, area: int = PROMPT_IMAGE_AREA) -> int:
    """The most vision tokens a prompt image can bring, over aspect ratios 1:16 to 16:1.

    The pipeline resizes every image to about ``area`` pixels in multiples of
    32; the image processor then rounds each side to a multiple of
    ``patch_size * merge_size`` within its pixel range.
    """
    factor = image_processor.patch_size * image_processor.merge_size
    lo, hi = image_processor.size["shortest_edge"], image_processor.size["longest_edge"]
    most = 0
    for i in range(-4000, 4001):
        width, height, _ = calculate_dimensions(area, math.exp(i / 4000 * math.log(16)))
        h, w = smart_resize(max(height, factor), max(width, factor), factor, lo, hi)
        most = max(most, (h // factor) * (w // factor))
    return most


def reference_tokens(control: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Control latents ``[B, C, h, w]`` -> packed tokens ``[B, hw/4, 4C]`` and their ``img_shapes`` entry.

    Exactly ``QwenImageEditPipeline.prepare_latents`` on image latents.
    """
    b, c, h, w = control.shape
    return QwenImageEditPipeline._pack_latents(control, b, c, h, w), (1, h // 2, w // 2)


def references_tokens(control: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Control latents ``[B, C, R, h, w]`` (R references) -> their packed tokens one after the other
    ``[B, R*hw/4, 4C]`` and one ``img_shapes`` entry each: ``QwenImageEditPlusPipeline.prepare_latents``."""
    packed = [reference_tokens(control[:, :, k]) for k in range(control.shape[2])]
    return torch.cat([tokens for tokens, _ in packed], dim=1), [shape for _, shape in packed]


class QwenImageEditFamily(ReferenceTokens, QwenImageFamily):
    #: Not the parent family's layers: this family's spec says why it has none.
    pipeline_layers = Family.pipeline_layers
    pipeline_class = QwenImageEditPipeline
    uses_control = True
    text_uses_control = True
    variants: ClassVar[tuple[str, ...]] = tuple(PLUS_VARIANTS)
    default_lora_targets: ClassVar[list[str]] = list(QwenImageFamily.default_lora_targets)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        local = cfg.flavor == "local" and cfg.path
        found = detect_variant(cfg.path) if local else None
        if local and cfg.variant is not None and cfg.variant != found:
            raise ValueError(f"model.variant {cfg.variant!r}: the folder {cfg.path} holds "
                             f"{'Qwen-Image-Edit-' + found if found else 'Qwen-Image-Edit (variant null)'}")
        #: None: Qwen-Image-Edit (one reference); ``2509`` / ``2511``: Qwen-Image-Edit-Plus.
        self.variant = found if local else cfg.variant
        if self.plus:
            self.pipeline_class = QwenImageEditPlusPipeline
            self.max_references = MAX_REFERENCES
            if PLUS_VARIANTS[self.variant]:
                self.denoiser_model = Model(QwenImageTransformer2DModel, {**TINY_TRANSFORMER, "zero_cond_t": True})

    @property
    def plus(self) -> bool:
        """Whether this is Qwen-Image-Edit-Plus (``model.variant: 2509 | 2511``): several references."""
        return self.variant is not None

    def reference_tokens(self, control: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The references' packed tokens and ``img_shapes`` entries (control ``[B, C, R, h, w]``)."""
        return references_tokens(control)

    def reference_image(self, control: torch.Tensor | None, latents: torch.Tensor) -> torch.Tensor:
        """The control latents ``[B, C, R, h, w]`` on the latents' device: one reference (Edit), or
        up to ``max_references`` (Edit-Plus)."""
        if control is not None and control.ndim == 5 and 1 <= control.shape[2] <= self.max_references:
            return control.to(latents.device).float()
        return super().reference_image(control, latents)[:, :, None]

    def sizes(self, published) -> bool:
        # Edit and Edit-Plus encode their prompts differently: each sizes with its own published entries.
        return published.variant == self.variant

    # -- components ------------------------------------------------------------
    # The text side is its own, not declared parts: a processor (with its image processor) beside the
    # tokenizer, and a padded length that depends on the processor, both in the cache key.
    @cached_property
    def max_sequence_length(self) -> int:
        return self.load_tokenizers().max_sequence_length

    def load_tokenizers(self) -> EditText:
        if self.cfg.flavor == "tiny":
            processor = tiny_processor()
            tok = processor.tokenizer
            limit = TINY_LENGTH
        else:
            tok = AutoTokenizer.from_pretrained(self.cfg.path, subfolder="tokenizer")
            processor = _load_processor(self.cfg.path, tok)
            limit = MAX_LENGTH
        if not self.plus:
            return EditText(tok, processor, None, limit, limit + vision_token_bound(processor.image_processor))
        # Each reference: its "Picture k: " and vision markers, and the most vision tokens at ~384².
        slot = len(tok(PICTURE.format(MAX_REFERENCES).replace("<|image_pad|>", "")).input_ids)
        bound = vision_token_bound(processor.image_processor, PLUS_IMAGE_AREA)
        return EditText(tok, processor, None, limit, limit + MAX_REFERENCES * (slot + bound))

    def load_text_encoders(self) -> EditText:
        enc = self.load_tokenizers()
        if self.cfg.flavor == "tiny":
            enc.text_encoder = tiny_vl_text_encoder(enc.tokenizer, self.cfg.seed, f"{self.name}.text_encoder")
        else:
            enc.text_encoder = common.pretrained_text_encoder(Qwen2_5_VLForConditionalGeneration, self.cfg, "text_encoder")
        return self.stored_text(enc)

    def load_pipeline(self) -> QwenImageEditPipeline:
        enc = self.load_text_encoders()
        return self.pipeline_class(
            scheduler=self.inference_scheduler(),
            vae=self.load_vae(),
            text_encoder=enc.text_encoder,
            tokenizer=enc.tokenizer,
            processor=enc.processor,
            transformer=self.load_denoiser(),
        )

    # -- identities ------------------------------------------------------------
    def encoders_identity(self) -> str:
        if self.cfg.flavor == "tiny":
            return common.memo_identity(
                (self.name, self.variant, self.cfg.seed, "text"),
                lambda: self._edit_identity(self.load_text_encoders(), None),
            )
        encoder = common.transformers_folder_identity(
            Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, self.cfg.path, "text_encoder", variant=self.cfg.weight_variant,
        )
        return self._edit_identity(self.load_tokenizers(), encoder)

    def _edit_identity(self, enc: EditText, encoder: Any) -> str:
        ip = enc.processor.image_processor
        return digest(
            {
                "tokenizer": tokenizer_fingerprint(enc.tokenizer),
                "processor": [type(enc.processor).__name__, type(ip).__name__, ip.to_dict()],
                "text_encoder": encoder if encoder is not None else common.module_identity(enc.text_encoder),
                "lengths": [enc.max_sequence_length, enc.padded_length],
                "template": TEMPLATE,
                "prompt_image": [PROMPT_IMAGE_AREA, self.vae_factor * 2],
                **({"plus": [PLUS_TEMPLATE, PICTURE, PLUS_IMAGE_AREA]} if self.plus else {}),
            }
        )

    # -- encoding --------------------------------------------------------------
    def prompt_image(self, image: Image.Image) -> Image.Image:
        """The control image as the pipeline's processor sees it: resized to about 1024² pixels (Edit-Plus:
        384²)."""
        area = PLUS_IMAGE_AREA if self.plus else PROMPT_IMAGE_AREA
        width, height, _ = calculate_dimensions(area, image.size[0] / image.size[1])
        return VaeImageProcessor(vae_scale_factor=self.vae_factor * 2).resize(image, height, width)

    def _prompt(self, caption: str, images: list[Image.Image] | Image.Image | None) -> str:
        """The text the processor sees: the pipeline's template around the caption (and the image slots)."""
        if images is None:
            return (PLUS_TEMPLATE if self.plus else TEMPLATE.replace(IMAGE_SLOT, "")).format(caption)
        if not self.plus:
            return TEMPLATE.format(caption)
        n = len(images) if isinstance(images, list) else 1
        return PLUS_TEMPLATE.format("".join(PICTURE.format(k + 1) for k in range(n)) + caption)

    def encode_text(
        self, encoders: EditText, captions: list[str], images: list[Image.Image | None] | None = None
    ) -> dict[str, torch.Tensor]:
        """``QwenImageEditPipeline._get_qwen_prompt_embeds`` on each caption and its control image
        (Edit-Plus: ``QwenImageEditPlusPipeline``'s, on its list of references).

        ``images`` are the whole control images (None: none, as for the empty
        caption); every embedding is padded to ``padded_length`` with its mask.
        """
        images = list(images) if images is not None else [None] * len(captions)
        length = encoders.padded_length
        device = next(encoders.text_encoder.parameters()).device
        embeds = torch.zeros(len(captions), length, encoders.text_encoder.config.text_config.hidden_size)
        keep = torch.zeros(len(captions), length)
        for has_image in (False, True):  # the processor takes a batch with images for all or none
            idx = [i for i, im in enumerate(images) if (im is not None) == has_image]
            if not idx:
                continue
            if has_image:
                inputs = encoders.processor(
                    text=[self._prompt(captions[i], images[i]) for i in idx],
                    # in order: each caption's references, one per image slot
                    images=[self.prompt_image(im) for i in idx for im in _as_list(images[i])],
                    padding=True,
                    return_tensors="pt",
                ).to(device)
            else:  # the empty-caption cache: no image, so no image slot (never trained on, see loop)
                inputs = encoders.tokenizer(
                    [self._prompt(captions[i], None) for i in idx],
                    padding=True,
                    return_tensors="pt",
                ).to(device)
            with torch.no_grad():
                hidden = encoders.text_encoder(
                    input_ids=inputs["input_ids"],
                    attention_mask=inputs["attention_mask"],
                    pixel_values=inputs.get("pixel_values"),
                    image_grid_thw=inputs.get("image_grid_thw"),
                    output_hidden_states=True,
                ).hidden_states[-1]
            for row, i in zip(hidden, idx, strict=True):
                kept = row[inputs["attention_mask"][idx.index(i)].bool()][DROP:]
                if len(kept) > length:
                    raise ValueError(
                        f"caption {captions[i]!r} with its control image is {len(kept)} tokens, "
                        f"more than the {length} the cache holds; shorten the caption"
                    )
                embeds[i, : len(kept)] = kept.float().cpu()
                keep[i, : len(kept)] = 1
        return {"prompt_embeds": embeds, "prompt_embeds_mask": keep}

    def count_tokens(self, encoders: EditText, captions: list[str]) -> dict[str, list[int]]:
        # Without the image's vision tokens (the padded length leaves room for the most an image brings).
        if self.plus:  # the caption alone: the references' slots have room in the padded length
            ids = encoders.tokenizer([PLUS_TEMPLATE.format(c) for c in captions]).input_ids
            return {"qwen": [len(x) - DROP for x in ids]}
        ids = encoders.tokenizer([TEMPLATE.format(c) for c in captions]).input_ids
        return {"qwen": [len(x) - DROP - 1 for x in ids]}

    # -- training ----------------------------------------------------------------

    def predict(self, denoiser: torch.nn.Module, prepared: Prepared) -> torch.Tensor:
        """The forward with the reference tokens appended (and their grid in ``img_shapes``); the target
        tokens' output."""
        tokens, more = prepared.extra["reference"]
        x = prepared.inputs["hidden_states"]
        inputs = {**prepared.inputs, "hidden_states": torch.cat([x, tokens.to(x)], dim=1),
                  "img_shapes": [[*shapes, *more] for shapes in prepared.inputs["img_shapes"]]}
        return super().predict(denoiser, replace(prepared, inputs=inputs))[:, : x.shape[1]]

    def sample_kwargs(self, cfg: SampleConfig) -> dict[str, Any]:
        if cfg.prompts and not cfg.images:
            raise ValueError(
                "model family 'qwenimage-edit' edits an image: give one per prompt in sample.images "
                "(or leave sample.prompts empty)"
            )
        return super().sample_kwargs(cfg)


def _as_list(images: Image.Image | list[Image.Image]) -> list[Image.Image]:
    return images if isinstance(images, list) else [images]
