"""Rank-side code for tests/test_weights.py (runs inside DistPool workers).

Offload / restore cases train two identical engines side by side on this rank's slice of the
global batch: one never offloaded, one offloaded (with its optimizer) after every step and, with
`keep_grads`, also between micro-batches and between a forward and its backward. The case
returns both engines' params (read through `state_dict()`) for a bitwise comparison, the bytes
each offload released next to the formula computed here from the layout, and what every entry
point raised while offloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import megabuf
from megabuf.testing.models import MLPStack
from megabuf.weights import EngineOffloadedError, offload, restore

DIM = 16
LAYERS = 3
GLOBAL_BATCH = 8
MICRO = 2
STEPS = 3
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def ddp_config(
    strategy: str, *, overlap: bool = False, instances: int = 1, bucket_size: int = 300
) -> megabuf.DistributedDataParallelConfig:
    return megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy,
        num_distributed_optimizer_instances=instances,  # > 1: a hybrid split of the dp group
        bucket_size=bucket_size,  # 300: several buckets
        overlap_param_gather=overlap and strategy in ("optim", "optim_grads"),
        overlap_grad_reduce=overlap,
    )


def build(
    strategy: str,
    dtype: torch.dtype,
    overlap: bool = False,
    group: Any = None,
    frozen_first: bool = False,
    instances: int = 1,
    bf16_exact: bool = False,
    lr: float = 1e-2,
) -> tuple[megabuf.DistributedDataParallel, megabuf.MegabufOptimizer]:
    """`frozen_first`: the first layer trains with lr 0 (its buckets never change).
    `bf16_exact`: the initial values are rounded to bf16 (as if loaded from a bf16 checkpoint)."""
    model = MLPStack(DIM, LAYERS, seed=0, dtype=dtype)
    if bf16_exact:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    pgs = megabuf.ProcessGroups.for_dp_group(group) if group is not None else None
    ddp = megabuf.DistributedDataParallel(
        model, ddp_config(strategy, overlap=overlap, instances=instances), process_groups=pgs
    )
    cfg = megabuf.OptimizerConfig(
        optimizer="adamw", lr=lr, weight_decay=0.1, bf16=dtype == torch.bfloat16
    )
    groups = None
    if frozen_first:
        first = list(model.layers[0].parameters())
        rest = [p for layer in model.layers[1:] for p in layer.parameters()]
        groups = [{"params": first, "lr": 0.0, "weight_decay": 0.0}, {"params": rest}]
    return ddp, megabuf.build_optimizer(ddp, cfg, groups)


def batch(step: int, micro: int, rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, DIM, generator=gen).to(dtype)
    per = GLOBAL_BATCH // size
    return x[rank * per : (rank + 1) * per]


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).float().pow(2).mean()


def train_step(
    model: Any, opt: Any, step: int, rank: int, size: int, dtype: torch.dtype,
    between: Callable[[str, torch.Tensor], None] = lambda where, loss: None,
) -> None:  # fmt: skip
    """Two micro-batches (the first inside no_sync), then the step; `between(where, loss)`
    runs twice between the second micro-batch's forward and its backward (the first
    micro-batch's grads are accumulated by then)."""
    opt.zero_grad()
    with model.no_sync():
        _loss(model, batch(step, 0, rank, size, dtype)).backward()
    loss = _loss(model, batch(step, 1, rank, size, dtype))
    between("micro", loss)  # after the first micro-batch's backward, the second's forward
    between("forward", loss)
    loss.backward()
    model.finish_grad_sync()
    opt.step()


