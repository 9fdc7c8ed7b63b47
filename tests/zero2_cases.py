"""Rank-side code for the optim_grads (ZeRO-2) tests (runs inside DistPool workers).

Cases train the models of optimizer_cases.py (or the MoE model of megabuf/testing/moe.py) with
`data_parallel_sharding_strategy="optim_grads"` and compare with the single-process reference on
the global batch (`reference_case`) or with the same run under "optim" (`bitwise_case`: the same
reduce-scatter of the same buckets, so equal bit for bit at one micro-batch, and with
accumulate_unsharded at any number). They also report what the lifecycle promises: every full
grad bucket released after the sync (0-byte storage), the ledger's transient grad bytes back to
0 and their peak, and the bytes the collectives were handed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from case_devices import params_device
from moe_cases import CFG as MOE_CFG
from moe_cases import GLOBAL_BATCH as MOE_BATCH
from moe_cases import groups as moe_groups
from optimizer_cases import (
    DIM,
    GLOBAL_BATCH,
    MODELS,
    OUT,
    build_model,
    build_opt,
    equality_case,
    loss_fn,
    make_data,
)
from torch import nn

import megabuf
from megabuf.comm_hooks import Compress, PowerSGD, Quantize
from megabuf.sharding.grads import REDUCING_GROUPS_LIMIT
from megabuf.testing.moe import MoEModel, moe_batch


class Frozen(nn.Module):
    """A frozen layer between trainable ones: its weight is read in backward (for the input
    grad) after the trainable params behind it got theirs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.tail = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.to(self.tail.weight.dtype)))
        return self.tail(torch.tanh(self.frozen(h))).float()


class Deep(nn.Module):
    """Six layers in a chain, nothing tied: grads arrive bucket after bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(5))
        self.tail = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.tail.weight.dtype)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.tail(h).float()


MODELS.setdefault("frozen", Frozen)
MODELS.setdefault("deep", Deep)


def zero2(ddp: dict[str, Any], accumulation: str | None = None) -> dict[str, Any]:
    out = {**ddp, "data_parallel_sharding_strategy": "optim_grads"}
    out.pop("use_distributed_optimizer", None)
    if accumulation is not None:
        out["sharded_grad_accumulation"] = accumulation
    return out


def reference_case(case: dict[str, Any]) -> dict[str, Any]:
    """optimizer_cases.equality_case under optim_grads (N steps vs torch on the global batch)."""
    return equality_case({**case, "ddp": zero2(case["ddp"], case.get("accumulation"))})


# ---- one training run -------------------------------------------------------------------------
def _microbatches(step: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's slice of the global batch of `step`, split into `m` micro-batches."""
    x, y = make_data(step)
    n = GLOBAL_BATCH // dist.get_world_size()
    x, y = x[dist.get_rank() * n :][:n], y[dist.get_rank() * n :][:n]
    k = n // m
    return [(x[i * k : (i + 1) * k], y[i * k : (i + 1) * k]) for i in range(m)]


def released(model: megabuf.DistributedDataParallel) -> bool:
    """Every full grad bucket of every buffer has a 0-byte storage."""
    buffers = list(model.buffers) + model.engine.expert_parallel_buffers
    return all(b.grad_data.untyped_storage().nbytes() == 0 for buf in buffers for b in buf.buckets)


def reduced_grads(model: megabuf.DistributedDataParallel) -> list[torch.Tensor]:
    """This rank's reduced grad shard of every bucket (copies)."""
    out = []
    for buf in list(model.buffers) + model.engine.expert_parallel_buffers:
        for slot in buf.layout.buckets:
            lo, hi = slot.shard_range(buf.dp_rank, buf.dp_size)
            out.append(buf.reduced_grad(lo, hi).detach().clone())
    return out


def train(
    model: Any, opt: Any, steps: int, m: int, start: int = 0, scale: float = 1.0
) -> dict[str, Any]:
    """`steps` steps of `m` micro-batches (all but the last under no_sync()); after each sync
    the lifecycle's promises are checked (optim_grads) and grads are scaled by `scale`
    (`model.scale_gradients`, as finalize_model_grads does for a per-token loss)."""
    device = params_device(model.module)
    sharded = model.ddp_config.data_parallel_sharding_strategy == "optim_grads"
    ok, grads = True, []
    for step in range(start, start + steps):
        opt.zero_grad()
        for i, (x, y) in enumerate(_microbatches(step, m)):
            loss = loss_fn(model(x.to(device)), y.to(device)) / m
            if i < m - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        if scale != 1.0:
            model.scale_gradients(scale)
        grads = reduced_grads(model)
        if sharded:
            ok &= released(model) and model.engine.memory_ledger.now("grad_buckets") == 0
            ok &= model.engine.memory_ledger.now("grad_scratch") == 0
        opt.step()
    model.publish_params()
    return {"params": [p.detach().clone() for p in model.module.parameters()], "grads": grads,
            "lifecycle_ok": ok}  # fmt: skip


