"""Rank-side code for tests/test_claims.py: README claims that had no test (2 gloo ranks).

Each case returns plain values; the test side compares them with a single-process reference run
inside the same case (the global batch, plain torch) or across ranks.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from optimizer_cases import Net, loss_fn, make_data, train_step
from torch import nn

import megabuf

DISTOPT_LAZY = {"use_distributed_optimizer": True, "overlap_param_gather": True, "bucket_size": 90}


def _ddp(net: nn.Module, **ddp: Any) -> megabuf.DistributedDataParallel:
    return megabuf.DistributedDataParallel(net, megabuf.DistributedDataParallelConfig(**ddp))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def state_dict_case() -> dict[str, Any]:
    """README: `model.state_dict()` uses the wrapped module's keys and publishes params (with
    overlap_param_gather step() leaves the gathers in flight; state_dict() waits for them)."""
    model = _ddp(_net(), **DISTOPT_LAZY)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="sgd", lr=0.1))
    for step in range(2):
        train_step(model, opt, step)
    before = sorted({g.param_state.name for g in model.engine.all_bucket_groups})
    got = {k: v.clone() for k, v in model.state_dict().items()}
    after = sorted({g.param_state.name for g in model.engine.all_bucket_groups})
    model.publish_params()  # no-op if state_dict() already gathered
    published = {k: v.clone() for k, v in model.module.state_dict().items()}
    fresh = _ddp(_net(), **DISTOPT_LAZY)
    fresh.load_state_dict(got)  # the same keys load back
    loaded = {k: v.clone() for k, v in fresh.state_dict().items()}
    return {
        "keys": list(got), "plain_keys": list(Net().state_dict()), "states": (before, after),
        "got": got, "published": published, "loaded": loaded,
    }  # fmt: skip


def broadcast_case() -> dict[str, Any]:
    """README: construction broadcasts dp-rank 0's params and buffers (BatchNorm running stats
    here, made different per rank by a forward on rank-specific data before wrapping)."""
    torch.manual_seed(10 + dist.get_rank())  # different init per rank
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    net(torch.randn(8, 4) * (dist.get_rank() + 1))  # running stats per rank
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = _ddp(net)
    after = {k: v.clone() for k, v in model.module.state_dict().items()}
    return {"before": before, "after": after}


def _reference_params(
    optimizer_cls: type[torch.optim.Optimizer], steps: int, **kwargs: Any
) -> tuple[dict[str, torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """Single process, global batch: params and grad norms after `steps`, first step's grads."""
    ref = _net()
    opt = optimizer_cls(ref.parameters(), **kwargs)
    norms, first_grads = [], {}
    for step in range(steps):
        x, y = make_data(step)
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf).item())
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}, norms, first_grads


def _errors(model: megabuf.DistributedDataParallel, want: dict[str, torch.Tensor]) -> dict:
    model.publish_params()
    return {
        n: (p.detach() - want[n]).abs().max().item() for n, p in model.module.named_parameters()
    }


LOSS_SCALE = 1024.0


def loss_scale_case(distopt: bool) -> dict[str, Any]:
    """README: `OptimizerConfig(loss_scale=...)` is a constant scale: the loss is scaled (the
    reduced grads are LOSS_SCALE x the true ones) and the step unscales them (SGD with momentum,
    which, unlike Adam, is not invariant to the grad scale)."""
    ddp = DISTOPT_LAZY if distopt else {"overlap_grad_reduce": True, "bucket_size": 90}
    model = _ddp(_net(), **ddp)
    cfg = megabuf.OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9, loss_scale=LOSS_SCALE)
    opt = megabuf.build_optimizer(model, cfg)
    want, ref_norms, ref_grads = _reference_params(torch.optim.SGD, 3, lr=0.05, momentum=0.9)
    norms, grad_ratio = [], {}
    for step in range(3):
        x, y = make_data(step)
        opt.zero_grad()
        n = x.shape[0] // dist.get_world_size()
        rows = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
        opt.scale_loss(loss_fn(model(x[rows]), y[rows])).backward()
        model.finish_grad_sync()
        if step == 0 and not distopt:  # whole reduced grads live on every rank
            grad_ratio = {
                name: (p.main_grad / LOSS_SCALE - ref_grads[name]).abs().max().item()
                for name, p in model.module.named_parameters()
            }
        ok, norm, _ = opt.step()
        if not ok:
            raise RuntimeError(f"step {step} skipped")
        norms.append((norm, ref_norms[step]))
    return {
        "errors": _errors(model, want), "norms": norms, "grad_ratio": grad_ratio,
        "scale": float(opt.get_loss_scale().item()), "kind": type(opt).__name__,
    }  # fmt: skip


