"""Small tensor helpers of the bucket group: work completion, per-dtype foreach scaling, the
non-finite flags of the NaN check and the grads scaled on their way in. No process group, no
engine state.

[Note: scale on the way in]
Before an all-reduce every bucket is multiplied by its gradient_scaling_factor (1/dp): a pass
over all grad bytes, on the host thread, during backward (about 7 ms for mlp_34m's 136 MB on
one core here). torch DDP folds the factor into the copy of each grad into its bucket; megabuf
does the same where the result is the same: a grad that reaches `main_grad` through the hook's
copy (the lazy first grad, [Note: grad accumulation into main_grad] in hooks.py) is written as
grad * factor (`torch.mul(out=)`: the product the bucket pass computes, so the all-reduce gets
the same bits), every later grad of that param in the iteration is added times the factor,
and its `.grad` stays None until the sync links it, so autograd never adds an unscaled grad in
place on top. At dispatch the group scales only the params that did not come in that way
(small params accumulating in place, [Note: small grads accumulate in place] in grads.py;
grads written back from a user's `.grad`; a no_sync accumulation), or its whole buckets when
none did. A param takes this path only from its first grad of an iteration whose backward
ends with the group's reduction (outside no_sync, sync_grads_at_backward_end), with no comm
hook registered (a hook may want unscaled grads, [Note: comm hook contract]), in a group that
all-reduces pre-scaled buckets of one factor (the reduce-scatter strategies scale 1/dp of the
bytes after the collective instead), for a grad of `main_grad`'s dtype (a bf16 grad scaled
before its upcast would round differently), and for a param of more than SMALL_GRAD_NUMEL
elements (scaling a small one on the way in saves next to nothing, and would make the dispatch
scale its bucket param by param). So between such a param's first grad and the end of backward
its `.grad` is None, not the partial `main_grad`: read grads after the sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import Waitable


def completed(work: Waitable) -> bool:
    """A megabuf collective whose torch.distributed works all report completion."""
    handles = getattr(work, "handles", None)
    if handles is None:
        return False
    return all(hasattr(h, "is_completed") and h.is_completed() for h in handles)


def by_dtype(tensors: Sequence[Tensor]) -> list[list[Tensor]]:
    """`tensors` split into lists of one (device, dtype) each, as the foreach ops want them."""
    lists: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        lists.setdefault((t.device, t.dtype), []).append(t)
    return list(lists.values())


def foreach_scale(tensors: Sequence[Tensor], factors: Sequence[float]) -> None:
    """tensors[i] *= factors[i] in place: one `_foreach_mul_` per (device, dtype, factor);
    factors of 1.0 are skipped."""
    lists: dict[tuple[torch.device, torch.dtype, float], list[Tensor]] = {}
    for t, f in zip(tensors, factors, strict=True):
        if f != 1.0:
            lists.setdefault((t.device, t.dtype, f), []).append(t)
    for (_, _, factor), same in lists.items():
        torch._foreach_mul_(same, factor)


def nonfinite_flags(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """1-D float32 on `device`, one per grad: 1.0 where it holds NaN or Inf. No host read
    ([Note: NaN check] in nan_check.py)."""
    if not grads:
        return torch.zeros(0, dtype=torch.float32, device=device)
    zero = torch.zeros(1, dtype=grads[0].dtype, device=device)  # stands in for empty grads
    norms = torch._foreach_norm([g if g.numel() > 0 else zero for g in grads], float("inf"))
    return torch.stack([n.float() for n in norms]).isfinite().logical_not().float()


class NonfiniteFlags:
    """check_for_nan_in_grad for one bucket group: at dispatch, flag (on the device, unread) the
    params whose grads are NaN/Inf before the reduction ([Note: NaN check] in nan_check.py)."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        bucket_sizes: Sequence[int],  # params per bucket, in order
        name_of: Callable[[torch.nn.Parameter], str],
        *,
        keep_across_microbatches: bool,  # optim_grads* with reduce_each_microbatch
    ) -> None:
        self.params = list(params)
        self.bucket_sizes = list(bucket_sizes)
        self.name_of = name_of
        self.keep_across_microbatches = keep_across_microbatches
        self.flags: Tensor | None = None  # 1-D float32, one per param (bucket by bucket)

    def clear(self) -> None:
        self.flags = None

    def record(self, device: torch.device) -> None:
        flags = nonfinite_flags([p.main_grad for p in self.params], device)  # type: ignore[attr-defined]
        if self.keep_across_microbatches and self.flags is not None:
            # reduce_each_microbatch: flagged if any micro-batch's grads were not finite
            flags = torch.maximum(flags, self.flags)
        self.flags = flags

    def per_bucket(self, device: torch.device) -> Tensor:
        """Per bucket, 1.0 if its grads were NaN/Inf when last dispatched (zeros if not checked
        since zero_grad_buffer()). Stays on the device."""
        if self.flags is None:
            return torch.zeros(len(self.bucket_sizes), dtype=torch.float32, device=device)
        per_bucket = self.flags.split(self.bucket_sizes)
        return torch.stack([f.sum() for f in per_bucket]).clamp_(max=1.0)

    def names(self) -> list[str]:
        """Names of this rank's params flagged at dispatch (reads the flags: error path only)."""
        if self.flags is None:
            return []
        flags = self.flags.tolist()
        return [self.name_of(p) for p, f in zip(self.params, flags, strict=True) if f > 0]


