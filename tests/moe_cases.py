"""Rank-side code for the expert-parallel tests (runs inside DistPool workers, 4 gloo ranks).

Every case builds the sharded MoE model on every rank and the whole model in one process on the
global batch, runs megabuf on this rank's dp slice, and returns the largest deviation per param.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.distributed as dist
from case_devices import case_device, params_device
from grad_cases import grad_errors

import megabuf
from megabuf.pure.layout import shard_pieces
from megabuf.testing.moe import MoEConfig, MoEModel, global_expert_index, moe_batch
from megabuf.training.finalize import finalize_model_grads

CFG = MoEConfig(d_in=8, d_model=16, d_ff=24, d_out=4, num_experts=4, top_k=2)
GLOBAL_BATCH = 32
_GROUPS: dict[tuple[int, int], megabuf.ProcessGroups] = {}


def groups(pp_size: int = 1, ep_size: int = 1) -> megabuf.ProcessGroups:
    """Built once per worker process and reused across cases (group creation is collective)."""
    key = (pp_size, ep_size)
    if key not in _GROUPS:
        _GROUPS[key] = megabuf.ProcessGroups.build(pp_size=pp_size, ep_size=ep_size)
    return _GROUPS[key]


def reference_name(name: str, ep_rank: int, n_local: int) -> str:
    m = re.match(r"moe\.experts\.(\d+)\.(.*)", name)
    if m is None:
        return name
    return f"moe.experts.{global_expert_index(int(m.group(1)), ep_rank, n_local)}.{m.group(2)}"


def _loss(out: torch.Tensor, y: torch.Tensor, per_token: bool) -> torch.Tensor:
    per_row = ((out - y) ** 2).mean(dim=1)
    return per_row.sum() if per_token else per_row.mean()


def reference_grads(device: torch.device | None = None) -> dict[str, torch.Tensor]:
    device = device or torch.device("cpu")
    ref = MoEModel(CFG, seed=3).to(device)
    x, y = (t.to(device) for t in moe_batch(CFG, GLOBAL_BATCH, seed=100))
    _loss(ref(x), y, per_token=False).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


def build(case: dict[str, Any]) -> megabuf.DistributedDataParallel:
    pgs = groups(ep_size=case["ep"])
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3).to(case_device(case))
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case.get("config", {}))
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives  # one byte counter for the whole engine
    return model


def run_step(model: megabuf.DistributedDataParallel, step: int, per_token: bool) -> None:
    pgs = model.process_groups
    device = params_device(model.module)
    x, y = (t.to(device) for t in moe_batch(CFG, GLOBAL_BATCH, seed=100 + step))
    n = GLOBAL_BATCH // pgs.dp_size
    rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
    _loss(model(x[rows]), y[rows], per_token).backward()
    num_tokens = torch.tensor(n, device=device) if per_token else None
    finalize_model_grads([model], num_tokens=num_tokens)


def compare(model: megabuf.DistributedDataParallel, expected: dict[str, torch.Tensor]) -> dict:
    ep_rank = dist.get_rank(model.process_groups.ep)
    n_local = CFG.num_experts // dist.get_world_size(model.process_groups.ep)
    names = {p: reference_name(n, ep_rank, n_local) for p, n in model.engine.param_to_name.items()}
    return grad_errors(model, names, expected)


def grads_case(case: dict[str, Any]) -> dict[str, Any]:
    model = build(case)
    run_step(model, 0, case.get("per_token", False))
    expected = reference_grads(case_device(case))
    return {
        "errors": compare(model, expected),
        "n_expert_buffers": len(model.engine.expert_parallel_buffers),
        "n_expert_params": sum(len(b.params) for b in model.engine.expert_parallel_buffers),
        "expert_groups_reduce_over_expt_dp": all(
            g.collective_group is model.process_groups.expt_dp
            for g in model.engine.expert_parallel_bucket_groups
        ),
        "all_to_all_bytes": model.engine.collectives.stats.ring_nbytes.get("all_to_all", 0),
    }


def rank_value_case(case: dict[str, Any]) -> dict[str, list[float]]:
    """Every grad element := global rank + 1; return the distinct values after finalize (only
    this rank's shards with the distributed optimizer)."""
    model = build(case)
    params = [p for group in model.engine.all_bucket_groups for p in group.params_list]
    # a real backward whose grads are exactly rank + 1 everywhere (through the hooks)
    torch.stack([(p * (dist.get_rank() + 1.0)).sum() for p in params]).sum().backward()
    finalize_model_grads([model])
    seen: dict[str, set[float]] = {"dense": set(), "expert": set()}
    for kind, bufs in (("dense", model.buffers), ("expert", model.engine.expert_parallel_buffers)):
        for buf in bufs:
            for piece in shard_pieces(buf.layout, buf.dp_rank, buf.dp_size):
                if not model.ddp_config.use_distributed_optimizer:
                    piece_data = buf.params[piece.param_id].main_grad
                else:
                    start = piece.buffer_start
                    piece_data = buf.grad_data[start : start + piece.numel]
                seen[kind].update(round(v, 6) for v in piece_data.unique().tolist())
    return {k: sorted(v) for k, v in seen.items()}


def norm_case(case: dict[str, Any]) -> dict[str, Any]:
    """Global grad norm over dense + expert params after finalize vs the reference's."""
    model = build(case)
    optimizer = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=1e-9, clip_grad=1e9))
    run_step(model, 0, per_token=False)
    expected = reference_grads()
    ref_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in expected.values()))
    got = global_grad_norm(model)
    # the norm the optimizer clips by (its own choice of groups), after the test's computation
    return {"got": got, "optimizer": optimizer.step().grad_norm, "want": ref_norm}


