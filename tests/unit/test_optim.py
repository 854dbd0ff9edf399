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
    # grad_clip 0 disables clipping: DeepSpeed's default for a missing key is 1.0, so it must be written.
    assert deepspeed_config(TrainConfig(grad_clip=0), world_size=1)["gradient_clipping"] == 0
    # optimizer_in_backward steps the bf16 weights itself: DeepSpeed's bf16 mode (and its master options) stay off.
    inb = deepspeed_config(TrainConfig(mode="full", optimizer_in_backward=True, grad_clip=0, precision="bf16",
                                       optimizer="adamw_kahan"), world_size=1)
    assert inb["bf16"] == {"enabled": False}


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


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_quantised_optimizer_states_round_trip(name, tmp_path):
    """torchao's 8-bit / 4-bit AdamW by name: the moments of a tensor of 4096+ values are quantised, and they
    save and load (weights_only) so that the next steps are the same as without the round trip."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(8))]
    opt = build_optimizer(ps, TrainConfig(optimizer=name, lr=1e-2))
    want = OptimState8bit if name == "adamw8bit" else OptimState4bit

    def steps(o, n):
        for _ in range(n):
            for p in ps:
                p.grad = torch.sin(p.detach() * 3)
            o.step()

    steps(opt, 2)
    assert isinstance(opt.state[ps[0]]["exp_avg"], want) and isinstance(opt.state[ps[0]]["exp_avg_sq"], want)
    assert not isinstance(opt.state[ps[1]]["exp_avg"], want)  # under 4096 values: full width
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = [p.detach().clone() for p in ps]
    steps(opt, 2)
    after = [p.detach().clone() for p in ps]
    with torch.no_grad():
        for p, s in zip(ps, saved, strict=True):
            p.copy_(s)
    again = build_optimizer(ps, TrainConfig(optimizer=name, lr=1e-2))
    again.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    steps(again, 2)
    assert all(torch.equal(p, a) for p, a in zip(ps, after, strict=True))


def _tiny_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


def test_optimizer_in_backward_steps_as_the_optimizer_would():
    """Each parameter stepped in its gradient hook, its gradient freed: the same weights as AdamW after the
    backward pass and ``step``; the LR schedule reaches the per-parameter optimizers; the state round-trips."""
    from diffpipe.training.in_backward import InBackward
    from diffpipe.training.optim import build_training_optimizer

    tc = TrainConfig(mode="full", optimizer_in_backward=True, grad_clip=0, lr=1e-2)
    ref, net = _tiny_net(), _tiny_net()
    plain = build_optimizer(list(ref.parameters()), tc)
    opt = build_training_optimizer([{"params": list(net.parameters())}], tc)
    assert isinstance(opt, InBackward)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
    plain_sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda s: 1 / (1 + s))
    x = torch.randn(8, 16)
    for _ in range(3):
        ref(x).pow(2).mean().backward()
        plain.step()
        plain.zero_grad()
        plain_sched.step()
        net(x).pow(2).mean().backward()
        assert all(p.grad is None for p in net.parameters())
        norm, bad = opt.take()
        assert norm is not None and norm > 0 and not bad
        opt.step()
        sched.step()
    for a, b in zip(ref.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    state = opt.state_dict()
    other = build_training_optimizer([{"params": list(_tiny_net().parameters())}], tc)
    other.load_state_dict(state)
    assert other.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)
    for a, b in zip(opt.optimizers, other.optimizers, strict=True):
        sa, sb = next(iter(a.state.values())), next(iter(b.state.values()))
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    with pytest.raises(ValueError, match="holds 5 per-parameter optimizers, this run trains 4"):
        other.load_state_dict({"in_backward": state["in_backward"] + state["in_backward"][:1]})


def test_optimizer_in_backward_skips_a_nonfinite_loss_and_gradient():
    from diffpipe.training.optim import build_training_optimizer

    net = _tiny_net()
    before = [p.detach().clone() for p in net.parameters()]
    opt = build_training_optimizer([{"params": list(net.parameters())}],
                                   TrainConfig(mode="full", optimizer_in_backward=True, grad_clip=0))
    opt.skip = True  # the loop sets it when the loss is not finite
    net(torch.randn(4, 16)).pow(2).mean().backward()
    assert opt.take() == (None, False) and all(p.grad is None for p in net.parameters())
    (net(torch.randn(4, 16)).mean() * float("nan")).backward()  # every gradient NaN
    assert opt.take()[1] is True
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))


@pytest.mark.parametrize(("train", "match"), [
    ({"mode": "lora"}, "needs train.mode full"),
    ({"grad_accum": 2}, "needs train.grad_accum 1"),
    ({"grad_clip": 1.0}, "needs train.grad_clip 0"),
    ({"zero_stage": 1}, "needs train.zero_stage 0"),
    ({"precision": "fp16"}, "needs precision fp32 or bf16"),
    ({"precision": "bf16", "optimizer": "adamw"}, "use adamw8bit, adamw4bit, adamw_kahan"),
])
def test_optimizer_in_backward_refuses_what_needs_every_gradient(train, match):
    base = {"mode": "full", "optimizer_in_backward": True, "grad_clip": 0}
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**base, **train})
    TrainConfig(**base, precision="bf16", optimizer="adamw8bit")  # what works
    TrainConfig(**base, precision="bf16", optimizer="adamw_kahan")


def test_optimizer_in_backward_under_auto_bf16_needs_a_bf16_optimizer(monkeypatch):
    from diffpipe.training import precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # auto resolves to bf16 on a GPU
    with pytest.raises(ValueError, match="optimizer_in_backward under bf16"):
        precision.check(TrainConfig(mode="full", optimizer_in_backward=True, grad_clip=0))


def test_quantised_optimizers_refuse_zero():
    with pytest.raises(ValueError, match="adamw8bit needs train.zero_stage 0"):
        TrainConfig(optimizer="adamw8bit", zero_stage=2)


@pytest.mark.parametrize("zero_stage", [0, 1, 3])
@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_quantised_optimizers_refuse_cpu_offloaded_states_by_name(name, zero_stage):
    """CPU-offloaded optimizer states are ZeRO's offload_optimizer (torchao's CPUOffloadOptimizer is not offered):
    the quantised optimizers refuse it naming both, whatever the ZeRO stage, rather than sending the user from
    one ZeRO error to the other."""
    with pytest.raises(ValueError, match=f"train.optimizer {name} cannot have train.offload_optimizer"):
        TrainConfig(optimizer=name, offload_optimizer=True, zero_stage=zero_stage)


def test_convergence_compares_optimizers_by_name(tmp_path):
    """``diffpipe bench --convergence`` with bench.convergence_optimizers: one point per precision and optimizer,
    each a valid config setting the optimizer explicitly; with plain adamw only, the points stay as before."""
    from diffpipe.bench.convergence import PRECISIONS, convergence_points
    from diffpipe.bench.grid import point_config
    from diffpipe.config import Config

    assert convergence_points(["fp32", "bf16"], ["adamw"]) == [("fp32", PRECISIONS["fp32"]),
                                                               ("bf16", PRECISIONS["bf16"])]
    named = convergence_points(["fp32"], ["adamw", "adamw8bit", "adamw4bit", "adamw8bit-in-backward"])
    assert [n for n, _ in named] == ["adamw", "adamw8bit", "adamw4bit", "adamw8bit-in-backward"]
    cfg = Config.model_validate({"datasets": [{"name": "d", "path": "data"}],
                                 "train": {"mode": "full", "grad_clip": 0, "optimizer_in_backward": True}})
    trains = [point_config(cfg, p, output_dir=str(tmp_path), steps=3).train for _, p in named]
    assert [(t.optimizer, t.optimizer_in_backward) for t in trains] == [
        ("adamw", False), ("adamw8bit", False), ("adamw4bit", False), ("adamw8bit", True)]
    assert [n for n, _ in convergence_points(["fp32", "bf16"], ["adamw", "adamw8bit"])] == [
        "fp32 adamw", "fp32 adamw8bit", "bf16 adamw", "bf16 adamw8bit"]


def test_quantised_optimizer_steps_inside_the_flop_counter():
    """The first step of a run is counted under torch's FLOP counter (a dispatch mode), which torchao's compiled
    step refuses to trace in: the step runs outside it."""
    from torch.utils.flop_counter import FlopCounterMode

    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = build_optimizer([p], TrainConfig(optimizer="adamw8bit"))
    p.grad = torch.ones_like(p)
    with FlopCounterMode(display=False):
        opt.step()
    assert opt.state[p]["step"] == 1
