"""The local flavor with single-file checkpoints (``model.single_files``).

The tiny Wan 2.1 pipeline is saved as a diffusers folder whose transformer
weights are then deleted; the transformer comes from one safetensors file in
Wan's original naming under ``model.diffusion_model.`` (the layout of the
files ComfyUI loads), written through our key map plus the tensors the map
does not cover (norms, modulations). The VAE comes from a file in diffusers
naming. Every weight must arrive unchanged, and identities must follow the files.
"""

from __future__ import annotations

import re

import pytest
import torch
from diffusers import CogVideoXTransformer3DModel
from safetensors.torch import save_file

from diffpipe.config import ConfigError, ModelConfig, load_config
from diffpipe.export.keymaps import keymap_for_model
from diffpipe.export.metadata import denoiser_fingerprint
from diffpipe.families import get_family
from diffpipe.models import _common

# Wan's original names of the tensors outside the LoRA key map (diffusers name pattern -> original).
WAN_EXTRAS = [
    (r"^blocks\.(\d+)\.attn1\.norm_([qk])\.weight$", r"blocks.\1.self_attn.norm_\2.weight"),
    (r"^blocks\.(\d+)\.attn2\.norm_([qk])\.weight$", r"blocks.\1.cross_attn.norm_\2.weight"),
    (r"^blocks\.(\d+)\.norm2\.(weight|bias)$", r"blocks.\1.norm3.\2"),
    (r"^blocks\.(\d+)\.scale_shift_table$", r"blocks.\1.modulation"),
    (r"^scale_shift_table$", "head.modulation"),
]


def _original_wan(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The transformer's whole state dict in Wan's original naming, as a single-file checkpoint holds it."""
    sd = model.state_dict()
    out = {}
    for layer in keymap_for_model("wan", model).layers:
        (segment,) = layer.segments
        for param in ("weight", "bias"):
            if f"{segment.module}.{param}" in sd:
                out[f"{layer.original}.{param}"] = sd.pop(f"{segment.module}.{param}")
    for key in list(sd):
        for pattern, original in WAN_EXTRAS:
            if re.match(pattern, key):
                out[re.sub(pattern, original, key)] = sd.pop(key)
    assert not sd, f"tensors without an original name: {sorted(sd)}"
    return {f"model.diffusion_model.{k}": v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("single-file")
        mp.setenv("DIFFPIPE_CACHE", str(root / "cache"))
        tiny = get_family(ModelConfig(family="wan", flavor="tiny"))
        folder = root / "Wan2.1-T2V"
        tiny.load_pipeline().save_pretrained(folder)
        (folder / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
        denoiser, vae = tiny.load_denoiser(), tiny.load_vae()
        original = _original_wan(denoiser)
        save_file(original, root / "wan2.1_t2v_tiny.safetensors")
        save_file(vae.state_dict(), root / "wan_vae.safetensors")
        files = {"transformer": str(root / "wan2.1_t2v_tiny.safetensors"), "vae": str(root / "wan_vae.safetensors")}
        cfg = ModelConfig(family="wan", flavor="local", path=str(folder), single_files=files)
        yield tiny, get_family(cfg), denoiser, vae, original, root


def _assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module):
    want = expected.state_dict()
    have = got.state_dict()
    assert set(have) == set(want)
    for k in want:
        assert torch.equal(have[k], want[k]), k


def test_components_come_from_the_single_files(setup):
    tiny, local, denoiser, vae, _, _ = setup
    _assert_same_weights(local.load_denoiser(), denoiser)
    _assert_same_weights(local.load_vae(), vae)
    pipe = local.load_pipeline()
    _assert_same_weights(pipe.transformer, denoiser)
    _assert_same_weights(pipe.vae, vae)


def test_identities_follow_the_files(setup):
    """Fingerprints hash tensors, not names: the renamed file hashes like the tiny model, and the
    latent cache key (VAE identity) is the tiny flavor's."""
    tiny, local, _, _, original, root = setup
    assert local.vae_identity() == tiny.vae_identity()
    assert denoiser_fingerprint(local) == denoiser_fingerprint(tiny)
    changed = dict(original)
    changed["model.diffusion_model.head.modulation"] = changed["model.diffusion_model.head.modulation"] + 1
    save_file(changed, root / "changed.safetensors")
    other = local.cfg.model_copy(update={"single_files": {"transformer": str(root / "changed.safetensors")}})
    assert denoiser_fingerprint(get_family(other)) != denoiser_fingerprint(local)


def test_a_wrong_or_truncated_file_is_an_error_naming_it(setup):
    _, local, _, _, original, root = setup
    cut = {k: v for k, v in original.items() if not k.endswith("head.modulation")}
    save_file(cut, root / "cut.safetensors")
    cfg = local.cfg.model_copy(update={"single_files": {"transformer": str(root / "cut.safetensors")}})
    with pytest.raises(
        ValueError,
        match=r"model\.single_files\.transformer: .*cut\.safetensors .*1 tensor\(s\) missing \(e\.g\. scale_shift_table\)",
    ):
        get_family(cfg).load_denoiser()
    cfg = local.cfg.model_copy(update={"single_files": {"transformer": str(root / "wan_vae.safetensors")}})
    with pytest.raises(ValueError, match=r"wan_vae\.safetensors does not match WanTransformer3DModel .* unknown"):
        get_family(cfg).load_denoiser()
    cfg = local.cfg.model_copy(update={"single_files": {"transformer": str(root / "absent.safetensors")}})
    with pytest.raises(FileNotFoundError, match=r"model\.single_files\.transformer: .*absent\.safetensors"):
        get_family(cfg).load_denoiser()


def test_unsupported_components_are_refused(setup, tmp_path):
    _, local, _, _, _, root = setup
    cfg = local.cfg.model_copy(update={"single_files": {"text_encoder": str(root / "wan_vae.safetensors")}})
    with pytest.raises(
        ValueError, match=r"model\.single_files\.text_encoder: family 'wan' loads only vae, transformer"
    ):
        get_family(cfg)
    cfg = local.cfg.model_copy(update={"single_files": {"transformer_2": str(root / "wan_vae.safetensors")}})
    with pytest.raises(ValueError, match=r"transformer_2: only Wan 2.2 A14B"):
        get_family(cfg)
    with pytest.raises(ValueError, match="cannot load CogVideoXTransformer3DModel from a single file"):
        _common.single_file_component(
            CogVideoXTransformer3DModel, str(root / "wan_vae.safetensors"), "x", "transformer"
        )
    bad = tmp_path / "c.yaml"
    bad.write_text("model:\n  family: wan\n  single_files:\n    transformer: a.safetensors\n")
    with pytest.raises(ConfigError, match="model.single_files replaces components of a local model folder"):
        load_config(bad)
