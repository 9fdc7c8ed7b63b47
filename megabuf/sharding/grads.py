"""Sharded grads (ZeRO-2, and ZeRO-3's grad side): see [Note: sharded grad lifecycle].

[Note: sharded grad lifecycle]
Under "optim_grads" and "optim_grads_params" every bucket's full grad tensor has a storage of its
own (`allocate_bucket_grads`), so one bucket group's buckets can be released while the others
accumulate. `param.main_grad` and the hooks' `GradBucket.data` are views of it, created once;
releasing resizes the storage to 0 bytes (the views keep their shapes; reading one: below) and
acquiring resizes it back in place, so no view ever needs rebuilding. Each bucket also keeps a
persistent reduced `grad_shard` (1-D, grad dtype, bucket numel / dp): the distributed optimizer
reads it instead of a view into the full buffer.

One `ShardedGrads` per bucket group drives the storages through

    RELEASED --acquire--> ACCUMULATING --start--> REDUCING --finish--> RELEASED

- acquire: at the group's first grad since it was released (or at dispatch, for a group that got
  no grad). The refilled storage holds garbage, which is harmless because the group marks every
  param unwritten on release: each param's first grad overwrites its `main_grad` ([Note: grad
  accumulation into main_grad]) and a param without one is zero-filled at dispatch. Only the
  padding between and after params is zeroed here (precomputed views), so hooks that look at the
  whole bucket (Compress, Quantize) see what they see under "optim".
- start: the reduce-scatter (or the comm hook) of the full bucket is being issued; the gloo
  all-to-all scratch, a full-bucket temporary too, is acquired here and released with the bucket.
- finish: the reduction landed in the bucket's local shard; it is *copied* into `grad_shard` on
  the first reduction since `zero()` (so one micro-batch is bitwise "optim") and *added* after
  that (reduce_each_microbatch), then the bucket is released.
With overlap_grad_reduce a group is dispatched during backward as soon as it is ready, and at
most REDUCING_GROUPS_LIMIT groups of one dispatch chain stay REDUCING: dispatching one more
first finishes (waits for) the oldest, which releases its buckets while backward goes on. So the
full buckets alive at once are the groups accumulating plus at most REDUCING_GROUPS_LIMIT + 1
reducing. Without overlap every group is reduced at the end of backward, when all of them hold
grads (the full grad buffer, as under "optim"); under `no_sync()` with accumulate_unsharded the
buckets stay allocated through the accumulation window, also as under "optim".
With sharded_grad_accumulation = "reduce_each_microbatch" the cycle runs on every backward: a
backward inside `no_sync()` ends with `DistributedDataParallel.finish_microbatch()` (dispatch
what is left, wait, add into the shards, release; groups back to IDLE) instead of the grad sync.
With "accumulate_unsharded" a `no_sync()` backward only accumulates into the full buckets.
A released storage has 0 bytes and its views keep their shapes: on CPU (torch 2.13) *reading*
such a view crashes the process instead of raising. So while a group is released each of its
params' `main_grad` attribute is a `ReleasedMainGrad`, which raises a RuntimeError naming the
param on any use, and the view comes back at acquire (the engine's grad hooks keep the view
itself, never the attribute). megabuf reads the reduced grads only through the shards
(`buffer.reduced_grad`, `bucket.grad_shard`), and `buffer.grad_data` raises.
Every refill and release is recorded in the engine's `MemoryLedger`: "grad_buckets" (transient:
the groups accumulating or reducing at once, each its buckets' bytes), "grad_scratch" (transient,
groups reducing, gloo's all-to-all reduce-scatter only) and "grad_shard" (persistent, recorded
at construction).
An illegal transition raises naming the bucket group, the rank and both states.

[Note: grad storage]
Every bucket group owns one grad storage, chosen once at assembly (`grad_storage_for` in
assembly.py): a `ShardedGrads` under optim_grads* (the lifecycle above), a `FullGrads` otherwise
(the buckets' `grad_data`, always held; each transition a no-op). The group drives both through
the same calls and never asks which it has; `releases` (a class answer) says whether the full
buckets are released between reductions (the dispatch chain then bounds the reductions in
flight, the NaN flags are kept across micro-batches, arrivals are not counted), and `released`
is a plain attribute because the group's per-grad path reads it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from megabuf.pure.layout import BufferLayout
from megabuf.sharding.ledger import MemoryLedger

REDUCING_GROUPS_LIMIT = 2  # reductions of one dispatch chain in flight during backward
GRAD_BUCKETS = "grad_buckets"
GRAD_SCRATCH = "grad_scratch"
GRAD_SHARD = "grad_shard"


class GradBucketState(enum.Enum):
    RELEASED = "released"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"


def bucket_padding_ranges(layout: BufferLayout, bucket_id: int) -> tuple[tuple[int, int], ...]:
    """Pure: [start, end) ranges of bucket `bucket_id`, relative to the bucket's start, that
    belong to no param (alignment gaps and the tail padding)."""
    bucket = layout.buckets[bucket_id]
    slots = sorted((layout.params[i] for i in bucket.param_ids), key=lambda s: s.start)
    ranges, cursor = [], bucket.start
    for slot in slots:
        if slot.start > cursor:
            ranges.append((cursor - bucket.start, slot.start - bucket.start))
        cursor = max(cursor, slot.end)
    if bucket.end > cursor:
        ranges.append((cursor - bucket.start, bucket.end - bucket.start))
    return tuple(ranges)


def allocate_bucket_grads(
    layout: BufferLayout, dtype: torch.dtype, device: torch.device, params: Sequence[Tensor]
) -> list[Tensor]:
    """One 1-D tensor per bucket (padded bucket numel), each on a storage of its own, returned
    released. Each bucket is allocated only while its params' `main_grad` views are made (a view
    of a released storage cannot be created, only kept), so construction never holds more than
    one bucket. `params[i]` is the param of `layout.params[i]`."""
    result = []
    for bucket in layout.buckets:
        full = torch.empty(bucket.numel, dtype=dtype, device=device)
        for i in bucket.param_ids:
            slot, param = layout.params[i], params[i]
            view = full[slot.start - bucket.start : slot.end - bucket.start].view(param.shape)
            param.main_grad = view  # type: ignore[attr-defined]
        full.untyped_storage().resize_(0)
        result.append(full)
    return result


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _resize(t: Tensor, nbytes: int) -> None:
    storage = t.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)


class ReleasedMainGrad:
    """`param.main_grad` while its grad bucket is released ([Note: sharded grad lifecycle]):
    any attribute, torch function or conversion raises a RuntimeError naming the param, where
    the released view would crash the process."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def error(self) -> RuntimeError:
        return RuntimeError(
            f"megabuf: {self.name}.main_grad is not held: under data_parallel_sharding_strategy "
            "optim_grads / optim_grads_params a param's full grad exists only while its bucket "
            "group accumulates and reduces, and afterwards only this rank's reduced shard is "
            "kept ([Note: sharded grad lifecycle]). Read reduced grads through the optimizer "
            "(opt.step() returns the grad norm) or buffer.reduced_grad(start, end); use "
            "strategy 'optim' to keep full grads"
        )

    def __getattr__(self, attr: str) -> Any:
        raise self.error()

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        released = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls))
        raise released.error()

    def __bool__(self) -> bool:
        raise self.error()

    def __repr__(self) -> str:
        return f"<megabuf: released main_grad of {self.name}>"


