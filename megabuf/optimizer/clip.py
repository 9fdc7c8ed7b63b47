"""The global grad norm over dense and expert grads, clipping, and the zero-grad count.

[Note: global grad norm]
Each rank contributes the squared norm of the grads it *owns*, and every contribution is summed
over exactly the groups across which ownership differs, so no element is counted twice:
- distributed optimizer, dense params: each dp rank owns a disjoint shard -> sum over dp (and pp,
  whose stages hold different params);
- distributed optimizer, expert params: shards are disjoint inside expt_dp, and ep ranks hold
  different experts -> sum over expt_dp, then ep (then pp);
- hybrid sharding ([Note: two-level reduction]): each shard group owns every shard once and
  its replicas own the same shards again -> sum over the shard group only (and pp);
- non-distributed optimizer: dense grads are replicated over dp (sum over pp only); expert grads
  are replicated over expt_dp (sum over ep, then pp).
Groups of size 1 are skipped. The result equals torch.nn.utils.clip_grad_norm_ over all params of
the whole model, up to fp32 summation order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.transport.collectives import Collectives
from megabuf.transport.devices import comm_device

CLIP_EPS = 1e-6  # same as torch.nn.utils.clip_grad_norm_


@dataclass(frozen=True)
class NormPart:
    """Grads this rank owns and the groups their squared norm is summed over, in order."""

    grads: Sequence[Tensor]  # fp32, any shape
    groups: tuple[ProcessGroup, ...]


def _sum_over(value: Tensor, groups: Sequence[ProcessGroup], collectives: Collectives) -> None:
    for group in groups:
        if collectives.size(group) > 1:
            collectives.all_reduce(value, group, async_op=False)


def _device_of(parts: Sequence[NormPart], device: torch.device | None) -> torch.device:
    """Where the reductions run: NCCL needs CUDA tensors even on a rank that owns no grads."""
    if device is not None:
        return device
    for part in parts:
        for grad in part.grads:
            return grad.device
    return comm_device(parts[0].groups[0] if parts and parts[0].groups else None)


def _local_sq_sum(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    # bf16/fp16 grads read in place: norm of the exact fp32 upcast, without making it
    half = any(g.dtype != torch.float32 for g in grads)
    norms = torch._foreach_norm(list(grads), 2, dtype=torch.float32 if half else None)
    # host grads (cpu offload) are summed on the host; the reduction runs on `device`
    return torch.stack([n.float() for n in norms]).pow(2).sum().reshape(1).to(device)


def global_grad_norm(
    parts: Sequence[NormPart], collectives: Collectives, *, device: torch.device | None = None
) -> float:
    """L2 norm of every grad of the model over all ranks; see [Note: global grad norm]."""
    with torch.profiler.record_function("megabuf::grad_norm"):
        device = _device_of(parts, device)
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for part in parts:
            sq = _local_sq_sum(part.grads, device)
            _sum_over(sq, part.groups, collectives)
            total += sq
        return float(total.sqrt().item())


def clip_grads_(grads: Sequence[Tensor], max_norm: float, total_norm: float) -> float:
    """Scale grads in place so their norm is at most max_norm; returns the factor applied."""
    coef = max_norm / (total_norm + CLIP_EPS)
    if coef < 1.0 and grads:
        with torch.profiler.record_function("megabuf::clip_grads"):
            torch._foreach_mul_(list(grads), coef)
    return min(coef, 1.0)


def count_zeros(
    parts: Sequence[NormPart], collectives: Collectives, *, device: torch.device | None = None
) -> int:
    """Number of zero grad elements over the whole model (same ownership rules as the norm)."""
    device = _device_of(parts, device)
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for part in parts:
        zeros = torch.zeros(1, dtype=torch.float64, device=device)
        for grad in part.grads:
            zeros += grad.numel() - torch.count_nonzero(grad)
        _sum_over(zeros, part.groups, collectives)
        total += zeros
    return int(total.item())
