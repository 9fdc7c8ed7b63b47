"""The global grad norm summed exactly, so it does not depend on how grads are split over ranks.

[Note: exact grad norm]
Under `deterministic_reduction` ([Note: deterministic reduction]) the grads are bitwise the same
across bucket sizes, but the distributed optimizer's norm ([Note: global grad norm]) sums the
squares of each rank's shard pieces, whose ranges move with the bucket size: a floating-point
sum in another order, so another clip coefficient. Here the sum of squares is exact instead:
- each square is computed in fp64, exactly for fp32/bf16/fp16 grads (a 24-bit significand
  squared fits in fp64's 53 bits);
- it is split as mantissa * 2**exponent (`frexp`), the 53-bit mantissa as an integer, in two
  halves (< 2**27 and < 2**26), added into int64 bins indexed by the exponent (`index_add_`);
- the bins are summed over the groups as int64 (integer sums are exact in any order), and
  turned into one float on the host with Python integers (correctly rounded).
Integer addition is associative, so the bins, and the norm, are the same bits whatever the
pieces, their order, the ranks or the collective's algorithm. Inf and NaN squares are counted
in two more slots (norm inf or NaN: the step is skipped as usual). No overflow while a bin sums
fewer than 2**36 elements over all ranks. Costs a few passes over the grads (fp64 temporaries,
in chunks of CHUNK_NUMEL elements) and an all-reduce of 2 * BINS + 2 int64 per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from megabuf.optimizer.clip import NormPart, _device_of, _sum_over
from megabuf.transport.collectives import Collectives

BINS = 2100  # frexp exponents of fp64 values: [-1073, 1024]
OFFSET = 1075  # bin index = exponent + OFFSET
CHUNK_NUMEL = 1 << 22  # elements squared at a time (fp64 temporaries)
_MANTISSA = float(2**53)
_LOW_BITS = 26


def square_bins(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """int64 [2 * BINS + 2]: the exact sum of squares of `grads`, binned ([Note: exact grad
    norm]); the last two slots count inf and NaN squares."""
    bins = torch.zeros(2 * BINS + 2, dtype=torch.int64, device=device)
    for grad in grads:
        flat = grad.detach().reshape(-1)
        for start in range(0, flat.numel(), CHUNK_NUMEL):
            _add_chunk(bins, flat[start : start + CHUNK_NUMEL].to(device))
    return bins


def _add_chunk(bins: Tensor, values: Tensor) -> None:
    sq = values.double().square()
    nan, inf = torch.isnan(sq), torch.isinf(sq)
    bins[-2] += inf.sum()
    bins[-1] += nan.sum()
    mantissa, exponent = torch.frexp(sq.masked_fill(nan | inf, 0.0))
    whole = (mantissa * _MANTISSA).to(torch.int64)  # exact: < 2**53
    index = exponent.to(torch.int64) + OFFSET
    bins[:BINS].index_add_(0, index, whole >> _LOW_BITS)
    bins[BINS : 2 * BINS].index_add_(0, index, whole & ((1 << _LOW_BITS) - 1))


def bins_to_sum(bins: list[int]) -> float:
    """The float nearest to the binned sum (inf or NaN if any square was)."""
    if bins[-1] > 0:
        return math.nan
    if bins[-2] > 0:
        return math.inf
    nonzero = [i for i in range(BINS) if bins[i] or bins[BINS + i]]
    if not nonzero:
        return 0.0
    low = nonzero[0]
    total = 0
    for i in nonzero:
        total += ((bins[i] << _LOW_BITS) + bins[BINS + i]) << (i - low)
    shift = low - OFFSET - 53  # value = total * 2**shift
    try:
        return float(total << shift) if shift >= 0 else total / (1 << -shift)
    except OverflowError:
        return math.inf


def exact_grad_norm(
    parts: Sequence[NormPart], collectives: Collectives, *, device: torch.device | None = None
) -> float:
    """L2 norm of every part's grads, each part's bins summed over its groups ([Note: global
    grad norm] decides the groups; [Note: exact grad norm] the arithmetic)."""
    with torch.profiler.record_function("megabuf::exact_grad_norm"):
        device = _device_of(parts, device)
        total = torch.zeros(2 * BINS + 2, dtype=torch.int64, device=device)
        for part in parts:
            bins = square_bins(part.grads, device)
            _sum_over(bins, part.groups, collectives)
            total += bins
        return math.sqrt(bins_to_sum(total.tolist()))
