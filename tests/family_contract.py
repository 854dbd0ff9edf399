"""The behavioural family contract: each family's tiny flavor built and run, check by check.

A plain module (not a conftest), so ``tests/unit/test_family_runs.py`` runs it over every registered
family and variant, and its planted-mistakes test runs it over broken copies of a family. Each check
raises :class:`ContractError` with a message naming the family and what is wrong, so a failure says
what to fix (a spec check that only looks at names passes a family that cannot run: STYLE.md 15).

What one case builds (:func:`build`): the family's tiny VAE, tokenizers and text encoders, and its
denoiser; two captions encoded; pixels at the smallest size the family accepts (twice its pixel
multiple; the smallest clip past one frame for video) encoded to latents, and control images where the
family conditions on them; the default LoRA targets injected with non-zero ``up`` matrices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from diffpipe.config import LoraConfig, ModelConfig, ObjectiveConfig, TokenRoutingConfig
from diffpipe.config.base import ConfigError
from diffpipe.families import Absent, family_names, get_family, spec
from diffpipe.models import routing
from diffpipe.models.base import Family
from diffpipe.models.layers import run_layers
from diffpipe.models.routing import TokenRoute
from diffpipe.models.spec import FamilySpec, Kohya

#: Captions of equal token counts in every tiny tokenizer: families whose pipeline layers take one
#: prompt length per micro-batch (CogView4, Kandinsky 5) run them too.
CAPTIONS = ["a red circle", "a red square"]


class ContractError(AssertionError):
    """A family breaks its contract; the message names the family and the mistake."""


@dataclass(frozen=True)
class Case:
    """One family as ``model:`` configures it: a variant (None: the family's default) and an expert."""

    family: str
    variant: str | None = None
    expert: str | None = None

    @property
    def id(self) -> str:
        return "-".join(p for p in (self.family, self.variant, self.expert) if p)

    def config(self) -> ModelConfig:
        return ModelConfig(family=self.family, variant=self.variant, expert=self.expert)


def cases(names: list[str] | None = None) -> list[Case]:
    """Every registered family, and each of its variants, from the registry and the family classes.

    A variant that needs ``model.expert`` (Wan 2.2 A14B's two experts) runs its low-noise expert, the
    one trained on ``transformer_2``."""
    out = []
    for name in names or family_names():
        variants = spec(name).family_type().variants or (None,)
        for variant in variants:
            case = Case(name, variant)
            try:
                get_family(case.config())
            except ValueError as err:
                if not str(err).startswith("model.expert"):
                    raise
                case = Case(name, variant, "low")
            out.append(case)
    return out


@dataclass
class Built:
    """A case's tiny components and one encoded batch, built once and shared by the checks."""

    case: Case
    spec: FamilySpec
    family: Family
    denoiser: torch.nn.Module  # with the default LoRA targets injected
    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    aux: dict[str, Any]  # the loss's extra inputs (control latents)
    targets: list[str]
    keymap: Any = None  # the key map built from the clean denoiser (None: the spec says absent)
    keymap_error: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.case.id


def _fail(case: Case | str, what: str) -> ContractError:
    return ContractError(f"{case.id if isinstance(case, Case) else case}: {what}")


def _pixels(family: Family, frames: int, g: torch.Generator) -> torch.Tensor:
    side = 2 * family.pixel_multiple
    return torch.rand(2, 3, frames, side, side + family.pixel_multiple, generator=g) * 2 - 1


def _frames(family: Family) -> int:
    """The smallest clip the family's VAE takes past one frame (one frame for an image family)."""
    step, offset = family.frame_rule
    # A variant continuing a clip (SkyReels-V2 df-v2v) keeps its first ``prefix_frames`` clean: one step past them.
    return max(step + offset, getattr(family, "prefix_frames", 0) + step) if family.is_video else 1


def build(case: Case) -> Built:
    """The case's tiny family, its encoded batch and its LoRA denoiser; an error naming the part that
    cannot be built or encoded."""
    try:
        family = get_family(case.config())
    except Exception as err:
        raise _fail(case, f"the family cannot be configured: {err}") from err
    s = spec(case.family)
    g = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            vae, encoders = family.load_vae(), family.load_text_encoders()
            pixels = _pixels(family, _frames(family), g)
            latents = family.encode_pixels(vae, pixels)
            aux = {}
            if family.uses_control:  # the other item's first frame (and last, FLF2V) as its control
                control = pixels.flip(0)[:, :, [0, -1] if family.uses_last_frame else [0]]
                aux = family.encode_control(vae, control, frames=pixels.shape[2])
            if family.text_uses_control:
                from PIL import Image

                images = [Image.fromarray(((p[:, 0].permute(1, 2, 0) + 1) * 127.5).byte().numpy())
                          for p in pixels.flip(0)]
                text = family.encode_text(encoders, CAPTIONS, images)
            else:
                text = family.encode_text(encoders, CAPTIONS)
    except Exception as err:
        raise _fail(case, f"the tiny VAE or text encoders cannot encode a batch: {type(err).__name__}: {err}") from err
    try:
        denoiser = family.load_denoiser()
    except Exception as err:
        raise _fail(case, f"the tiny denoiser cannot be built: {type(err).__name__}: {err}") from err
    keymap, keymap_error = None, ""
    if not isinstance(s.keymap, Absent):
        from diffpipe.export.keymaps import keymap_for_model

        try:
            keymap = keymap_for_model(case.family, denoiser)
        except Exception as err:  # reported by check_keymap
            keymap_error = f"{type(err).__name__}: {err}"
    targets = family.lora_targets(None)
    _add_lora(case, denoiser, targets)
    return Built(case, s, family, denoiser, latents, text, aux, targets, keymap, keymap_error)


def _add_lora(case: Case, denoiser: torch.nn.Module, targets: list[str]) -> None:
    from diffpipe.training import adapter

    try:
        adapter.add_lora(denoiser, adapter.peft_config(LoraConfig(rank=2), targets))
    except ValueError as err:
        raise _fail(case, f"the default LoRA targets cannot be injected: {err}") from err
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero LoRA: its A matrices get gradients and the layers must hold it
        for n, p in denoiser.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    denoiser.train()  # as training runs it (HiDream's forward differs in train mode)


# -- the checks ------------------------------------------------------------------------------------
def check_published(name: str, denoiser_cls: type, variants: tuple[str, ...]) -> None:
    """Each published model names this family, a variant it has, and the tiny denoiser's class."""
    s = spec(name)
    if not s.published:
        raise _fail(name, "flavors.PUBLISHED is empty: add the published models' denoiser configs")
    for p in s.published:
        if p.family != name:
            raise _fail(name, f"published model {p.name!r} names family {p.family!r}: write {name!r}")
        if p.cls != denoiser_cls.__name__:
            raise _fail(name, f"published model {p.name!r} names class {p.cls!r}, but the family's denoiser is "
                        f"{denoiser_cls.__name__}: write {denoiser_cls.__name__!r}")
        if p.variant is not None and p.variant not in variants:
            raise _fail(name, f"published model {p.name!r} names variant {p.variant!r}; the family has "
                        f"{', '.join(variants) or 'none'}")


def check_lora_targets(b: Built) -> None:
    """Every default LoRA target matches a module (PEFT matches a name or a ``.``-suffix of one)."""
    names = [n for n, _ in b.denoiser.named_modules()]
    dead = [t for t in b.targets if not any(n == t or n.endswith("." + t) for n in names)]
    if dead:
        raise _fail(b.case, f"LoRA target(s) {dead} match no module of the tiny denoiser: fix or drop them in "
                    "default_lora_targets")


def _lora_modules(denoiser: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {n: m for n, m in denoiser.named_modules() if isinstance(m, BaseTunerLayer)}


def check_step(b: Built) -> None:
    """One prepare -> loss -> backward: a finite per-sample loss, finite gradients on the LoRA alone,
    and every LoRA layer reached by the gradient."""
    for p in b.denoiser.parameters():
        p.grad = None
    try:
        loss = b.family.loss(b.denoiser, b.latents, b.text, torch.Generator().manual_seed(2), **b.aux)
    except Exception as err:
        raise _fail(b.case, f"one training step on the tiny flavor fails (does the tiny config fit the "
                    f"family's latents and text?): {type(err).__name__}: {err}") from err
    if loss.shape != (b.latents.shape[0],) or not torch.isfinite(loss).all():
        raise _fail(b.case, f"the loss is {loss}: want a finite per-sample loss of shape ({b.latents.shape[0]},)")
    loss.mean().backward()
    frozen = [n for n, p in b.denoiser.named_parameters() if p.requires_grad and "lora_" not in n]
    if frozen:
        raise _fail(b.case, f"base weights train beside the LoRA: {frozen[:3]}")
    reached = {n for n, m in _lora_modules(b.denoiser).items()
               if any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters() if p.requires_grad)}
    # Per target, not per layer: the last joint block's text-side query and output feed only text outputs the
    # model discards, in the published models too.
    unused = [t for t in b.targets if not any(n == t or n.endswith("." + t) for n in reached)]
    if unused:
        raise _fail(b.case, f"LoRA target(s) {unused} get no gradient from the loss: no layer they match takes "
                    "part in the training step")
    bad = [n for n, p in b.denoiser.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad:
        raise _fail(b.case, f"non-finite gradients in {bad[:3]}")


def check_layers(b: Built) -> None:
    """The pipeline layers run in order predict what the denoiser's forward predicts, and the pipeline's
    loss equals the family's; a variant the spec says the layers refuse is refused with a reason."""
    from diffpipe.training.pipeline import pipeline_loss_fn

    if isinstance(b.spec.layers, Absent):
        try:
            b.family.pipeline_layers(b.denoiser)
        except ValueError as err:
            if b.spec.layers.reason not in str(err):
                raise _fail(b.case, f"pipeline layers refused without the spec's reason: {err}") from err
            return
        raise _fail(b.case, "the spec says the pipeline layers are absent, yet the family builds them")
    o = ObjectiveConfig()
    with torch.no_grad():
        try:
            layers = b.family.pipeline_layers(b.denoiser)
            inputs, labels = b.family.pipeline_inputs(b.latents, b.text, torch.Generator().manual_seed(3), o,
                                                      **b.aux)
        except ValueError as err:
            if b.spec.layers_refused and "pipeline" in str(err):
                return  # a variant the docs' table says the layers refuse (spec.layers_refused)
            raise _fail(b.case, f"pipeline layers cannot be built: {err}") from err
        prepared = b.family.prepare(b.latents, b.family.text_from_ids(b.denoiser, b.text),
                                    torch.Generator().manual_seed(3), objective=o, **b.aux)
        want = b.family.predict(b.denoiser, prepared)
        try:
            got = run_layers(layers, inputs)
        except Exception as err:
            raise _fail(b.case, f"the {len(layers)} pipeline layers do not run in order: "
                        f"{type(err).__name__}: {err}") from err
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise _fail(b.case, f"the pipeline layers' composition gives {shape}, the forward's output is "
                        f"{tuple(want.shape)}: is a layer (the output layer?) missing from the list?")
        diff = (got.float() - want.float()).abs().max().item()
        if not diff <= 1e-4 * max(1.0, want.abs().max().item()):
            raise _fail(b.case, f"the pipeline layers' composition differs from the forward's output by {diff:.2e}")
        mine = pipeline_loss_fn(o)(got, labels)
        theirs = b.family.loss(b.denoiser, b.latents, b.text, torch.Generator().manual_seed(3), objective=o,
                               **b.aux).mean()
        if not math.isclose(mine.item(), theirs.item(), rel_tol=1e-5, abs_tol=1e-6):
            raise _fail(b.case, f"the pipeline loss {mine.item():.6g} differs from the family's loss "
                        f"{theirs.item():.6g}: pipeline_inputs and prepare disagree")


def check_token_streams(b: Built) -> None:
    """Each token stream reads a tokenizer the family loads, with a positive limit; counts and limits
    name the same streams."""
    family = b.family
    bundle = family.load_tokenizers()
    parts = getattr(bundle, "parts", None) or vars(bundle)
    for label, (tok, limit) in family.token_streams.items():
        if parts.get(tok) is None:
            raise _fail(b.case, f"token stream {label!r} reads tokenizer {tok!r}, which the family does not load "
                        f"(its tokenizers: {', '.join(k for k, v in parts.items() if v is not None)})")
        if limit not in ("sequence", "tokenizer"):
            raise _fail(b.case, f"token stream {label!r}: limit {limit!r} is neither 'sequence' nor 'tokenizer'")
    try:
        limits = family.token_limits(bundle)
        counts = family.count_tokens(bundle, CAPTIONS)
    except Exception as err:
        raise _fail(b.case, f"the token streams cannot be counted: {type(err).__name__}: {err}") from err
    if set(limits) != set(counts) or not limits:
        raise _fail(b.case, f"token limits {sorted(limits)} and counts {sorted(counts)} name different streams")
    for label, n in limits.items():  # counts may pass the limit: a family's template (Lumina 2's) counts too
        if not (isinstance(n, int) and n > 0) or not all(isinstance(c, int) and c > 0 for c in counts[label]):
            raise _fail(b.case, f"token stream {label!r}: limit {n}, counts {counts[label]} for short captions")


def check_keymap(b: Built) -> None:
    """The key map is built for the family's denoiser class, covers every module the LoRA trains, and
    gives kohya metadata; or the spec says it is absent, and there is no ``keymap.py``."""
    if isinstance(b.spec.keymap, Absent):
        return
    module = b.spec.keymap_module()
    cls = type(b.denoiser)
    if getattr(module, "DENOISER", None) is not cls:
        raise _fail(b.case, f"keymap.DENOISER is {getattr(module, 'DENOISER', None)!r}, the family's denoiser is "
                    f"{cls.__name__}: set DENOISER = {cls.__name__}")
    kohya = getattr(module, "KOHYA", None)
    try:
        k = b.spec.kohya_for(dict(b.denoiser.config))
    except Exception as err:
        raise _fail(b.case, f"keymap.KOHYA is {kohya!r}: a key map needs a Kohya(...) or a function of the denoiser "
                    f"config giving one ({type(err).__name__}: {err})") from err
    if not isinstance(k, Kohya) or not all(dataclasses.astuple(k)):
        raise _fail(b.case, f"keymap.KOHYA gives {k!r}: want a Kohya with every field set")
    if b.keymap is None:
        raise _fail(b.case, f"keymap.build fails on the tiny denoiser: {b.keymap_error}")
    trained = [n for n in _lora_modules(b.denoiser)]
    unmapped = [n for n in trained if n not in b.keymap.by_module]
    if unmapped:
        raise _fail(b.case, f"the key map does not cover {len(unmapped)} trained module(s), e.g. {unmapped[:3]}: "
                    "the comfyui and kohya files would drop them")


def _routed_loss(b: Built, keep: float | None, seed: int = 2) -> torch.Tensor:
    stack = b.family.routed_stack
    blocks = sum(len(getattr(m, n)) for m in _routed_transformers(b) for n in stack.lists) // len(_routed_transformers(b))
    route = None if keep is None else TokenRoute(keep, 0, blocks, torch.Generator().manual_seed(7))
    return b.family.loss(b.denoiser, b.latents, b.text, torch.Generator().manual_seed(seed), route=route, **b.aux)


def _routed_transformers(b: Built) -> list[torch.nn.Module]:
    return routing._transformers(b.denoiser, b.family.routed_stack)


def _route_ends(b: Built) -> tuple[dict, list]:
    """Hooks seeing the hidden states entering the first routed block and leaving the last (all blocks)."""
    seen: dict[str, torch.Tensor] = {}
    tr = _routed_transformers(b)[-1]
    blocks = [blk for n in b.family.routed_stack.lists for blk in getattr(tr, n)]
    where = b.family.routed_stack.output

    def enter(_m, args, kwargs):
        seen.setdefault("in", kwargs.get("hidden_states", args[0] if args else None))

    def leave(_m, _args, out):
        seen["out"] = out if where is None else out[where]

    return seen, [blocks[0].register_forward_pre_hook(enter, with_kwargs=True),
                  blocks[-1].register_forward_hook(leave)]


def check_token_routing(b: Built) -> None:
    """``train.token_routing``: refused by name without a declared block stack; with one, keep = 1 is the plain
    loss bit for bit, keep < 1 leaves the skipped tokens as they entered the routed blocks and changes the
    kept ones, the LoRA still gets gradients, and a forward outside a routed step uses every token again."""
    if b.family.routed_stack is None:
        try:
            b.family.check_token_routing(TokenRoutingConfig(start_block=0, end_block=2))
        except ConfigError as err:
            if "train.token_routing" in str(err):
                return
        raise _fail(b.case, "train.token_routing is not refused by name, yet the family declares no block stack")
    with torch.no_grad():
        plain = _routed_loss(b, None)
        if not torch.equal(_routed_loss(b, 1.0), plain):
            raise _fail(b.case, "token routing with keep 1 changes the loss")
        seen, hooks = _route_ends(b)
        try:
            routed_loss = _routed_loss(b, 0.5)
        finally:
            for h in hooks:
                h.remove()
        kept = _routed_transformers(b)[-1].__dict__["_diffpipe_router"].state.kept
        skipped = [i for i in range(seen["in"].shape[1]) if i not in set(kept.tolist())]
        if not skipped or len(kept) == seen["in"].shape[1]:
            raise _fail(b.case, f"keep 0.5 of {seen['in'].shape[1]} tokens kept {len(kept)}")
        if not torch.equal(seen["out"][:, skipped], seen["in"][:, skipped]):
            raise _fail(b.case, "tokens routed around the blocks do not rejoin unchanged")
        if torch.equal(seen["out"][:, kept], seen["in"][:, kept]):
            raise _fail(b.case, "the kept tokens did not go through the routed blocks")
        if torch.equal(routed_loss, plain) or not torch.isfinite(routed_loss).all():
            raise _fail(b.case, f"the routed loss {routed_loss} vs {plain}: want a finite, different loss")
        if not torch.equal(_routed_loss(b, None), plain):
            raise _fail(b.case, "a forward after a routed one (evaluation) does not use every token")
    for p in b.denoiser.parameters():
        p.grad = None
    _routed_loss(b, 0.5).mean().backward()
    if not any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in b.denoiser.named_parameters()
               if "lora_" in n):
        raise _fail(b.case, "no LoRA gradient through a routed step")


CHECKS = {
    "lora_targets": check_lora_targets,
    "step": check_step,
    "layers": check_layers,
    "token_streams": check_token_streams,
    "keymap": check_keymap,
    "token_routing": check_token_routing,
}
