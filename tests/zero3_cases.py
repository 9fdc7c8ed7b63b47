"""Rank-side code for the ZeRO-3 (optim_grads_params) tests (runs inside DistPool workers).

Every training case builds the same model on every rank, trains it with megabuf DDP under the
case's config + megabuf's DistributedOptimizer(AdamW) on this rank's slice of the global batch,
trains a twin with torch's AdamW on the whole global batch in this process, and returns the
largest deviation per param (read through `state_dict()`, which gathers unit by unit) plus the
final params, so the test side can also compare runs with each other bitwise.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from grad_cases import NATIVE_GLOO
from torch import nn
from torch.utils.checkpoint import checkpoint

import megabuf
from megabuf.testing.models import GPT, GPTConfig, MLPStack, gpt_loss
from megabuf.transport.collectives import Collectives

GLOBAL_BATCH = 8
DIM = 16
LR = 1e-2
ZERO3: dict[str, Any] = {"data_parallel_sharding_strategy": "optim_grads_params"}
GPT_CFG = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=2, d_ff=64)


class Twice(nn.Module):
    """`shared` runs twice per forward (one unit, two calls)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.shared = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        return self.out(torch.tanh(self.shared(h)))


class _Block(nn.Module):
    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.fixed = nn.Linear(DIM, DIM)
        self.fixed.requires_grad_(not frozen)
        self.gain = nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `fixed` (frozen in FrozenNet) is read in backward after `gain`'s grad is ready
        h = torch.tanh(self.lin(x))
        return torch.tanh(self.fixed(h * self.gain))


class Blocks(nn.Module):
    """A ModuleList of blocks (the default units); `ckpt` wraps each in activation
    checkpointing; `order` runs them in another order than registered; `frozen` freezes each
    block's `fixed` (a unit with frozen and trainable params)."""

    def __init__(self, n: int = 3, *, ckpt: bool = False, frozen: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(frozen) for _ in range(n))
        self.head = nn.Linear(DIM, DIM)
        self.ckpt = ckpt
        self.order = list(range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            block = self.blocks[i]
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt else block(x)
        return self.head(x)


class ParentReads(nn.Module):
    """The parent reads a child's weight through F.linear (the child's forward never runs) and
    multiplies by the members of an nn.ParameterList."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.inner = nn.Linear(DIM, DIM)  # never called
        self.gains = nn.ParameterList([nn.Parameter(1 + 0.1 * torch.randn(DIM)) for _ in range(2)])
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        h = torch.tanh(F.linear(h, self.inner.weight, self.inner.bias))
        for gain in self.gains:
            h = h * gain
        return self.out(h)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": lambda: MLPStack(DIM, 4, seed=0),
    "gpt": lambda: GPT(GPT_CFG, seed=0),
    "twice": Twice,
    "ckpt": lambda: Blocks(ckpt=True),
    "frozen": lambda: Blocks(frozen=True),
    "blocks": Blocks,
    "permuted": Blocks,
    "parent_reads": ParentReads,
}


def _permute(model: nn.Module) -> None:
    model.order = [2, 0, 1]  # type: ignore[assignment]


def make_model(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[case.get("model", "mlp")]()
    if case.get("model") == "permuted":
        _permute(model)
    if case.get("bf16"):
        model.to(torch.bfloat16)
    return model


def data(case: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    if case.get("model") == "gpt":
        seq = torch.randint(0, GPT_CFG.vocab_size, (GLOBAL_BATCH, GPT_CFG.seq_len + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, DIM, generator=g)


def loss_of(case: dict[str, Any], out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return gpt_loss(out, y) if case.get("model") == "gpt" else F.mse_loss(out, y)


def local(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def wrap(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    """The case's model under ZeRO-3 (or under the strategy its "ddp" names)."""
    cfg = megabuf.DistributedDataParallelConfig.from_dict({**ZERO3, **case.get("ddp", {})})
    module = make_model(case)
    if case.get("expert"):  # ep=1: expert params replicated over expt_dp == dp
        megabuf.mark_expert_parallel(module.layers[-1].parameters())
    collectives = Collectives(NATIVE_GLOO) if case.get("native") else None
    model = megabuf.DistributedDataParallel(module, cfg, collectives=collectives)
    opt = megabuf.DistributedOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.01)
    return model, opt


