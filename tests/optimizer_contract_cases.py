"""Rank-side code for the optimizer step-contract tests (runs inside DistPool workers, dp=2).

Each case trains the `optimizer_cases.Net` model with a megabuf optimizer and checks one clause of
[Note: optimizer step]: a non-finite grad norm skips the step on every rank, step() refuses grads
that are not this iteration's reduced grads, and fp32 main params follow edits of the model params.
Every case returns plain values; an exception is caught here and returned as its traceback, so
one failing case does not hide the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from dist_pool import run_each
from optimizer_cases import (
    TORCH_OPTIMIZERS,
    Net,
    Reference,
    build_model,
    build_opt,
    loss_fn,
    make_data,
    optimizer_kwargs,
    param_errors,
    param_groups,
    train_step,
)
from optimizer_cases import local_slice as _local

import megabuf

BF16_DDP = {"grad_reduce_in_fp32": True}
DISTOPT = {"use_distributed_optimizer": True}
OVERLAP = {"overlap_grad_reduce": True, "bucket_size": 50}

NONFINITE: dict[str, dict[str, Any]] = {
    # configs/distopt_overlap.toml: fp32 params, overlapped reduce-scatter and param gather
    "distopt_fp32_overlap": {
        "optimizer": "adamw",
        "ddp": {**DISTOPT, **OVERLAP, "overlap_param_gather": True},
    },
    # bf16 grads: the main params' grads are fp32 copies that a skipped step must release
    "distopt_bf16_grads": {"optimizer": "sgd", "bf16": True, "ddp": DISTOPT},
    "mixed_bf16": {"optimizer": "adamw", "bf16": True, "eps": 1e-4, "ddp": BF16_DDP},
    "fp32_optimizer": {"optimizer": "adam", "cls": "fp32", "ddp": OVERLAP},
}
DEFERRED = {"sync_grads_at_backward_end": False}
UNSYNCED: dict[str, dict[str, Any]] = {
    "opt_zero_grad-distopt": {"mode": "opt_zero_grad", "ddp": DISTOPT},
    "zero_grad_buffer-mixed": {"mode": "zero_grad_buffer", "ddp": {}},
    # the sync is left to finish_grad_sync() (Megatron's loop), which the case never calls
    "backward_without_finish-distopt_overlap": {
        "mode": "no_finish",
        "ddp": {**DISTOPT, **OVERLAP, "overlap_param_gather": True, **DEFERRED},
    },
    "backward_without_finish-mixed": {"mode": "no_finish", "ddp": DEFERRED},
}
_BF16_ADAM = {"optimizer": "adamw", "bf16": True, "eps": 1e-4}
EDITS: dict[str, dict[str, Any]] = {
    f"{edit}-{opt}": {**_BF16_ADAM, "edit": edit, "ddp": ddp}
    for edit in ("load_state_dict", "no_grad", "data_and_reload")
    for opt, ddp in (("mixed", BF16_DDP), ("distopt", {**DISTOPT, **BF16_DDP}))
}
EDITS["load_state_dict-distopt_overlap_param_gather"] = {
    **_BF16_ADAM,
    "edit": "load_state_dict",
    "ddp": {**DISTOPT, **BF16_DDP, **OVERLAP, "overlap_param_gather": True},
}
# SGD steps far below bf16 resolution: they only add up in fp32 main params.
PRECISION: dict[str, dict[str, Any]] = {
    "mixed": {"optimizer": "sgd", "bf16": True, "lr": 1e-4, "steps": 6, "ddp": BF16_DDP},
    "distopt": {
        "optimizer": "sgd",
        "bf16": True,
        "lr": 1e-4,
        "steps": 6,
        "ddp": {**DISTOPT, **BF16_DDP, "bucket_size": 60},
    },
}

# The optimizer's own load_state_dict; fp32_optimizer: the main params are the model params.
ROUNDTRIP: dict[str, dict[str, Any]] = {
    "fp32_optimizer": {"optimizer": "adam", "cls": "fp32", "ddp": {}},
    "mixed_bf16": {**_BF16_ADAM, "ddp": BF16_DDP},
    "distopt_bf16": {**_BF16_ADAM, "ddp": {**DISTOPT, **BF16_DDP}},
}


def all_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    cases: dict[str, tuple[str, dict[str, Any]]] = {}
    cases.update({f"nonfinite/{n}": ("nonfinite", c) for n, c in NONFINITE.items()})
    cases.update({f"unsynced/{n}": ("unsynced", c) for n, c in UNSYNCED.items()})
    cases.update({f"edit/{n}": ("edit", c) for n, c in EDITS.items()})
    cases.update({f"precision/{n}": ("precision", c) for n, c in PRECISION.items()})
    cases.update({f"roundtrip/{n}": ("roundtrip", c) for n, c in ROUNDTRIP.items()})
    return cases


# ---- helpers ------------------------------------------------------------------------------------
def _build(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    model = build_model(case)
    if case.get("cls") != "fp32":
        return model, build_opt(model, case)
    name = case.get("optimizer", "adam")
    kwargs = optimizer_kwargs(name, case)
    groups = param_groups(model.module, kwargs["lr"])
    return model, megabuf.FP32Optimizer(model, TORCH_OPTIMIZERS[name], groups, **kwargs)


def _params(model: megabuf.DistributedDataParallel) -> list[torch.Tensor]:
    model.publish_params()
    return [p.detach().clone() for p in model.module.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _state(opt: Any) -> list[torch.Tensor]:
    """Copies of this rank's main params and every inner optimizer state entry of them."""
    out = []
    for domain in opt.domains:
        for mp in domain.main_params:
            out.append(mp.main.detach().clone())
            for value in domain.optimizer.state.get(mp.main, {}).values():
                tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                out.append(tensor.detach().clone())
    return out


