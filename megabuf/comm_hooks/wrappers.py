"""Hooks that wrap another megabuf hook: `CompressWrapper` ([Note: comm hook contract])."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from megabuf.comm_hooks.builtin import _LOW, CompressDtypeError, refuse_useless_casts
from megabuf.comm_hooks.contract import GradBucket, Waitable, hook_name, store_result


class CompressWrapper:
    """Run `inner` (a megabuf hook) on a `dtype` (bf16 or fp16) copy of each bucket, then cast
    its result back into `data` (all-reduce) or `shard` (reduce-scatter). The copy is a
    `GradBucket` with the bucket's layout (`with_data`: same index, params, group, mode;
    `gradients()` and `shard` are views into the copy) over a persistent `dtype` workspace, so
    the cast happens after the engine's pre-scale and steady-state steps allocate nothing.
    Memory, per bucket and persistent: the `dtype` copy (numel x 2 bytes), plus what `inner`
    keeps (its workspaces live in the copy's bucket, in `dtype`). Modes: `inner`'s. Refuses
    the casts `Compress` refuses (to the same dtype; bf16 grads to fp16) and an inner hook that
    wants unscaled grads (`prescaled = False`, e.g. `from_torch`: wrap the torch hook with
    torch's own `bf16_compress_wrapper` instead). `CompressWrapper(Reduce(), dtype)` is
    `Compress(dtype, "wire")`, bit for bit."""

    def __init__(self, inner: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        if dtype not in _LOW:
            raise CompressDtypeError(
                f"megabuf: CompressWrapper dtype must be torch.bfloat16 or torch.float16, got "
                f"{dtype}"
            )
        if not getattr(inner, "prescaled", True):
            raise ValueError(
                f"megabuf: CompressWrapper cannot wrap {hook_name(inner)}: it wants the unscaled "
                "grads (prescaled = False) and CompressWrapper casts the pre-scaled ones; for a "
                "torch hook use torch's bf16_compress_wrapper / fp16_compress_wrapper inside "
                "from_torch"
            )
        self.inner = inner
        self.dtype = dtype
        self.modes = getattr(inner, "modes", None)
        self.two_level_note = (  # why hybrid sharding refuses it ([Note: comm hooks under hybrid])
            "it keeps a low-precision copy per bucket index, sized for the first level's bucket; "
            "use Compress(dtype) for the same wire on both levels"
        )
        self.name = f"CompressWrapper({hook_name(inner)}, {str(dtype).removeprefix('torch.')})"
        self._low: dict[int, GradBucket] = {}  # bucket index -> its dtype copy

    def setup(self, buckets: list[GradBucket]) -> None:
        """At registration: refuse useless casts, build each bucket's `dtype` copy, and let the
        inner hook see the copies."""
        refuse_useless_casts(self.name, self.dtype, buckets)
        for bucket in buckets:
            low = torch.empty(bucket.data.numel(), dtype=self.dtype, device=bucket.data.device)
            self._low[bucket.index] = bucket.with_data(low)
        setup = getattr(self.inner, "setup", None)
        if setup is not None:
            setup([self._low[b.index] for b in buckets])

    def __call__(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        low = self._low[bucket.index]
        low.data.copy_(bucket.data)
        value = yield from _stages(self.inner(low))
        store_result(hook_name(self.inner), low, value)
        bucket.target.copy_(low.target)


def _stages(result: Any) -> Generator[Any, Any, Any]:
    """A hook's result as stages: its generator's own, one wait for a waitable, none for a
    tensor or None (the engine bounds each wait, [Note: bounded hook wait])."""
    if isinstance(result, Generator):
        return (yield from result)
    if isinstance(result, Waitable) and not isinstance(result, torch.Tensor):
        return (yield result)
    return result
