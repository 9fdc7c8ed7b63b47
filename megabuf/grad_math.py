"""Small tensor helpers of the bucket group: work completion, per-dtype foreach scaling and the
non-finite flags of the NaN check. No process group, no engine state."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