def _run(case: dict[str, Any], strategy: str) -> tuple[Any, Any]:
    ddp = dict(case["ddp"])
    if strategy == "optim_grads":
        ddp = zero2(ddp, case.get("accumulation"))
    else:
        ddp = {**ddp, "use_distributed_optimizer": True}
    model = build_model({**case, "ddp": ddp})
    hooks = {
        "compress": lambda: Compress(torch.bfloat16, "fp32"),
        "quantize": lambda: Quantize(bits=8, block=64),
        "powersgd_no_error_feedback": lambda: PowerSGD(rank=2, start_step=1, error_feedback=False),
    }
    if "hook" in case:
        model.register_comm_hook(hooks[case["hook"]]())
    return model, build_opt(model, case)


def bitwise_case(case: dict[str, Any]) -> dict[str, Any]:
    """The same steps under "optim" and "optim_grads": params and reduced grad shards equal bit
    for bit (`bitwise`), or their largest difference (`max_diff`)."""
    runs = []
    for strategy in ("optim", "optim_grads"):
        model, opt = _run(case, strategy)
        runs.append(
            train(model, opt, case.get("steps", 3), case.get("m", 1), 0, case.get("scale", 1.0))
        )
    a, b = runs
    pairs = list(zip(a["params"] + a["grads"], b["params"] + b["grads"], strict=True))
    return {
        "bitwise": all(torch.equal(x, y) for x, y in pairs),
        "max_diff": max((x - y).abs().max().item() for x, y in pairs),
        "scale": max(x.abs().max().item() for x, _ in pairs),
        "lifecycle_ok": b["lifecycle_ok"],
    }


def memory_case(case: dict[str, Any]) -> dict[str, Any]:
    """Ledger figures of an optim_grads run with many bucket groups."""
    model, opt = _run(case, "optim_grads")
    ledger = model.engine.memory_ledger
    train(model, opt, 1, case.get("m", 1))  # the learning iteration dispatches at its end
    ledger.reset_peaks()
    out = train(model, opt, 2, case.get("m", 1))
    per_group = [
        g.sharded_grads.full_nbytes for g in model.engine.all_bucket_groups if g.sharded_grads
    ]
    shard_bytes = sum(
        b.grad_nbytes for b in list(model.buffers) + model.engine.expert_parallel_buffers
    )
    opt.zero_grad()  # grad shards count as zero for the next accumulation (lazily)
    zeroed = all(g.sharded_grads.fresh for g in model.engine.all_bucket_groups if g.sharded_grads)
    return {
        "lifecycle_ok": out["lifecycle_ok"],
        "peak": ledger.peak("grad_buckets"),
        "scratch_peak": ledger.peak("grad_scratch"),
        "groups": len(per_group),
        "largest_group": max(per_group),
        "all_groups": sum(per_group),
        "grad_shard": ledger.now("grad_shard"),
        "shard_bytes": shard_bytes,
        "report_grad_bytes": opt.memory_report().grad_buffer_nbytes,
        "zeroed": zeroed,
        "limit": REDUCING_GROUPS_LIMIT,
    }


def wire_case(case: dict[str, Any]) -> dict[str, Any]:
    """Bytes handed to reduce-scatter and all-gather in the last of 2 steps, and the padded
    numel they are counted against."""
    model, opt = _run(case, "optim_grads" if case.get("zero2", True) else "optim")
    train(model, opt, 1, case.get("m", 1))
    model.engine.collectives.stats.reset()
    train(model, opt, 1, case.get("m", 1))
    stats = model.engine.collectives.stats
    return {
        "reduce_scatter": stats.ring_nbytes.get("reduce_scatter", 0),
        "all_gather": stats.ring_nbytes.get("all_gather", 0),
        "padded_numel": sum(b.numel for b in model.buffers),
    }