def _scale(ref: Reference) -> float:
    return max(p.abs().max().item() for p in ref.model.parameters())


def _poisoned_step(model: Any, opt: Any, step: int) -> Any:
    """A NaN in one input element of the last rank only: after the reduction every rank's grads
    (or grad shards) hold NaN."""
    x, y = make_data(step)
    x = _local(x).clone()
    if dist.get_rank() == dist.get_world_size() - 1:
        x[0, 0] = float("nan")
    opt.zero_grad()
    loss_fn(model(x), _local(y)).backward()
    model.finish_grad_sync()
    return opt.step()


# ---- cases --------------------------------------------------------------------------------------
def nonfinite_case(case: dict[str, Any]) -> dict[str, Any]:
    """Step 0 clean, step 1 with a NaN input on one rank (must be skipped everywhere), step 2
    clean; compared with a twin run that never saw step 1 and with the single-process reference."""
    model, opt = _build(case)
    train_step(model, opt, 0)
    params, state = _params(model), _state(opt)
    result = _poisoned_step(model, opt, 1)
    copies = [mp for mp in opt.main_params if mp.model_grad.dtype != torch.float32]
    out: dict[str, Any] = {
        "fields": getattr(result, "_fields", None),
        "result": tuple(result),
        "params_unchanged": _same(params, _params(model)),
        "state_unchanged": _same(state, _state(opt)),
        "grad_copies": len(copies),
        "grad_copies_released": all(mp.main.grad is None for mp in copies),
    }
    out["ok_after"] = bool(train_step(model, opt, 2)[0])
    twin, twin_opt = _build(case)
    for step in (0, 2):
        train_step(twin, twin_opt, step)
    out["bitwise_as_if_skipped"] = _same(_params(model), _params(twin))
    out["state_as_if_skipped"] = _same(_state(opt), _state(twin_opt))
    ref = Reference(case)
    for step in (0, 2):
        ref.step(step)
    return {**out, "errors": param_errors(model, ref), "scale": _scale(ref)}