class ShardedGrads:
    """The grad storages of one bucket group's buckets; see [Note: sharded grad lifecycle].

    `full[i]` is bucket i's full grad (its own storage, allocated released by
    `allocate_bucket_grads`), `shards[i]` its persistent reduced shard (the buffer's
    `bucket.grad_shard`), `shard_ranges[i]` the [start, end) of `full[i]` the reduce-scatter
    writes this rank's shard into (the group's `local_shard`), `padding[i]` the bucket's padding
    ranges (`bucket_padding_ranges`). Views into `full` can only be made while it is allocated,
    so `landing` and the padding views are made at the first acquire."""

    releases = True  # its full buckets are released between reductions ([Note: grad storage])

    def __init__(
        self,
        full: Sequence[Tensor],
        shard_ranges: Sequence[tuple[int, int]],
        shards: Sequence[Tensor],
        padding: Sequence[Sequence[tuple[int, int]]],
        ledger: MemoryLedger,
        *,
        group_id: int,
        rank: int,
    ) -> None:
        self.full = list(full)  # 1-D, grad_dtype, padded bucket numel; storage released/refilled
        self.shards = list(shards)  # 1-D, grad_dtype, padded bucket numel / dp; persistent
        self._shard_ranges = list(shard_ranges)
        self._padding_ranges = [tuple(p) for p in padding]
        self.landing: list[Tensor] = []  # views of `full`: this rank's shard of each bucket
        self._padding: list[Tensor] = []  # views of `full`: the padding
        self.group_id = group_id
        self.rank = rank
        numels = [hi - lo for lo, hi in self._shard_ranges]
        bad = [i for i, (s, n) in enumerate(zip(self.shards, numels)) if s.numel() != n]
        if len(self.shards) != len(self.full) or len(numels) != len(self.full) or bad:
            raise ValueError(
                f"megabuf: bucket group {group_id} (rank {rank}): grad shards do not match the "
                f"buckets' local shards (buckets {bad}); build them from the same layout"
            )
        self.ledger = ledger
        self.full_nbytes = sum(_nbytes(t) for t in self.full)
        self.scratch: list[Tensor] = []  # gloo all-to-all landing zones, made at first start
        self._scratch_held = False  # the scratch storages are allocated (this reduction's)
        self.state = GradBucketState.RELEASED
        self._fresh = True  # no reduction landed since zero(): the next one is copied
        ledger.alloc(GRAD_SHARD, self.shard_nbytes)
        # (param, its main_grad view, a ReleasedMainGrad) once guard_main_grads() ran
        self._guarded: list[tuple[Any, Tensor, ReleasedMainGrad]] = []

    def guard_main_grads(self, params: Sequence[Any], names: Sequence[str]) -> None:
        """From now on `param.main_grad` is its view only while this group holds grads, and a
        `ReleasedMainGrad` otherwise. Call once the engine has taken the views it keeps."""
        self._guarded = [
            (p, p.main_grad, ReleasedMainGrad(n)) for p, n in zip(params, names, strict=True)
        ]
        if self.released:
            self._swap_main_grads(held=False)

    def _swap_main_grads(self, held: bool) -> None:
        for param, view, released in self._guarded:
            param.main_grad = view if held else released

    # ---- the guard --------------------------------------------------------------------------
    def _expect(self, *states: GradBucketState) -> None:
        if self.state not in states:
            wanted = " or ".join(s.name for s in states)
            raise RuntimeError(
                f"megabuf: bucket group {self.group_id} grad buckets are {self.state.name}, "
                f"expected {wanted} (rank {self.rank}); [Note: sharded grad lifecycle]: a "
                "bucket group reduces once per backward and is acquired again by its next grad"
            )

    @property
    def state(self) -> GradBucketState:
        return self._state

    @state.setter
    def state(self, value: GradBucketState) -> None:
        self._state = value
        # a plain attribute: the group's per-grad path reads it ([Note: grad storage])
        self.released = value is GradBucketState.RELEASED

    def reduced_shards(self) -> list[Tensor]:
        """This rank's reduced shard of each bucket: the persistent `grad_shard`s."""
        return list(self.shards)

    # ---- transitions --------------------------------------------------------------------------
    def acquire(self) -> None:
        """RELEASED -> ACCUMULATING: refill the full storages in place, zero the padding."""
        self._expect(GradBucketState.RELEASED)
        for t in self.full:
            _resize(t, _nbytes(t))
        self.ledger.alloc(GRAD_BUCKETS, self.full_nbytes)
        self._swap_main_grads(held=True)
        if not self.landing:  # first acquire: the views, made once
            self.landing = [f[lo:hi] for f, (lo, hi) in zip(self.full, self._shard_ranges)]
            pads = zip(self.full, self._padding_ranges)
            self._padding = [f[a:b] for f, ranges in pads for a, b in ranges]
        if self._padding:
            torch._foreach_zero_(self._padding)
        self.state = GradBucketState.ACCUMULATING

    @contextmanager
    def materialized(self) -> Iterator[None]:
        """Hold the full storages allocated for the duration (to make views into them, e.g. a
        comm hook's at registration); a released group is released again after."""
        if not self.released:
            yield
            return
        self.acquire()
        try:
            yield
        finally:
            self._release()

    def start(self, needs_scratch: bool) -> list[Tensor | None]:
        """ACCUMULATING -> REDUCING: the reduction is being issued. Returns the scratch per
        bucket (refilled, or made at the first start) when the reduce-scatter needs one."""
        self._expect(GradBucketState.ACCUMULATING)
        self.state = GradBucketState.REDUCING
        if not needs_scratch:
            return [None] * len(self.full)
        if not self.scratch:
            self.scratch = [torch.empty_like(t) for t in self.full]
        else:
            for s in self.scratch:
                _resize(s, _nbytes(s))
        self.ledger.alloc(GRAD_SCRATCH, self.full_nbytes)
        self._scratch_held = True
        return list(self.scratch)

    def finish(self) -> None:
        """REDUCING -> RELEASED: the reduction landed in `landing`; copy it into the shards
        (first reduction since zero()) or add it, then release the full storages."""
        self._expect(GradBucketState.REDUCING)
        with torch.no_grad(), torch.profiler.record_function("megabuf::grad_shard_accumulate"):
            if self._fresh:
                torch._foreach_copy_(self.shards, self.landing)
            else:
                torch._foreach_add_(self.shards, self.landing)
        self._fresh = False
        self._release()

    def abandon(self) -> None:
        """After an exception (or check_for_nan_in_grad): drop whatever is held, any state."""
        if self.state is not GradBucketState.RELEASED:
            self._release()
        self.zero()

    @property
    def fresh(self) -> bool:
        """No reduction landed in the shards since zero(): they count as zero."""
        return self._fresh

    def zero(self) -> None:
        """A new iteration: the shards count as zero, lazily (no memset: the next reduction is
        copied into them, as [Note: grad accumulation into main_grad] does for main_grad), and
        a group still accumulating (a no_sync backward whose grads are being dropped) is
        released."""
        self._expect(GradBucketState.RELEASED, GradBucketState.ACCUMULATING)
        if self.state is GradBucketState.ACCUMULATING:
            self._release()
        self._fresh = True

    def _release(self) -> None:
        if self._scratch_held:
            for s in self.scratch:
                _resize(s, 0)
            self.ledger.free(GRAD_SCRATCH, self.full_nbytes)
            self._scratch_held = False
        self._swap_main_grads(held=False)
        for t in self.full:
            _resize(t, 0)
        self.ledger.free(GRAD_BUCKETS, self.full_nbytes)
        self.state = GradBucketState.RELEASED

    @property
    def shard_nbytes(self) -> int:
        return sum(_nbytes(s) for s in self.shards)