def checkpoint_case(root: str) -> dict[str, Any]:
    """Save under optim_grads after 2 steps, resume under "optim" (a fresh model) and under
    optim_grads: 2 more steps give the uninterrupted run's params bit for bit."""
    case: dict[str, Any] = {
        "optimizer": "adamw",
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 50},
    }
    path = os.path.join(root, f"zero2_dp{dist.get_world_size()}")
    model, opt = _run(case, "optim_grads")
    train(model, opt, 2, 1)
    megabuf.save_checkpoint(path, model, opt)
    want = train(model, opt, 2, 1, start=2)["params"]
    out = {}
    for strategy in ("optim", "optim_grads"):
        resumed, resumed_opt = _run(case, strategy)
        megabuf.load_checkpoint(path, resumed, resumed_opt)
        got = train(resumed, resumed_opt, 2, 1, start=2)["params"]
        out[strategy] = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    return out


# ---- expert-parallel buffers (ep=2 at dp=4) ---------------------------------------------------
def _moe_run(strategy: str, steps: int) -> list[torch.Tensor]:
    pgs = moe_groups(ep_size=2)
    net = MoEModel(MOE_CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True, bucket_size=200
    )
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adam", lr=1e-2))
    n = MOE_BATCH // pgs.dp_size
    for step in range(steps):
        opt.zero_grad()
        x, y = moe_batch(MOE_CFG, MOE_BATCH, seed=100 + step)
        rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
        opt.step()
    if strategy == "optim_grads" and not released(model):
        raise AssertionError("an expert or dense grad bucket was not released")
    model.publish_params()
    return [p.detach().clone() for p in model.module.parameters()]


def moe_case(case: dict[str, Any]) -> dict[str, Any]:
    a, b = (_moe_run(s, case.get("steps", 3)) for s in ("optim", "optim_grads"))
    return {"bitwise": all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "n": len(a)}


# ---- named errors -----------------------------------------------------------------------------
def _simple_model(**ddp: Any) -> megabuf.DistributedDataParallel:
    case = {"ddp": zero2({"bucket_size": 100, **ddp})}
    return build_model(case)


def _backward(model: megabuf.DistributedDataParallel, step: int = 0) -> None:
    x, y = _microbatches(step, 1)[0]
    loss_fn(model(x), y).backward()


def _illegal_transition() -> None:
    model = _simple_model()
    model.engine.all_bucket_groups[0].sharded_grads.finish()  # type: ignore[union-attr]


def _torch_optimizer() -> None:
    model = _simple_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _backward(model)
    opt.step()


def _backward_after_finish() -> None:
    model = _simple_model()
    _backward(model)
    _backward(model, 1)  # no zero_grad_buffer() in between


def _powersgd() -> None:
    model = _simple_model()
    model.register_comm_hook(PowerSGD(rank=1, start_step=0))


def _grad_data() -> None:
    model = _simple_model()
    model.buffers[0].grad_data.sum()


def _reproducibility() -> None:
    from megabuf.training.reproducible import _param_space_grads

    _param_space_grads(_simple_model())


def _main_grad_after_sync() -> None:
    model = _simple_model()
    _backward(model)
    param = next(iter(model.engine.param_to_name))
    param.main_grad.sum()  # type: ignore[attr-defined]


MISUSES = {
    "main_grad_after_sync": _main_grad_after_sync,
    "illegal_transition": _illegal_transition,
    "torch_optimizer": _torch_optimizer,
    "backward_after_finish": _backward_after_finish,
    "powersgd_error_feedback": _powersgd,
    "whole_grad_data": _grad_data,
    "reproducibility_check": _reproducibility,
}


def misuse_case(label: str) -> str:
    """The message of the error the misuse raises on this rank ("" if none)."""
    try:
        MISUSES[label]()
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return ""


def powersgd_opt_in_case(case: dict[str, Any]) -> dict[str, Any]:
    """PowerSGD with error feedback, opted in: trains, and its residual bytes are in the
    ledger."""
    model = _simple_model()
    hook = PowerSGD(rank=1, start_step=0)
    hook.allow_full_size_error_feedback = True
    model.register_comm_hook(hook)
    opt = build_opt(model, {"optimizer": "adamw"})
    out = train(model, opt, 2, 1)
    errors = sum(s.error.numel() * s.error.element_size() for s in hook._state.values())
    return {
        "ledger": model.engine.memory_ledger.now("comm_hook_error_feedback"),
        "errors": errors,
        "lifecycle_ok": out["lifecycle_ok"],
        "finite": all(bool(p.isfinite().all()) for p in out["params"]),
    }