OTHER_OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "weight_decay": 0.01}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 0.01, "weight_decay": 0.01}),
}


def other_optimizer_case(name: str) -> dict[str, Any]:
    """README: "any pointwise torch optimizer class" through DistributedOptimizer (sharded fp32
    state) equals that torch optimizer stepped on the global batch in one process."""
    cls, kwargs = OTHER_OPTIMIZERS[name]
    model = _ddp(_net(), **DISTOPT_LAZY)
    cfg = megabuf.OptimizerConfig(optimizer=cls, **kwargs)
    opt = megabuf.build_optimizer(model, cfg)
    for step in range(3):
        ok, _, _ = train_step(model, opt, step)
        if not ok:
            raise RuntimeError(f"step {step} skipped")
    want, _, _ = _reference_params(cls, 3, **kwargs)
    scale = max(p.abs().max().item() for p in want.values())
    inner = {type(d.optimizer).__name__ for d in opt.domains}
    return {
        "errors": _errors(model, want), "scale": scale, "kind": type(opt).__name__,
        "inner": sorted(inner),
    }  # fmt: skip


def scaling_invariant_case() -> str:
    """README: `check_scaling_invariant` runs on every `finalize_model_grads` call; a buffer
    whose grads would not end at 1/dp_size makes it raise (on every rank, before any reduction)."""
    model = _ddp(_net())
    buf = model.buffers[0]
    buf.gradient_scaling_factor *= 2.0  # buckets keep the right factor: inconsistent and wrong
    x, y = make_data(0)
    loss_fn(model(x), y).backward()
    try:
        megabuf.finalize_model_grads([model])
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def fp32_in_place_case() -> dict[str, Any]:
    """FP32Optimizer's docstring: the inner optimizer steps the model params themselves (no fp32
    copy), so a step moves the module's params with no copy-back."""
    model = _ddp(_net(), overlap_grad_reduce=True, bucket_size=90)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="sgd", lr=0.1))
    stepped_ptrs = {mp.main.data_ptr() for mp in opt.main_params}
    param_ptrs = {p.data_ptr() for p in model.module.parameters()}
    train_step(model, opt, 0)
    return {
        "kind": type(opt).__name__, "copies": sum(mp.is_copy for mp in opt.main_params),
        "same_memory": stepped_ptrs == param_ptrs,
        "main_param_nbytes": opt.memory_report().main_param_nbytes,
    }  # fmt: skip


def builder_choice_case() -> dict[str, str]:
    """README: `build_optimizer` picks the class from the chunks' DDP config and param dtypes."""
    picks = {}
    for label, dtype, ddp in (
        ("fp32", torch.float32, {}),
        ("bf16", torch.bfloat16, {"grad_reduce_in_fp32": True}),
        ("bf16_distopt", torch.bfloat16, {"use_distributed_optimizer": True}),
    ):
        model = _ddp(_net().to(dtype), **ddp)
        cfg = megabuf.OptimizerConfig(bf16=dtype == torch.bfloat16)
        picks[label] = type(megabuf.build_optimizer(model, cfg)).__name__
    return picks


def all_cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {
        "state_dict": (state_dict_case,),
        "broadcast": (broadcast_case,),
        "loss_scale_fp32": (loss_scale_case, False),
        "loss_scale_distopt": (loss_scale_case, True),
        "scaling_invariant": (scaling_invariant_case,),
        "fp32_in_place": (fp32_in_place_case,),
        "builder_choice": (builder_choice_case,),
    }
    cases |= {f"optimizer_{n}": (other_optimizer_case, n) for n in OTHER_OPTIMIZERS}
    return cases
