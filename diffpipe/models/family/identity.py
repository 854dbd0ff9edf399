"""A family's identities: the content hashes of its VAE and text components that go into the cache keys,
so a cache is reused exactly when what produced it is unchanged."""

from __future__ import annotations

from diffpipe.models import _common as common
from diffpipe.models.components import Tokenizer
from diffpipe.models.tokenizers import tokenizer_fingerprint
from diffpipe.utils import digest


class Identity:
    """Cache key parts (a part of :class:`~diffpipe.models.base.Family`)."""

    def vae_identity(self) -> str:
        """The latent cache key part: the VAE's weights and config, and the dtype it encodes in."""
        return common.with_dtype(self.vae_weights_identity(), self.vae_dtype())

    def text_identity(self) -> str:
        """The text cache key part: tokenizers, encoders and the dtype they encode in, the base LoRAs folded
        into the encoders (:meth:`with_base_text`: their content and scales), and which encoders' captions are
        cached as token ids (``train.text_encoder``)."""
        identity = common.with_dtype(self.encoders_identity(), common.load_dtype(self.cfg, "text_encoder"))
        if self.cfg.text_encoder_weights == "fp8":
            identity = f"{identity}+fp8"
        if self.base_text_identity:
            identity = f"{identity}+base:{self.base_text_identity}"
        return f"{identity}+ids:{','.join(self.trained_text)}" if self.trained_text else identity

    def vae_weights_identity(self) -> str:
        """Hash of the VAE's config and weights.

        Tiny flavor: the built module's tensors (memoised per process); local:
        the ``vae/`` folder's config and weight files.
        """
        if self.cfg.flavor == "tiny":
            return common.memo_identity(
                (self.name, self.cfg.seed, "vae"), lambda: digest(common.module_identity(self.load_vae()))
            )
        return digest(common.diffusers_component_identity(self.vae_class, self.cfg, "vae"))

    def encoders_identity(self) -> str:
        """Hash of the tokenizers' and text encoders' config and weights, and the text settings.

        From the declared ``text_parts``: tiny flavor = the built modules (memoised per process); local =
        the folders' tokenizers and encoder configs and weight files, without loading the weights.
        """
        parts = self._declared("text_parts")
        if self.cfg.flavor == "tiny":
            def build() -> str:
                bundle = self._text_bundle(encoders=True, base=False)  # the encoders as published
                return digest({**{name: tokenizer_fingerprint(bundle.parts[name]) if isinstance(part, Tokenizer)
                                  else common.module_identity(bundle.parts[name]) for name, part in parts.items()},
                               **self.text_settings()})

            # Variants of one family may differ in their text settings (Wan's tiny prompt lengths).
            return common.memo_identity((self.name, self.cfg.seed, "text", digest(self.text_settings())), build)
        path, variant = self.cfg.path, self.cfg.weight_variant
        return digest({**{name: tokenizer_fingerprint(part.cls.from_pretrained(path, subfolder=name))
                          if isinstance(part, Tokenizer)
                          else common.transformers_folder_identity(part.cls, part.config_cls, path, name, variant=variant)
                          for name, part in parts.items()},
                       **self.text_settings()})