def check_error_feedback(hook: object, strategy: str | None, rank: int) -> None:
    """Refuse a comm hook that keeps full-size error feedback (PowerSGD's residuals: about a
    full grad copy per rank, persistent) under a strategy that shards grads, unless the hook
    opts in with `hook.allow_full_size_error_feedback = True` (its bytes are then logged and
    recorded in the ledger as "comm_hook_error_feedback")."""
    if getattr(hook, "error_feedback", False) is not True:
        return
    if getattr(hook, "allow_full_size_error_feedback", False) is True:
        return
    name = getattr(hook, "name", type(hook).__name__)
    raise ValueError(
        f"megabuf: {name} with error_feedback=True keeps a residual as large as the compressed "
        f"grads on every rank, which defeats data_parallel_sharding_strategy={strategy!r} "
        f"(rank {rank}); build it with error_feedback=False, or opt in with "
        "`hook.allow_full_size_error_feedback = True` before register_comm_hook (its bytes "
        "are then reported in model.engine.memory_ledger as 'comm_hook_error_feedback')"
    )


def error_feedback_nbytes(hook: object) -> int:
    """Bytes of the error-feedback residuals a low-rank hook holds (its per-bucket `error`)."""
    state = getattr(hook, "_state", None)
    if not isinstance(state, dict):
        return 0
    errors = [getattr(s, "error", None) for s in state.values()]
    return sum(_nbytes(e) for e in errors if isinstance(e, Tensor))
