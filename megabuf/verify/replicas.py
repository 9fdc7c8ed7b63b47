"""Replica fingerprints ([Note: verify mode], replicas): the params (and synced grads) that must
be equal across a group's ranks, compared by digest, the first differing one named."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megabuf.transport.collectives import Collectives, Group
from megabuf.verify.errors import VerifyError

CHUNK_NUMEL = 1 << 22  # elements digested at a time (int64 temporaries)
_INT_OF_ITEMSIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(tensor: Tensor) -> Tensor:
    """int64 scalar: sum over i of bits[i] * (2i + 1), wrapping. Any change of one element (one
    ulp included) changes it: its odd weight is a unit modulo 2**64."""
    flat = tensor.detach().reshape(-1)
    bits = flat.view(_INT_OF_ITEMSIZE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK_NUMEL):
        chunk = bits[start : start + CHUNK_NUMEL].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=flat.device) * 2 + 1
        total += (chunk * weights).sum()
    return total


def check_replicas(
    named: Sequence[tuple[str, Tensor]],
    group: Group,
    collectives: Collectives,
    rank: int,
    what: str,
) -> None:
    """Raise on every rank of `group` naming the first of `named` (the same names, in the same
    order, on every rank) whose tensors are not bitwise equal across the group's ranks."""
    size = collectives.size(group)
    if size == 1 or not named:
        return
    mine = torch.stack([digest(t) for _, t in named])
    out = torch.empty(size * mine.numel(), dtype=torch.int64, device=mine.device)
    collectives.all_gather(out, mine, group, async_op=False)
    rows = out.view(size, -1)
    differs = (rows != rows[0]).any(dim=0).nonzero()
    if differs.numel() == 0:
        return
    first = int(differs[0])
    sides: dict[int, list[int]] = {}
    for group_rank, value in enumerate(rows[:, first].tolist()):
        sides.setdefault(value, []).append(collectives.global_rank(group, group_rank))
    described = " vs ".join(f"ranks {ranks}" for ranks in sides.values())
    raise VerifyError(
        f"megabuf verify (rank {rank}): {what} {named[first][0]!r} differs between replicas "
        f"that must be equal: {described} hold different bits ({int(differs.numel())} of "
        f"{len(named)} {what}s differ; this is the first in model order). Every rank of the "
        "group raises this"
    )
