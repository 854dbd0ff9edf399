"""LoRA options on the tiny UNet: only some blocks, init, continue from a LoRA file."""

import pytest
import torch

from diffpipe.config import LoraConfig, ModelConfig
from diffpipe.families import get_family
from diffpipe.training import adapter


@pytest.fixture(scope="module")
def family():
    return get_family(ModelConfig())


def _lora(family, **kw):
    lcfg = LoraConfig(rank=4, **kw)
    unet = family.load_denoiser()
    torch.manual_seed(0)
    adapter.add_lora(unet, adapter.peft_config(lcfg, family.lora_targets(lcfg.targets)))
    return unet, lcfg


def test_blocks_limit_the_adapted_modules(family):
    unet, _ = _lora(family, blocks=[r"up_blocks\.0\."])
    keys = adapter.lora_state_dict(unet)
    assert keys and all(k.startswith("up_blocks.0.") for k in keys)
    assert any(".to_out.0.lora_A" in k for k in keys) and any(".conv1.lora_A" in k for k in keys)


def test_init_and_continue_from_file(family, tmp_path):
    unet, lcfg = _lora(family, init="kaiming")
    sd = {k: torch.randn_like(v) for k, v in adapter.lora_state_dict(unet).items()}
    cfg = adapter.peft_config(lcfg, family.lora_targets(None))
    adapter.save_adapter(tmp_path / "a", sd, cfg)
    fresh, _ = _lora(family)
    adapter.init_from(fresh, tmp_path / "a", "unet")
    got = adapter.lora_state_dict(fresh)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    small = get_family(ModelConfig()).load_denoiser()
    adapter.add_lora(small, adapter.peft_config(LoraConfig(rank=2), family.lora_targets(None)))
    with pytest.raises(ValueError, match="set train.lora.rank"):
        adapter.init_from(small, tmp_path / "a", "unet")
    key = sorted(sd)[1]
    sd[key][0] = float("nan")  # a diverged run's LoRA: refused, naming the tensor
    adapter.save_adapter(tmp_path / "nan", sd, cfg)
    with pytest.raises(ValueError, match=rf"train.lora.init_from: .* 1 tensor\(s\) with NaN or inf values: {key}"):
        adapter.init_from(fresh, tmp_path / "nan", "unet")


def test_activation_checkpointing_gives_the_same_gradients(family):
    unet, _ = _lora(family)
    ckpt, _ = _lora(family)
    ckpt.load_state_dict(unet.state_dict())
    ckpt.enable_gradient_checkpointing()
    for m in (unet, ckpt):
        m.train()
        loss = family.loss(m, torch.ones(2, 4, 1, 16, 16), {"prompt_embeds": torch.ones(2, 77, 32)},
                           torch.Generator().manual_seed(0))
        loss.mean().backward()
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (unet, ckpt)]
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)