def micro(case: dict[str, Any], model: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward and backward of `case["micro"]` micro-batches (all but the last in no_sync())."""
    m = case.get("micro", 1)
    n = x.shape[0] // m
    for i in range(m):
        last = i == m - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss = loss_of(case, model(x[i * n : (i + 1) * n]), y[i * n : (i + 1) * n])
            (loss / m).backward()


def unit_holds(model: megabuf.DistributedDataParallel) -> dict[str, bool]:
    """Per unit with sharded params: does its full storage hold memory now?"""
    units = model.engine.param_side.units.runtime.units  # type: ignore[attr-defined]
    return {u.name or "<root>": all(p.holds_full for p in u.params) for u in units if u.params}


def train_case(case: dict[str, Any]) -> dict[str, Any]:
    """`steps` AdamW steps against the single-process reference; the final params."""
    model, opt = wrap(case)
    ref = make_model(case)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    caught: list[str] = []
    for step in range(case.get("steps", 3)):
        if case.get("reorder_at") == step:  # both runs change their forward order
            _permute(model.module)
            _permute(ref)
        x, y = data(case, step)
        opt.zero_grad()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            micro(case, model, local(x), local(y))
        caught += [str(w.message) for w in seen]
        opt.step()
        ref_opt.zero_grad()
        loss_of(case, ref(x), y).backward()
        ref_opt.step()
    state = model.state_dict()
    want = ref.state_dict()
    x, _ = data(case, 99)
    with torch.no_grad():
        eval_err = (model(x) - ref(x)).abs().max().item()
    return {
        "errors": {k: (state[k] - want[k]).abs().max().item() for k in want},
        "keys": list(state) == list(want),
        "final": {k: v.clone() for k, v in state.items()},
        "eval_err": eval_err,
        "released": not any(unit_holds(model).values()),
        "ledger_now": model.engine.memory_ledger.now("unsharded_params"),
        "warnings": caught,
        "gathers": sum(g.sharded_params.gathers for g in model.engine.all_bucket_groups),
        "expert_groups": len(model.engine.expert_parallel_bucket_groups),
        "strategy": model.engine.collectives.strategy(model.process_groups.dp, torch.device("cpu")),
        "frozen_whole": [  # frozen params are not sharded: whole on every rank, always
            p.untyped_storage().nbytes() >= p.numel() * p.element_size()
            for p in model.module.parameters()
            if not p.requires_grad
        ],
    }


def optim_case(case: dict[str, Any]) -> dict[str, Any]:
    """The same training under another strategy (no reference): final params only."""
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case["ddp"])
    model = megabuf.DistributedDataParallel(make_model(case), cfg)
    opt = megabuf.DistributedOptimizer(model, torch.optim.AdamW, lr=LR, weight_decay=0.01)
    dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    for step in range(case.get("steps", 3)):
        x, y = data(case, step)
        opt.zero_grad()
        x = local(x) if case.get("model") == "gpt" else local(x).to(dtype)
        loss_of(case, model(x).float(), local(y)).backward()
        opt.step()
    return {"final": {k: v.clone() for k, v in model.state_dict().items()}}


def release_case(case: dict[str, Any]) -> dict[str, Any]:
    """Which units hold full params at each promised point of one training step."""
    model, opt = wrap(case)
    units = model.engine.param_side.units.runtime.units  # type: ignore[attr-defined]
    seen: dict[str, Any] = {"post_forward": {}, "in_backward": {}}

    def at_post_forward(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            seen["post_forward"][name] = unit_holds(model)[name]
            if out.requires_grad:  # fires once the later units' backward is done
                out.register_hook(lambda g: _note(seen["in_backward"], name, unit_holds(model)))

        return hook

    for unit in units:
        if unit.params and unit.name:
            unit.module.register_forward_hook(at_post_forward(unit.name))
    x, y = data(case, 0)
    opt.zero_grad()
    loss = loss_of(case, model(local(x)), local(y))
    seen["after_forward"] = unit_holds(model)
    runtime = model.engine.param_side.units.runtime  # type: ignore[attr-defined]
    seen["phases"] = [runtime.phase.name]
    loss.backward()
    seen["after_backward"] = unit_holds(model)
    seen["phases"].append(runtime.phase.name)
    seen["strategy"] = type(model.ddp_config.sharding).__name__
    opt.step()
    seen["after_step"] = unit_holds(model)
    seen["ledger_now"] = model.engine.memory_ledger.now("unsharded_params")
    seen["ledger_peak"] = model.engine.memory_ledger.peak("unsharded_params")
    seen["unit_nbytes"] = {
        u.name or "<root>": sum(p.full_nbytes for p in u.params) for u in units if u.params
    }
    seen["order"] = [u.name for u in units]
    model.engine.memory_ledger.reset_peaks()
    model.state_dict()
    seen["state_dict_peak"] = model.engine.memory_ledger.peak("unsharded_params")
    return seen


def _note(where: dict[str, Any], key: str, value: Any) -> None:
    where.setdefault(key, value)


def read_case(case: dict[str, Any]) -> dict[str, Any]:
    """A read of a released param outside forward: an error (default) or NaN (verify mode);
    inside summon_full_params() the values are there."""
    model, _ = wrap(case)
    weight = model.module.head.weight
    out: dict[str, Any] = {}
    try:
        out["value"] = F.linear(torch.ones(1, DIM), weight).sum().item()
    except RuntimeError as exc:
        out["error"] = str(exc)
    with model.summon_full_params():
        out["summoned"] = bool(torch.isfinite(weight).all())
        out["summoned_holds"] = all(unit_holds(model).values())
    out["released_after"] = not any(unit_holds(model).values())
    return out


def error_case(case: dict[str, Any]) -> dict[str, str]:
    """Named errors: an illegal state transition, state_dict(keep_vars=True)."""
    model, _ = wrap(case)
    group = model.engine.all_bucket_groups[0]
    errors = {}
    for label, fn in {
        "finish_unstarted": group.sharded_params.finish_param_gather,  # type: ignore[union-attr]
        "release_released": group.sharded_params.release_params,  # type: ignore[union-attr]
        "keep_vars": lambda: model.state_dict(keep_vars=True),
        "positional": lambda: model.state_dict(None),
    }.items():
        try:
            fn()
            errors[label] = "no error"
        except (RuntimeError, ValueError) as exc:
            errors[label] = f"{type(exc).__name__}: {exc}"
    errors["state"] = group.sharded_params.state.name  # type: ignore[union-attr]
    return errors


def stray_read_case(case: dict[str, Any]) -> str:
    """A unit set under which the parent reads released params: the first forward raises a
    named error (on every rank, at the same point) instead of reading an empty storage."""
    model, _ = wrap(case)
    x, _ = data(case, 0)
    try:
        model(local(x))
    except RuntimeError as exc:
        model.reset_iter_state()
        return str(exc)
    return "no error"


def _steps(case: dict[str, Any], model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        x, y = data(case, step)
        opt.zero_grad()
        loss_of(case, model(local(x)), local(y)).backward()
        opt.step()


def checkpoint_case(root: str, case: dict[str, Any]) -> dict[str, Any]:
    """Save under ZeRO-3 after 3 steps, run 2 more; resume the file under `resume_ddp` (and
    under ZeRO-3 again) and run the same 2 steps: the final params of all three."""
    path = os.path.join(root, case["name"])
    model, opt = wrap(case)
    _steps(case, model, opt, range(3))
    megabuf.save_checkpoint(path, model, opt)
    _steps(case, model, opt, range(3, 5))
    out = {"uninterrupted": {k: v.clone() for k, v in model.state_dict().items()}}
    for label, ddp in (("zero3", case.get("ddp", {})), ("other", case["resume_ddp"])):
        other, other_opt = wrap({**case, "ddp": ddp})
        megabuf.load_checkpoint(path, other, other_opt)
        _steps(case, other, other_opt, range(3, 5))
        out[label] = {k: v.clone() for k, v in other.state_dict().items()}
    return out


def load_case(case: dict[str, Any]) -> dict[str, Any]:
    """load_state_dict writes the loaded values into the shards: a forward and a training
    step after loading equal the reference's that loaded the same values."""
    model, opt = wrap(case)
    ref = make_model(case)
    torch.manual_seed(7)
    new = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
    model.load_state_dict(new)
    ref.load_state_dict(new)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    x, y = data(case, 0)
    opt.zero_grad()
    loss_of(case, model(local(x)), local(y)).backward()
    opt.step()
    loss_of(case, ref(x), y).backward()
    ref_opt.step()
    state, want = model.state_dict(), ref.state_dict()
    return {"errors": {k: (state[k] - want[k]).abs().max().item() for k in want}}


def states_case(case: dict[str, Any]) -> list[str]:
    """Every group's param state after a no-grad forward (evaluation): all SHARDED."""
    model, _ = wrap(case)
    x, _ = data(case, 0)
    with torch.no_grad():
        model(local(x))
    return [g.sharded_params.state.name for g in model.engine.all_bucket_groups]  # type: ignore[union-attr]
