"""Built-in communication hooks: `Reduce`, `Noop`, `Compress` ([Note: comm hook contract]).

[Note: low-precision wire, fp32 sum]
`Compress(dtype, accumulate="wire")` reduces in `dtype` on the wire: a ring rounds the partial
sums at every hop (d-1 roundings; gloo's all-to-all reduce-scatter sums the chunks in `dtype`).
`accumulate="fp32"` moves the same low-precision bytes but rounds once: a reduce-scatter is an
all-to-all of the `dtype` chunks, then one sum in fp32 in rank order (chunk 0 + chunk 1 + ...,
deterministic); an all-reduce is that reduce-scatter, the fp32 shard cast to `dtype` once, and
an all-gather in `dtype` (the wire bytes of a low-precision all-reduce). The two stages of the
all-reduce are one generator ([Note: comm hook contract]): the all-to-all is issued at dispatch,
the sum and the all-gather when the engine waits. It is `fixed_order_sum` ([Note: deterministic
reduction]) with a low-precision wire, so Compress(accumulate="fp32") is deterministic too.
"""

from __future__ import annotations

import warnings
from collections.abc import Generator
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import MODES, GradBucket
from megabuf.comm_hooks.fixed_order import fixed_order_sum
from megabuf.transport.collectives import PendingCollective


class CompressDtypeError(ValueError):
    """`Compress` asked for a cast that does nothing or loses range."""


class Reduce:
    """The engine's default reduction written as a hook: all-reduce `data`, or reduce-scatter it
    into `shard`. The reference for every other hook."""

    name = "Reduce"
    modes = MODES
    two_level = True  # [Note: comm hooks under hybrid]: stateless per bucket

    def __call__(self, bucket: GradBucket) -> PendingCollective:
        coll = bucket.collectives
        if bucket.shard is None:
            return coll.all_reduce(bucket.data, bucket.group, average=bucket.average)
        return coll.reduce_scatter(
            bucket.shard, bucket.data, bucket.group, average=bucket.average,
            scratch=bucket.reduce_scatter_scratch(bucket.data),
        )  # fmt: skip


class Noop:
    """Communicates nothing: each rank keeps its own pre-scaled grads, so results are WRONG.
    For measuring what communication costs (a step with Noop vs one with Reduce)."""

    name = "Noop"
    modes = MODES

    def __init__(self) -> None:
        self._warned = False

    def __call__(self, bucket: GradBucket) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                "megabuf: the Noop comm hook reduces nothing; every rank keeps its own local "
                "gradients, so training results are wrong (it exists to measure communication "
                "cost)",
                RuntimeWarning,
                stacklevel=2,
            )


_LOW = (torch.bfloat16, torch.float16)


def refuse_useless_casts(name: str, dtype: torch.dtype, buckets: list[GradBucket]) -> None:
    """`CompressDtypeError` for a cast of some bucket's grads to `dtype` that does nothing
    (same dtype) or loses range (bf16 grads to fp16)."""
    for bucket in buckets:
        grad_dtype = bucket.data.dtype
        if grad_dtype == dtype:
            raise CompressDtypeError(
                f"megabuf: {name} on {bucket.describe()} casts {grad_dtype} to itself "
                "and saves nothing; compress only wider grads (grad_reduce_in_fp32=True)"
            )
        if grad_dtype == torch.bfloat16 and dtype == torch.float16:
            raise CompressDtypeError(
                f"megabuf: {name} on {bucket.describe()} would cast bf16 grads to fp16, "
                "which loses range (max 65504 vs ~3e38); use dtype=torch.bfloat16"
            )


class Compress:
    """Reduce in `dtype` (bf16 or fp16) on the wire, cast from the already pre-scaled grads and
    back into them; `accumulate` is "wire" (sum in `dtype`) or "fp32" (one fp32 sum of the
    low-precision chunks: [Note: low-precision wire, fp32 sum]). Memory, per bucket and
    persistent: a `dtype` copy of the bucket; where an all-to-all is used ("fp32", or a gloo
    reduce-scatter) a second one, its landing zone; for "fp32" an fp32 shard (all-reduce mode,
    or grads not in fp32)."""

    modes = MODES
    two_level = True  # [Note: comm hooks under hybrid]: stateless per bucket

    def __init__(self, dtype: torch.dtype = torch.bfloat16, accumulate: str = "wire") -> None:
        if dtype not in _LOW:
            raise CompressDtypeError(
                f"megabuf: Compress dtype must be torch.bfloat16 or torch.float16, got {dtype}"
            )
        if accumulate not in ("wire", "fp32"):
            raise ValueError(
                f"megabuf: Compress accumulate must be 'wire' or 'fp32', got {accumulate!r}"
            )
        self.dtype = dtype
        self.accumulate = accumulate
        self.deterministic = accumulate == "fp32"  # [Note: deterministic reduction]
        self.name = f"Compress({str(dtype).removeprefix('torch.')}, {accumulate})"

    def setup(self, buckets: list[GradBucket]) -> None:
        """At registration: refuse a cast that does nothing or loses range."""
        refuse_useless_casts(self.name, self.dtype, buckets)

    def __call__(self, bucket: GradBucket) -> Any:
        if self.accumulate == "fp32":
            return fixed_order_sum(bucket, self.dtype)
        low = bucket.workspace(self.dtype, "compress")
        low.copy_(bucket.data)
        coll = bucket.collectives
        if bucket.shard is None:
            pending = coll.all_reduce(low, bucket.group, average=bucket.average)
            return _then_copy(pending, low, bucket.data)
        lo, hi = bucket.shard_range
        pending = coll.reduce_scatter(
            low[lo:hi], low, bucket.group, average=bucket.average,
            scratch=bucket.reduce_scatter_scratch(low),
        )  # fmt: skip
        return _then_copy(pending, low[lo:hi], bucket.shard)


def _then_copy(
    pending: PendingCollective, source: Tensor, dest: Tensor
) -> Generator[Any, Any, None]:
    """Wait for `pending`, then copy (and cast) `source` into `dest`."""
    yield pending
    dest.copy_(source)
