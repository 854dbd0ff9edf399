"""Tokenizers for the tiny flavors of families whose text encoder is a language model.

Gemma, GLM, Qwen and Llama tokenizers are large BPE vocabularies we cannot
download; the tiny flavors only need one that behaves like them: special
tokens, a fixed length limit, a chat-style prompt template when the
pipeline uses one. ``llm_tokenizer`` builds a ``PreTrainedTokenizerFast``
over the same character pieces as ``tokenizers.t5_tokenizer`` (every printable
character, a few whole words), plus the named special tokens. It is written
by our code, identical in every process, and saved/reloaded exactly by
``save_pretrained``/``from_pretrained`` (the pipeline's folder holds its
``tokenizer.json``).
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from diffpipe.models.tokenizers import t5_pieces


def llm_tokenizer(
    max_length: int,
    *,
    bos: str | None = "<bos>",
    eos: str = "<eos>",
    pad: str = "<pad>",
    extra: tuple[str, ...] = (),
    add_bos: bool = True,
    padding_side: str = "right",
) -> PreTrainedTokenizerFast:
    """A small Unigram tokenizer with ``pad``, ``eos``, ``bos`` (ids 0, 1, 2) and ``extra`` specials."""
    specials = [pad, eos] + ([bos] if bos else []) + ["<unk>", *extra]
    pieces = [(tok, 0.0) for tok in specials] + [p for p in t5_pieces() if p[0] not in ("<pad>", "</s>", "<unk>")]
    unk = specials.index("<unk>")
    tok = Tokenizer(models.Unigram(pieces, unk_id=unk, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    if bos and add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=[bos, "$A"], pair=[bos, "$A", "$B"], special_tokens=[(bos, specials.index(bos))]
        )
    tok.add_special_tokens(list(specials))
    kwargs = {"bos_token": bos} if bos else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos, pad_token=pad, unk_token="<unk>",
        additional_special_tokens=list(extra) or None, model_max_length=max_length,
        padding_side=padding_side, **kwargs,
    )


#: A chat template that renders one user turn as Qwen3's does (the assistant turn opened; with thinking
#: left on, as the pipeline asks, no empty think block), for the tiny tokenizer.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def tiny_qwen3_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """Qwen-like: ``<|endoftext|>`` pads, ``<|im_end|>`` ends, no BOS, and a chat template."""
    tok = llm_tokenizer(max_length, bos=None, eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",),
                        add_bos=False)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


#: Qwen3-VL's rendering of one user turn whose content is a list of parts (only its text parts here), the
#: assistant turn opened; a plain string content renders as in ``TINY_CHAT_TEMPLATE``.
TINY_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3_vl_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """:func:`tiny_qwen3_tokenizer` with a chat template that reads Qwen3-VL's list-of-parts messages."""
    tok = tiny_qwen3_tokenizer(max_length)
    tok.chat_template = TINY_VL_CHAT_TEMPLATE
    return tok
