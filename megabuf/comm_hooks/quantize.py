"""`Quantize(bits=8, block=...)`: a reduce-scatter as an all-to-all of int8 chunks, one fp32 sum.

[Note: int8 wire, fp32 sum]
Each rank splits its pre-scaled bucket into group_size destination chunks of c elements
(c = ceil(numel / group_size); an all-reduce bucket is zero-padded for this), cuts each chunk
into blocks of `block` elements and quantises every block symmetrically:
    scale = max|x| / 127 (fp32),  code = clamp(round(x / scale), -127, 127) (int8).
It sends chunk r's codes and its per-block scale table to group rank r (two all-to-alls), then
dequantises every rank's chunk (code * scale, fp32) and sums them in fp32 in RANK ORDER into the
shard: deterministic (the sum is local: no backend reduction order enters it). A bucket with
bf16/fp16 grads is staged and summed in fp32 and rounded once into them. Per element of block b,
    |shard - exact sum| <= sum over ranks r of scale_{r,b} / 2  (= max|block_{r,b}| / 254)
plus fp32 rounding (the division, the product and the d-term sum: a few 2**-24 relative).
All-reduce mode is that reduce-scatter, then the fp32 shard (divided by group_size first under
`average`) re-quantised the same way and all-gathered as int8 codes + scales, dequantised into
`data` by every rank (so every rank holds the same values); that adds one more scale/2 of the
re-quantised shard block to the bound. A block that holds an inf or a NaN gets a non-finite
scale, so its whole dequantised block is inf/NaN: an overflow is still seen by the grad scaler.

Wire per bucket (`Quantize.wire_nbytes`, what `Collectives.stats.ring_nbytes` counts), with
nb = ceil(c / block): reduce-scatter (d-1)·(c + 4·nb) bytes, about (d-1)/d bytes per element
(torch's quantization hooks all-gather every rank's codes: (d-1) bytes per element); all-reduce
twice that (an fp32 ring all-reduce moves 8·(d-1)/d bytes per element).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import MODES, GradBucket

_QMAX = 127.0
_TINY = torch.finfo(torch.float32).tiny  # smallest scale: an all-zero block quantises to 0


class QuantizeError(ValueError):
    """`Quantize` asked for a bit width or block size it does not implement."""


@dataclass(frozen=True)
class QuantGeometry:
    """How `Quantize` cuts one bucket (pure: sizes only)."""

    numel: int  # the bucket's elements
    group_size: int
    chunk: int  # c: elements per destination chunk (the shard)
    blocks: int  # nb: blocks per chunk
    block: int

    @classmethod
    def of(cls, numel: int, group_size: int, block: int) -> QuantGeometry:
        chunk = -(-numel // group_size)
        return cls(numel, group_size, chunk, -(-chunk // block), block)

    @property
    def reduce_scatter_nbytes(self) -> int:
        """Bytes this rank sends to the other ranks in the reduce-scatter: codes + scales."""
        return (self.group_size - 1) * (self.chunk + 4 * self.blocks)


def quantize_rows(stage: Tensor, scales: Tensor, codes: Tensor) -> None:
    """Quantise each block of `stage` ((rows, nb, block) fp32, zero-padded; clobbered) into
    `scales` ((rows, nb) fp32) and `codes` ((rows, c) int8, c <= nb * block): [Note: int8 wire,
    fp32 sum]."""
    rows, chunk = codes.shape
    torch.linalg.vector_norm(stage, ord=float("inf"), dim=-1, out=scales)  # max |x| per block
    scales.div_(_QMAX).clamp_(min=_TINY)  # NaN/inf stay non-finite
    stage.div_(scales.unsqueeze(-1)).round_().clamp_(-_QMAX, _QMAX)
    codes.copy_(stage.view(rows, -1)[:, :chunk])


def dequantize_row(codes: Tensor, scales: Tensor, out: Tensor) -> Tensor:
    """code * scale of one chunk (`codes` (c,) int8, `scales` (nb,)) in `out` ((nb * block,)
    fp32, clobbered); returns the first c elements."""
    chunk = codes.numel()
    out[:chunk].copy_(codes)
    out[chunk:].zero_()
    out.view(scales.numel(), -1).mul_(scales.unsqueeze(-1))
    return out[:chunk]


class Quantize:
    """Reduce through int8 codes with per-block fp32 scales and one rank-order fp32 sum
    ([Note: int8 wire, fp32 sum]); reduce-scatter and all-reduce modes, dense and expert buffers.

    Args:
        bits: only 8 (int8 codes); anything else raises `QuantizeError`.
        block: elements per scale (default 512). Smaller blocks: a tighter error bound, 4 more
            wire bytes per block.

    Memory, per bucket and persistent (`bucket.workspace`): an fp32 staging copy of the bucket
    (padded to whole blocks), int8 send and receive copies, the scale tables, and an fp32
    chunk (1/group_size of the bucket) for the dequantised rows (and for the sum when the
    shard is not fp32). Steady-state steps allocate no workspace.
    """

    modes = MODES
    two_level = True  # [Note: comm hooks under hybrid]: stateless per bucket (the error bound
    # then holds per level: the second level quantizes the first level's result again)

    def __init__(self, bits: int = 8, block: int = 512) -> None:
        if bits != 8:
            raise QuantizeError(
                f"megabuf: Quantize implements bits=8 (int8 codes, per-block fp32 scales) only, "
                f"got bits={bits!r}"
            )
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise QuantizeError(f"megabuf: Quantize block must be a positive int, got {block!r}")
        self.bits = bits
        self.block = block
        self.name = f"Quantize(bits={bits}, block={block})"

    def geometry(self, bucket: GradBucket) -> QuantGeometry:
        return QuantGeometry.of(bucket.data.numel(), bucket.group_size, self.block)

    def wire_nbytes(self, bucket: GradBucket) -> int:
        """Pure: the bytes one call on `bucket` hands to other ranks, as
        `Collectives.stats.total_ring_nbytes` counts them (all-reduce mode: twice the
        reduce-scatter's, for the all-gather of the re-quantised shard)."""
        nbytes = self.geometry(bucket).reduce_scatter_nbytes
        return nbytes if bucket.shard is not None else 2 * nbytes

    def __call__(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        return self._reduce(bucket)

    def _reduce(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        """Stage one (at dispatch): quantise and issue the all-to-alls. Stage two: the rank-order
        sum; in all-reduce mode also the all-gather, and the last stage writes `data`."""
        geo, coll, group = self.geometry(bucket), bucket.collectives, bucket.group
        d, c, nb = geo.group_size, geo.chunk, geo.blocks
        stage = bucket.workspace(torch.float32, "quantize.stage", d * nb * geo.block)
        scales = bucket.workspace(torch.float32, "quantize.scales", d * nb)
        codes = bucket.workspace(torch.int8, "quantize.codes", d * c)
        got_scales = bucket.workspace(torch.float32, "quantize.received_scales", d * nb)
        got_codes = bucket.workspace(torch.int8, "quantize.received_codes", d * c)
        deq = bucket.workspace(torch.float32, "quantize.dequantized", nb * geo.block)
        _stage_chunks(bucket.data, stage.view(d, -1), c)
        quantize_rows(stage.view(d, nb, -1), scales.view(d, nb), codes.view(d, c))
        pending_codes = coll.all_to_all(got_codes, codes, group)
        pending_scales = coll.all_to_all(got_scales, scales, group)
        yield pending_codes
        yield pending_scales
        shard = bucket.shard
        if shard is not None and shard.dtype == torch.float32:
            acc = shard  # sum straight into the result
        else:
            acc = bucket.workspace(torch.float32, "quantize.sum", c)
        _sum_in_rank_order(got_codes.view(d, c), got_scales.view(d, nb), deq, acc)
        if bucket.average:
            acc.div_(d)
        if shard is not None:
            if acc is not shard:
                shard.copy_(acc)
            return
        # all-reduce: re-quantise this rank's summed chunk into its slot of the gather output
        lo = bucket.group_rank
        mine_codes, mine_scales = got_codes.view(d, c)[lo], got_scales.view(d, nb)[lo]
        row = stage.view(d, -1)[0]
        row[:c].copy_(acc)
        row[c:].zero_()
        quantize_rows(row.view(1, nb, -1), mine_scales.view(1, nb), mine_codes.view(1, c))
        pending_codes = coll.all_gather(got_codes, mine_codes, group)
        pending_scales = coll.all_gather(got_scales, mine_scales, group)
        yield pending_codes
        yield pending_scales
        _write_chunks(got_codes.view(d, c), got_scales.view(d, nb), deq, bucket.data)


def _stage_chunks(data: Tensor, stage: Tensor, chunk: int) -> None:
    """Row r of `stage` ((d, nb * block) fp32) = chunk r of `data`, zero-padded."""
    numel = data.numel()
    for r in range(stage.shape[0]):
        lo, hi = min(r * chunk, numel), min((r + 1) * chunk, numel)
        stage[r, : hi - lo].copy_(data[lo:hi])
        stage[r, hi - lo :].zero_()


def _sum_in_rank_order(codes: Tensor, scales: Tensor, deq: Tensor, acc: Tensor) -> None:
    """acc = dequantised row 0 + row 1 + ... (fp32, in that order)."""
    for r in range(codes.shape[0]):
        row = dequantize_row(codes[r], scales[r], deq)
        if r == 0:
            acc.copy_(row)
        else:
            acc.add_(row)


def _write_chunks(codes: Tensor, scales: Tensor, deq: Tensor, data: Tensor) -> None:
    """Chunk r of `data` = dequantised row r (its first numel - r * c elements at the end)."""
    numel, chunk = data.numel(), codes.shape[1]
    for r in range(codes.shape[0]):
        lo, hi = min(r * chunk, numel), min((r + 1) * chunk, numel)
        if hi > lo:
            data[lo:hi].copy_(dequantize_row(codes[r], scales[r], deq)[: hi - lo])