try:  # the distributed-optimizer engineer's function, when present
    from megabuf.optimizer.clip import NormPart
    from megabuf.optimizer.clip import global_grad_norm as _clip_global_grad_norm

    _NORM_SOURCE = "megabuf.optimizer.clip.global_grad_norm"
except ImportError:  # pragma: no cover - before megabuf/optimizer/clip.py existed
    _clip_global_grad_norm = None  # type: ignore[assignment]
    _NORM_SOURCE = "tests/moe_cases.py"


def _owned_grads(model: megabuf.DistributedDataParallel, expert: bool) -> list[torch.Tensor]:
    """The grads this rank owns: whole main_grads, or its shard pieces with distopt."""
    bufs = model.engine.expert_parallel_buffers if expert else list(model.buffers)
    if not model.ddp_config.use_distributed_optimizer:
        return [p.main_grad for b in bufs for p in b.params]
    return [
        b.grad_data[piece.buffer_start : piece.buffer_start + piece.numel]
        for b in bufs
        for piece in shard_pieces(b.layout, b.dp_rank, b.dp_size)
    ]


def global_grad_norm(model: megabuf.DistributedDataParallel) -> float:
    """Dense grads are replicated over dp (sharded with distopt), expert grads over expt_dp
    (sharded with distopt) and differ over ep: sum squares over the groups where they differ."""
    pgs = model.process_groups
    sharded = model.ddp_config.use_distributed_optimizer
    dense_groups = (pgs.dp, pgs.pp) if sharded else (pgs.pp,)
    expert_groups = (pgs.expt_dp, pgs.ep, pgs.pp) if sharded else (pgs.ep, pgs.pp)
    dense, expert = _owned_grads(model, False), _owned_grads(model, True)
    if _clip_global_grad_norm is not None:
        parts = [NormPart(dense, dense_groups), NormPart(expert, expert_groups)]
        return _clip_global_grad_norm(parts, model.engine.collectives)
    total = torch.zeros(1, dtype=torch.float64)
    for grads, groups_ in ((dense, dense_groups), (expert, expert_groups)):
        sq = torch.tensor([sum(float(g.double().pow(2).sum()) for g in grads)])
        for group in groups_:
            model.engine.collectives.all_reduce(sq, group, async_op=False)
        total += sq
    return math.sqrt(float(total.item()))
