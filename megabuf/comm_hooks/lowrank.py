"""Pure low-rank helpers of the PowerSGD hooks: which tensors are compressed, how a bucket's
matrices are grouped, the wire formula, the shard rows, and orthogonalisation.

No process group, no bucket: shapes and numbers in, frozen records and tensors out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """A tensor viewed as n x m = (shape[0], -1); a 0-d tensor is 1 x 1."""
    numel = math.prod(shape)
    n = shape[0] if shape else 1
    return n, (numel // n if n else 0)


def approximation_rank(n: int, m: int, rank: int) -> int:
    return min(n, m, rank)


def should_compress(shape: tuple[int, ...], rank: int, min_compression_rate: float) -> bool:
    """A tensor is compressed iff it has 2+ dims and (n + m) * r * min_compression_rate < n * m,
    r = min(n, m, rank). 1-D tensors never are (torch compresses them as n x 1 matrices when
    min_compression_rate < 1: n + 1 elements on the wire instead of n)."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    r = approximation_rank(n, m, rank)
    return (n + m) * r * min_compression_rate < n * m


@dataclass(frozen=True)
class Unit:
    """Matrices multiplied together: one matrix, or (batch_same_shape) every compressed matrix
    of one shape in the bucket, stacked as b x n x m."""

    members: tuple[int, ...]  # positions in the bucket's param list
    n: int
    m: int
    r: int
    p_start: int  # offset of this unit's b x n x r block in the bucket's P memory
    q_start: int  # offset of its b x m x r block in the Q memory
    x_start: int  # offset of its b x n x m block in a stacked-matrix workspace

    @property
    def batch(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's split into compressed units and uncompressed params."""

    units: tuple[Unit, ...]  # shape groups in order of first appearance, params in order
    uncompressed: tuple[int, ...]  # positions of params all-reduced as they are
    p_numel: int  # sum of n * r over compressed matrices
    q_numel: int  # sum of m * r
    compressed_numel: int  # sum of n * m
    uncompressed_numel: int

    @property
    def compressed(self) -> tuple[int, ...]:
        return tuple(i for u in self.units for i in u.members)

    @property
    def factor_numel(self) -> int:
        """P and Q elements on the wire: sum of r * (n + m)."""
        return self.p_numel + self.q_numel


def plan_bucket(
    shapes: list[tuple[int, ...]], rank: int, min_compression_rate: float, batch_same_shape: bool
) -> BucketPlan:
    """Group the bucket's compressed matrices by shape (first appearance order; torch draws its
    random Q in this order too) into units: one per shape when batching, else one per matrix."""
    groups: dict[tuple[int, int], list[int]] = {}
    uncompressed = []
    for i, shape in enumerate(shapes):
        if should_compress(shape, rank, min_compression_rate):
            groups.setdefault(matrix_shape(shape), []).append(i)
        else:
            uncompressed.append(i)
    units, p, q, x = [], 0, 0, 0
    for (n, m), members in groups.items():
        r = approximation_rank(n, m, rank)
        chunks = [members] if batch_same_shape else [[i] for i in members]
        for chunk in chunks:
            units.append(Unit(tuple(chunk), n, m, r, p, q, x))
            p, q, x = p + len(chunk) * n * r, q + len(chunk) * m * r, x + len(chunk) * n * m
    return BucketPlan(
        units=tuple(units),
        uncompressed=tuple(uncompressed),
        p_numel=p,
        q_numel=q,
        compressed_numel=x,
        uncompressed_numel=sum(math.prod(shapes[i]) for i in uncompressed),
    )


def shard_rows(offset: int, numel: int, m: int, lo: int, hi: int) -> tuple[int, int]:
    """Rows [first, last) of an n x m matrix stored at elements [offset, offset + numel) of a
    bucket whose elements [lo, hi) are this rank's shard: every row holding a shard element (a
    matrix may straddle a shard boundary, mid-row). Empty (first == last) if none."""
    start, end = max(offset, lo), min(offset + numel, hi)
    if start >= end:
        return 0, 0
    return (start - offset) // m, -(-(end - offset) // m)


def orthogonalize_(x: Tensor, epsilon: float = 0.0) -> None:
    """Make the columns of each b x k x r matrix in `x` orthonormal, in place.

    Gram-Schmidt for r <= 2 or half precision (QR has no half kernels), else QR. Each column is
    divided by its norm + `epsilon`; a column that is exactly zero stays zero (torch's hook
    turns it into NaN when epsilon is 0)."""
    r = x.shape[2]
    if r > 2 and x.dtype not in (torch.float16, torch.bfloat16):
        x.copy_(torch.linalg.qr(x, mode="reduced").Q)
        return
    for i in range(r):
        col = x[:, :, i : i + 1]
        norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
        # torch's hook divides by norm + epsilon; a zero column stays zero here instead of NaN
        norm = norm + epsilon if epsilon else torch.where(norm == 0, torch.ones_like(norm), norm)
        col.div_(norm)
        if i + 1 < r:
            rest = x[:, :, i + 1 :]
            rest.sub_(torch.sum(col * rest, dim=1, keepdim=True) * col)
