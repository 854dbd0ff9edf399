import pytest
import torch

from diffpipe.config import TrainConfig
from diffpipe.training.optim import AdamWBF16, build_optimizer, round_stochastic


def test_stochastic_rounding_is_unbiased():
    x = torch.full((20000,), 1.0 + 2**-10)  # between two bf16 neighbours (1 and 1 + 2^-7)
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert r.mean().item() == pytest.approx(1.0 + 2**-10, abs=2e-4)


@pytest.mark.parametrize("rounding", ["kahan", "stochastic"])
def test_bf16_updates_survive(rounding):
    """Updates of lr=1e-4 on weights near 1 vanish in plain bf16 AdamW, not here."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.ones(256))
    w16 = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
    opts = [torch.optim.AdamW([ref], lr=1e-4), AdamWBF16([w16], lr=1e-4, rounding=rounding),
            torch.optim.AdamW([plain], lr=1e-4)]
    for _ in range(100):
        g = torch.randn(256) + 1.0
        for p, o in zip([ref, w16, plain], opts, strict=True):
            p.grad = g.to(p.dtype)
            o.step()
    drift = (1 - ref.detach()).mean().item()  # about 100 * 1e-4
    assert (1 - plain.detach().float()).mean().item() < 0.2 * drift  # plain bf16 loses most of it
    assert (1 - w16.detach().float()).mean().item() == pytest.approx(drift, rel=0.1)


def test_build_optimizer_by_name():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(build_optimizer(p, TrainConfig(optimizer="adafactor")), torch.optim.Adafactor)
    sgd = build_optimizer(p, TrainConfig(optimizer="SGD", optimizer_args={"momentum": 0.9}))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.9
    assert isinstance(build_optimizer(p, TrainConfig(optimizer="adamw_kahan", zero_stage=1)), AdamWBF16)
    with pytest.raises(ValueError, match="train.optimizer: 'Nope'"):
        build_optimizer(p, TrainConfig(optimizer="Nope"))
    with pytest.raises(ValueError, match="bad train.optimizer_args"):
        build_optimizer(p, TrainConfig(optimizer="SGD", optimizer_args={"bogus": 1}))


def test_deepspeed_config_from_ours():
    from diffpipe.training.engine import deepspeed_config

    ds = deepspeed_config(TrainConfig(batch_size=2, grad_accum=3, precision="bf16", zero_stage=3,
                                      offload_optimizer=True, offload_params=True, grad_clip=0.5), world_size=4)
    assert ds["train_batch_size"] == 24 and ds["gradient_accumulation_steps"] == 3
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"] and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    with pytest.raises(ValueError, match="offload_params needs train.zero_stage 3"):
        TrainConfig(zero_stage=2, offload_params=True)


def test_train_config_refuses_unsupported_combinations():
    with pytest.raises(ValueError, match="zero_stage 0 or 1"):
        TrainConfig(pipeline_stages=2, zero_stage=2)
    with pytest.raises(ValueError, match="no sampling during training"):
        TrainConfig(pipeline_stages=2, sample_every_steps=10)
    with pytest.raises(ValueError, match="needs train.zero_stage below 3"):
        TrainConfig(zero_stage=3, sample_every_epochs=1)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        TrainConfig(eval={"quantiles": [0.0, 0.5]})


def test_bf16_optimizers_need_zero_and_bf16():
    from diffpipe.training import precision

    with pytest.raises(ValueError, match="adamw_kahan.*zero_stage 1, 2 or 3"):
        TrainConfig(optimizer="adamw_kahan")
    with pytest.raises(ValueError, match="adamw_stochastic.*zero_stage"):
        TrainConfig(optimizer="adamw_stochastic", zero_stage=2, offload_optimizer=True)
    with pytest.raises(ValueError, match="set precision: bf16"):
        precision.check(TrainConfig(optimizer="adamw_kahan", zero_stage=1, precision="fp32"))


@pytest.mark.parametrize("name", ["adamw", "adamw_kahan"])
def test_bf16_optimizers_step_the_bf16_weights_under_deepspeed(name, monkeypatch):
    """Under DeepSpeed's bf16 mode plain AdamW steps fp32 master copies; the bf16 variants step the
    bf16 weights themselves (no master copy), which is where their rounding matters."""
    import socket

    from diffpipe.training.engine import build_engine

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(torch.bfloat16)
    tc = TrainConfig(precision="bf16", zero_stage=1, optimizer=name)
    # A one-process gloo group stays up for the rest of this worker (DeepSpeed caches its groups).
    engine = build_engine(model, build_optimizer(list(model.parameters()), tc), None, tc, 1)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    for _ in range(2):
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
    inner = engine.optimizer.optimizer  # the torch optimizer inside DeepSpeed's ZeRO wrapper
    stepped = {p.dtype for g in inner.param_groups for p in g["params"]}
    assert stepped == ({torch.bfloat16} if name == "adamw_kahan" else {torch.float32})
    if name == "adamw_kahan":
        assert all("compensation" in st for st in inner.state.values())