class InboundScale:
    """Which params of one bucket group had their grads scaled on the way into `main_grad` this
    iteration; see [Note: scale on the way in]. `factor` None: never (the group is not
    pre-scaled before an all-reduce, or its buckets differ in factor)."""

    def __init__(self, n: int, factor: float | None) -> None:
        self.factor = factor if factor != 1.0 else None
        self.scaled = bytearray(n)
        self._none = bytes(n)
        self.count = 0

    @classmethod
    def of(cls, buckets: Sequence[Any], strategy: Any) -> InboundScale:
        """For a bucket group: its pre-scale factor where it all-reduces pre-scaled buckets of
        one factor; else never."""
        factors = {b.gradient_scaling_factor for b in buckets}
        usable = strategy.reduction == "all_reduce" and len(factors) == 1
        usable = usable and all(strategy.prescales(b.grad_data.dtype) for b in buckets)
        return cls(sum(len(b.params_list) for b in buckets), factors.pop() if usable else None)

    def factor_for(self, i: int, first: bool, allowed: bool) -> float:
        """The factor param `i`'s grad is multiplied by as it goes into `main_grad`: once its
        first grad of the iteration went in scaled, every later one does too; 1.0 otherwise."""
        if self.scaled[i]:
            return self.factor  # type: ignore[return-value]
        if first and allowed and self.factor is not None:
            self.scaled[i] = 1
            self.count += 1
            return self.factor
        return 1.0

    def prescale(self, buckets: Sequence[Tensor], factors: Sequence[float],
                 params: Sequence[torch.nn.Parameter]) -> None:  # fmt: skip
        """Dispatch: multiply what is not scaled yet by its factor (the whole `buckets` when no
        param went in scaled, else the `main_grad` views of the `params` that did not), then
        forget the flags: after the reduction `main_grad` holds the result, unscaled from here."""
        if self.count == 0:
            foreach_scale(buckets, factors)
            return
        rest = [p.main_grad for i, p in enumerate(params) if not self.scaled[i]]  # type: ignore[attr-defined]
        foreach_scale(rest, [self.factor] * len(rest))  # type: ignore[list-item]
        self.clear()

    def clear(self) -> None:
        if self.count:
            self.scaled[:] = self._none
            self.count = 0


class WrittenGrads:
    """Which of a bucket group's params' `main_grad` hold a grad of this iteration ([Note: grad
    accumulation into main_grad] in hooks.py): 1 = stale, so its first grad overwrites it and
    without one it is zero-filled at dispatch. Flat bytes reset in place: a list of 2000 ints
    took 0.4-2.3 ms to reset. The group's first grad since its grad storage was released
    (optim_grads*) calls `on_refill` with the param's index (it may raise), then refills."""

    def __init__(self, params: Sequence[torch.nn.Parameter], grads: Any,
                 on_refill: Callable[[int], None]) -> None:  # fmt: skip
        self.params = list(params)
        self.grads = grads  # the group's grad storage ([Note: grad storage])
        self._on_refill = on_refill
        self._all = b"\x01" * len(self.params)
        self.flags = bytearray(self._all)
        self.unused_indices: tuple[int, ...] = ()  # unwritten when dispatched (zero-filled)

    def mark_written(self, i: int) -> bool:
        """Record that param `i` got a grad; True if it is the first since zero_grad_buffer()
        (the hook then overwrites main_grad instead of adding to it)."""
        if self.grads.released:
            self._on_refill(i)
            self.refill()
        first = self.flags[i]
        if first:
            self.flags[i] = 0
        return bool(first)

    def mark_unwritten(self, i: int) -> None:
        """Param `i`'s main_grad no longer counts as written (its exposed `.grad` was set to
        None): its next grad overwrites it, and without one it is zero-filled at dispatch."""
        self.flags[i] = 1

    def refill(self) -> None:
        """The grad storage is refilled after a release: its contents are gone, nothing is
        written ([Note: sharded grad lifecycle])."""
        self.grads.acquire()
        self.clear()

    def set(self, flags: bytearray) -> None:
        self.flags[:] = flags

    def clear(self) -> None:
        """Nothing is written (a new iteration, or the buckets' contents are gone)."""
        self.flags[:] = self._all

    def zero_unwritten(self) -> None:
        """Zero the main_grad of params that got no grad since zero_grad_buffer(), and remember
        which they were (`unused_indices`). One `_foreach_zero_` per dtype, not one call each."""
        unused = []
        i = self.flags.find(1)
        while i != -1:
            self.flags[i] = 0
            unused.append(i)
            i = self.flags.find(1, i + 1)
        self.unused_indices = tuple(unused)
        grads = [self.params[i].main_grad for i in unused]  # type: ignore[attr-defined]
        for same_dtype in by_dtype(grads):
            torch._foreach_zero_(same_dtype)