def unsynced_case(case: dict[str, Any]) -> dict[str, Any]:
    """After a clean step, call step() without this iteration's reduced grads; it must raise and
    change nothing; then the iteration is completed properly and must equal the reference."""
    model, opt = _build(case)
    train_step(model, opt, 0)
    params = _params(model)
    mode = case["mode"]
    x, y = make_data(1)
    if mode == "opt_zero_grad":
        opt.zero_grad()
    elif mode == "zero_grad_buffer":
        model.zero_grad_buffer()
    else:  # backward, but no finish_grad_sync()
        opt.zero_grad()
        loss_fn(model(_local(x)), _local(y)).backward()
    message = "no error"
    try:
        opt.step()
    except RuntimeError as exc:
        message = str(exc)
    unchanged = _same(params, _params(model))
    if mode == "no_finish":
        model.finish_grad_sync()
        ok = opt.step()[0]
    else:
        ok = train_step(model, opt, 1)[0]
    ref = Reference(case)
    for step in (0, 1):
        ref.step(step)
    return {
        "message": message, "params_unchanged": unchanged, "ok_after": bool(ok),
        "errors": param_errors(model, ref), "rank": dist.get_rank(),
    }  # fmt: skip


def _other_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return Net().to(torch.bfloat16).state_dict()


def _edit(model: torch.nn.Module, edit: str, other: dict[str, torch.Tensor]) -> None:
    if edit == "load_state_dict":
        model.load_state_dict(other)
        return
    for p in model.parameters():
        if edit == "no_grad":
            with torch.no_grad():
                p.mul_(0.5)
        else:
            p.data.mul_(0.5)


def edit_case(case: dict[str, Any]) -> dict[str, Any]:
    """One step, then the model params are edited after the optimizer exists, then two steps;
    the reference is edited the same way (its fp32 masters re-read from its params)."""
    model, opt = _build(case)
    ref = Reference(case)
    train_step(model, opt, 0)
    ref.step(0)
    other = _other_weights()
    edit = case["edit"]
    if edit != "load_state_dict":
        model.publish_params()  # an in-place edit must see every rank's updated shard
    _edit(model if edit == "load_state_dict" else model.module, edit, other)
    if edit == "data_and_reload":
        opt.reload_model_params()
    _edit(ref.model, edit, other)
    with torch.no_grad():
        for master, p in zip(ref.masters, ref.params, strict=True):
            master.copy_(p)
    for step in (1, 2):
        train_step(model, opt, step)
        ref.step(step)
    return {"errors": param_errors(model, ref), "scale": _scale(ref)}


def precision_case(case: dict[str, Any]) -> dict[str, Any]:
    """Steps below bf16 resolution: the fp32 main params must accumulate them (never re-read from
    the rounded bf16 params) and equal the reference's fp32 masters."""
    model, opt = _build(case)
    ref = Reference(case)
    initial = {n: p.detach().float().flatten() for n, p in ref.model.named_parameters()}
    for step in range(case["steps"]):
        train_step(model, opt, step)
        ref.step(step)
    masters = {
        n: m.flatten() for (n, _), m in zip(ref.model.named_parameters(), ref.masters, strict=True)
    }
    errors, moved = {}, {}
    for mp in opt.main_params:
        lo, hi = mp.param_start, mp.param_end
        want = masters[mp.key][lo:hi]
        errors[f"{mp.key}[{lo}:{hi}]"] = (mp.main.flatten() - want).abs().max().item()
        moved[mp.key] = (want - initial[mp.key][lo:hi]).abs().max().item()
    return {"errors": errors, "largest_move": max(moved.values())}


def roundtrip_case(case: dict[str, Any]) -> dict[str, Any]:
    """Save model and optimizer state after one step, take two steps, load both (model first, as
    load_checkpoint does), take the same two steps again: bitwise the same params both times."""
    model, opt = _build(case)
    train_step(model, opt, 0)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, opt.state_dict())  # non-owner ranks save no pieces
    saved_opt = {
        "common": everyone[0]["common"],
        "pieces": [p for s in everyone for p in s["pieces"]],
    }
    finals = []
    for attempt in range(2):
        if attempt:
            model.load_state_dict(saved_model)
            opt.load_state_dict(saved_opt)
        for step in (1, 2):
            train_step(model, opt, step)
        finals.append(_params(model))
    return {"bitwise": _same(*finals)}


KINDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "nonfinite": nonfinite_case, "unsynced": unsynced_case, "edit": edit_case,
    "precision": precision_case, "roundtrip": roundtrip_case,
}  # fmt: skip


def run_contract_cases(cases: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Rank side: every case through `dist_pool.run_each` (RNG reset, exceptions returned)."""
    return run_each({name: (KINDS[kind], case) for name, (kind, case) in cases.items()})