def params_of(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def storage_nbytes(model: Any, opt: Any) -> int:
    """An independent walk: bytes of every distinct storage the engine and optimizer hold."""
    tensors: list[torch.Tensor] = []
    for buf in model.engine.buffers:
        for b in buf.buckets:
            held = (b.grad_data, b.grad_shard, b.param_data, b.param_shard, b.scratch)
            tensors += [t for t in held if t is not None]
    for group in model.engine.all_bucket_groups:
        if group.sharded_grads is not None:
            tensors += group.sharded_grads.scratch
    tensors += [p.data for p in model.module.parameters()]
    tensors += [mp.main for mp in opt.main_params]
    for d in opt.domains:
        for st in d.optimizer.state.values():
            tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def formula(strategy: str, model: Any, opt: Any, dtype: torch.dtype) -> dict[str, int]:
    """Bytes an offload after a step releases on this rank, from the layout alone."""
    item = torch.finfo(dtype).bits // 8
    bufs = model.engine.buffers
    dp = bufs[0].dp_size
    padded = sum(buf.numel for buf in bufs)
    params_numel = sum(p.numel() for p in model.module.parameters())
    grad_item = torch.finfo(bufs[0].grad_dtype).bits // 8
    sharded_grads = strategy in ("optim_grads", "optim_grads_params")
    grads = (padded // dp if sharded_grads else padded) * grad_item
    # gloo's reduce-scatter landing zones (full bucket size) where the reduction made them;
    # optim_grads* releases its own after each reduction
    scratch = [b.scratch for buf in bufs for b in buf.buckets if b.scratch is not None]
    grad_scratch = sum(t.numel() for t in scratch) * grad_item
    if strategy == "no_shard":
        params = params_numel * item
    elif strategy == "optim_grads_params":
        params = padded // dp * item
    else:
        params = padded * item
    if strategy == "no_shard":  # whole main params, one per param
        main_numels = [p.numel() for p in model.module.parameters()]
    else:  # this rank's pieces of every bucket's shard
        main_numels = [mp.numel for mp in opt.main_params]
    mains = sum(main_numels) * 4 if dtype != torch.float32 else 0
    state = sum(2 * 4 * n + 4 for n in main_numels)  # AdamW: exp_avg, exp_avg_sq, step
    return {
        "grads": grads, "grad_scratch": grad_scratch, "params": params, "module_buffers": 0,
        "main_params": mains, "optimizer_state": state,
    }  # fmt: skip


def _raises(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except EngineOffloadedError as e:
        return str(e)
    return "did not raise"


def entry_points(model: Any, opt: Any, x: torch.Tensor) -> dict[str, str]:
    """What every entry point raises while offloaded."""
    return {
        "forward": _raises(lambda: model(x)),
        "optimizer step()": _raises(opt.step),
        "state_dict()": _raises(model.state_dict),
        "load_state_dict()": _raises(lambda: model.load_state_dict({})),
        "optimizer state_dict()": _raises(opt.state_dict),
        "finish_grad_sync()": _raises(model.finish_grad_sync),
        "summon_full_params()": _raises(lambda: model.summon_full_params().__enter__()),
        "offload()": _raises(lambda: offload(model)),
    }


def continue_case(
    strategy: str, dtype_name: str, keep_grads: bool, overlap: bool
) -> dict[str, Any]:
    """Offloaded twin vs never offloaded: bitwise params after STEPS AdamW steps."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, dtype_name)
    ref, ref_opt = build(strategy, dtype, overlap)
    model, opt = build(strategy, dtype, overlap)
    out: dict[str, Any] = {"released": [], "formula": [], "walk": [], "entry": {}, "backward": ""}

    def between(where: str, loss: torch.Tensor) -> None:
        if not keep_grads:
            return
        offload(model, opt, keep_grads=True)
        if where == "forward":  # the forward's saved tensors: backward refuses, then works
            out["backward"] = _raises(lambda: loss.backward(retain_graph=True))
        restore(model, opt)

    for step in range(STEPS):
        train_step(ref, ref_opt, step, rank, size, dtype)
        train_step(model, opt, step, rank, size, dtype, between)
        before = storage_nbytes(model, opt)
        if step == 0:  # overlap_param_gather: the step left its gathers in flight
            out["in_flight"] = [g.param_state.name for g in model.engine.all_bucket_groups]
        report = offload(model, opt)
        out["walk"].append((before, storage_nbytes(model, opt)))
        out["released"].append(report.released_nbytes)
        out["formula"].append(formula(strategy, model, opt, dtype))
        if step == 0:
            out["entry"] = entry_points(model, opt, batch(0, 0, rank, size, dtype))
            out["ledger_offloaded"] = dict(model.engine.memory_ledger.current())
        restore(model, opt)
    out["ref"] = params_of(ref)
    out["got"] = params_of(model)
    return out


def refusal_case() -> dict[str, str]:
    """Offload with a grad reduction in flight (overlap_grad_reduce, backward inside
    deferred_grad_sync()) is refused by name; after finish_grad_sync() it goes through."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    model, opt = build("optim", torch.float32, overlap=True)
    train_step(model, opt, 0, rank, size, torch.float32)  # arrivals learned: hooks dispatch
    opt.zero_grad()
    with model.deferred_grad_sync():
        _loss(model, batch(0, 0, rank, size, torch.float32)).backward()
    try:
        offload(model, opt)
        refused = "did not raise"
    except RuntimeError as e:
        refused = str(e)
    model.finish_grad_sync()
    offload(model, opt)  # grads dropped: the restored engine starts a new iteration
    restore(model, opt)
    try:
        opt.step()
        stepped = "did not raise"
    except RuntimeError as e:
        stepped = str(e)
    # a backward that never reaches the engine's outputs still meets a param's grad hook
    plain, plain_opt = build("no_shard", torch.float32)
    train_step(plain, plain_opt, 0, rank, size, torch.float32)
    seen: list[torch.Tensor] = []
    handle = plain.module.layers[0].register_forward_hook(lambda m, i, o: seen.append(o))
    plain(batch(1, 0, rank, size, torch.float32))
    handle.remove()
    offload(plain, plain_opt, keep_grads=True)
    hook = _raises(lambda: seen[0].sum().backward())  # reads the input, not the weight
    restore(plain, plain_opt)
    return {"refused": refused, "step_after_dropped_grads": stepped, "grad_hook": hook}
