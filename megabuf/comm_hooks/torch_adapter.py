"""`from_torch`: torch DDP communication hooks, unchanged, on megabuf's buckets.

[Note: torch hooks on megabuf buckets]
A torch hook is `hook(state, bucket) -> torch.futures.Future[Tensor]` over torch's `GradBucket`
(`index()`, `buffer()`, `gradients()`, `parameters()`, `is_last()`, `set_buffer()`). The adapter
hands it a `TorchGradBucket` over megabuf's bucket:
- `buffer()` is the bucket's `data` itself (the main_grad storage; zero copy), or a persistent
  copy of it when the hook resizes its buffer (`batched_powerSGD_hook` pads it in place with
  `resize_`, which on a view of megabuf's buffer would write into the next bucket): pass
  `copy_buffer=True` for such a hook of your own. `gradients()` are param-shaped views into the
  current buffer (after `set_buffer(t)`, into `t`, as torch does). The Future's tensor (or a
  list of one tensor) is copied (and cast) into `data` unless it is `data`; another shape
  raises `CommHookResultError`.
- Scaling: torch hooks get the local, unscaled grads and divide by the group size themselves, so
  the adapter says `prescaled = False` and the engine skips its pre-scale. This equals megabuf's
  contract exactly when gradient_scaling_factor * group_size == 1 (or the factor is 1 under
  average_in_collective): every dense bucket. An expert bucket with ep_size > 1 is scaled by
  1/dp_size but reduced over expt_dp, so the hook's division leaves a factor 1/ep_size: refused
  (`CommHookScalingError`) unless `allow_prescale=True`, which multiplies `data` by that factor
  before the hook (right for linear hooks: all-reduce, compression, PowerSGD).
- Process group: a torch hook reduces over the group in its `state` (a ProcessGroup, or an
  object with `.process_group` such as `PowerSGDState`; None is the default group). At
  registration it must hold the same ranks as the buckets' group (dp, or expt_dp for expert
  buffers), and the adapter serves buckets of one process group only: one adapter per kind
  when dense and expert buffers reduce over different groups. A state with no visible group
  is not checked.
- Ordering: torch's multi-stage hooks (PowerSGD) issue their later collectives from Future
  callbacks, on whichever thread completes the previous one, at a time that differs per rank;
  with two buckets in flight they would pair the wrong collectives. So the adapter issues a
  bucket's hook only once the previous bucket's torch Future (of this adapter) is complete: at
  dispatch if it already is, else when the engine waits for this bucket (finish_grad_sync),
  after it has waited for the previous one. Every rank thus issues this adapter's collectives in
  one order (buckets in dispatch-chain order, each hook's stages in turn). The cost: at most one
  bucket's torch hook is in flight, so under overlap_grad_reduce a bucket overlaps the rest of
  backward only if the previous bucket's hook finished by its dispatch (the first bucket of a
  step always does). While a torch hook is in flight no other collective may be issued on its
  process group from the main thread: register one adapter for all buffers that reduce over
  one group, not from_torch for some and another hook for the others.
- `is_last()` is true for the last of this adapter's buckets dispatched in a step (its
  len(buckets)-th call since the last such), whatever the mix of dense/expert buffers and
  bucket groups; torch's PowerSGD counts steps with it.
- Modes: all-reduce only. In reduce-scatter mode (use_distributed_optimizer) a torch hook could
  only all-reduce the whole bucket and keep this rank's slice: twice a reduce-scatter's wire
  bytes, for the memory saving the distributed optimizer exists for. Registration refuses it
  (`CommHookModeError`) and names the megabuf hook that does the same in reduce-scatter mode.
- The hook's collectives go to torch.distributed directly, not through `bucket.collectives`: the
  byte counter does not see them.
- Registration: `model.register_comm_hook(state, hook)` (torch's call form) is `from_torch(hook,
  state)` registered for all buffers (`hook_of_call`). Both refuse at registration what torch
  DDP refuses there (`check_torch_hook`): a hook that is not callable, one that cannot be called
  as `hook(state, bucket)`, and one whose annotations say it is something else (`bucket` not
  `dist.GradBucket`, a return other than `torch.futures.Future[torch.Tensor]`; unannotated or
  `Any` is fine, and string annotations are resolved first). torch DDP's refusal of
  `bf16_compress_hook` off CUDA/NCCL is not mirrored: gloo reduces bf16 on the CPU. A second
  registration is refused by the registry, as any hook's.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from megabuf.comm_hooks.contract import CommHookError, GradBucket

_NO_GROUP = object()  # a state whose process group the adapter cannot see

# torch hook -> the megabuf hook that does the same in reduce-scatter mode
_EQUIVALENTS: dict[Callable[..., Any], str] = {
    default_hooks.allreduce_hook: "megabuf.comm_hooks.Reduce()",
    default_hooks.fp16_compress_hook: "megabuf.comm_hooks.Compress(torch.float16)",
    default_hooks.bf16_compress_hook: "megabuf.comm_hooks.Compress(torch.bfloat16)",
    powerSGD_hook.powerSGD_hook: "megabuf's PowerSGD hook",
    powerSGD_hook.batched_powerSGD_hook: "megabuf's BatchedPowerSGD hook",
}


class CommHookGroupError(CommHookError, ValueError):
    """A torch hook's state reduces over other ranks than the buckets' process group."""


class CommHookScalingError(CommHookError, ValueError):
    """A torch hook's own division by the group size would not give megabuf's scaling."""


class TorchGradBucket:
    """torch's `dist.GradBucket` interface over one megabuf bucket (all-reduce mode)."""

    def __init__(self, bucket: GradBucket, buffer: Tensor, offsets: list[int], last: bool):
        self._bucket = bucket
        self._buffer = buffer  # 1-D, grad dtype (or what set_buffer gave), bucket numel
        self._offsets = offsets
        self._last = last

    def index(self) -> int:
        return self._bucket.index

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        """Param-shaped views into the current `buffer()`."""
        return [
            self._buffer[o : o + g.numel()].view(g.shape)
            for o, g in zip(self._offsets, self._bucket.gradients(), strict=True)
        ]

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._bucket.params)

    def is_last(self) -> bool:
        return self._last


class _Turn:
    """One bucket's place in the adapter's order: complete once its torch Future is (or once
    its hook ended or was closed)."""

    def __init__(self) -> None:
        self.future: Any = None
        self.ended = False

    def done(self) -> bool:
        if self.ended:
            return True
        done = getattr(self.future, "done", None) or getattr(self.future, "is_completed", None)
        return bool(done()) if callable(done) else False

    def wait(self) -> None:
        if self.future is not None:
            self.future.wait()
        elif not self.ended:
            raise RuntimeError(
                "megabuf: from_torch: a bucket's hook was waited on before the previous "
                "bucket's hook was issued; bucket groups must be finished in dispatch order"
            )


class TorchHook:
    """A torch DDP hook as a megabuf comm hook: see [Note: torch hooks on megabuf buckets]."""

    modes = frozenset({"all_reduce"})
    prescaled = False  # the engine skips its pre-scale: torch hooks divide by the group size

    def __init__(
        self,
        torch_hook: Callable[[Any, Any], Any],
        state: Any = None,
        *,
        copy_buffer: bool | None = None,
        allow_prescale: bool = False,
    ) -> None:
        check_torch_hook(torch_hook, "from_torch")
        self.torch_hook = torch_hook
        self.state = state
        base = _unwrap(torch_hook)
        self.copy_buffer = (
            base is powerSGD_hook.batched_powerSGD_hook if copy_buffer is None else copy_buffer
        )
        self.allow_prescale = allow_prescale
        self.name = f"from_torch({getattr(base, '__name__', type(base).__name__)})"
        equivalent = _EQUIVALENTS.get(base, "a megabuf hook that supports reduce_scatter")
        self.mode_notes = {
            "reduce_scatter": "a torch hook can only all-reduce the whole bucket and keep this "
            f"rank's shard, twice the wire bytes of a reduce-scatter; use {equivalent} instead"
        }
        self._prescale: dict[int, float] = {}  # bucket index -> factor applied before the hook
        self._offsets: dict[int, list[int]] = {}
        self._num_buckets = 0
        self._seen_in_step: set[int] = set()  # buckets called since the last is_last() one
        self._last_turn: _Turn | None = None

    # ---- registration -------------------------------------------------------------------------
    def setup(self, buckets: list[GradBucket]) -> None:
        """Check the state's process group and the scaling against every bucket."""
        groups = {id(b.group) for b in buckets}
        if len(groups) > 1:
            raise CommHookGroupError(
                f"megabuf: {self.name} was registered for buckets of {len(groups)} process "
                f"groups ({buckets[0].describe()} ... {buckets[-1].describe()}); its state "
                "reduces over one group: register one from_torch adapter per kind "
                "(buffers='dense' and buffers='expert'), each with its own state and group"
            )
        self._check_group(buckets[0])
        for bucket in buckets:
            self._prescale[bucket.index] = self._check_scaling(bucket)
            self._offsets[bucket.index] = bucket.param_offsets()
        self._num_buckets = len(buckets)

    def _check_group(self, bucket: GradBucket) -> None:
        group = _state_group(self.state)
        if group is _NO_GROUP:
            return
        mine = dist.get_process_group_ranks(group or dist.group.WORLD)  # type: ignore[arg-type]
        theirs = dist.get_process_group_ranks(bucket.group or dist.group.WORLD)  # type: ignore[arg-type]
        if sorted(mine) != sorted(theirs):
            kind = "expert-dp (expt_dp)" if bucket.expert else "dp"
            raise CommHookGroupError(
                f"megabuf: {self.name}'s state reduces over ranks {mine}, but {bucket.describe()} "
                f"reduces over its {kind} group, ranks {theirs}; give the hook a state with "
                "that group (e.g. PowerSGDState(process_group=model.process_groups.expt_dp) "
                "for buffers='expert')"
            )

    def _check_scaling(self, bucket: GradBucket) -> float:
        """The factor the hook's division by group_size leaves to apply; 1.0 or refused."""
        factor = bucket.gradient_scaling_factor
        left = factor if bucket.average else factor * bucket.group_size
        if math.isclose(left, 1.0, rel_tol=1e-12):
            return 1.0
        if not self.allow_prescale:
            raise CommHookScalingError(
                f"megabuf: {self.name} on {bucket.describe()}: torch hooks divide by the group "
                f"size ({bucket.group_size}), but this bucket's gradient_scaling_factor is "
                f"{factor} (average_in_collective={bucket.average}), so the result would be "
                f"off by a factor {left} (expert buffers with ep_size > 1 are scaled by "
                "1/dp_size and reduced over expt_dp). Pass from_torch(..., allow_prescale=True) "
                f"to multiply the grads by {left} before the hook (right for linear hooks), or "
                "use a megabuf hook"
            )
        return left

    # ---- one bucket ---------------------------------------------------------------------------
    def __call__(self, bucket: GradBucket) -> Generator[Any, Any, Any]:
        if bucket.index in self._seen_in_step:  # a step ended early (an exception): start anew
            self._seen_in_step.clear()
        self._seen_in_step.add(bucket.index)
        last = len(self._seen_in_step) == self._num_buckets
        if last:
            self._seen_in_step.clear()
        turn, previous = _Turn(), self._last_turn
        self._last_turn = turn
        return self._run(bucket, turn, previous, last)

    def _run(
        self, bucket: GradBucket, turn: _Turn, previous: _Turn | None, last: bool
    ) -> Generator[Any, Any, Any]:
        try:
            if previous is not None and not previous.done():
                yield previous  # issue only after the previous bucket's hook is complete
            factor = self._prescale.get(bucket.index, 1.0)
            if factor != 1.0:
                bucket.data.mul_(factor)
            buffer = bucket.data
            if self.copy_buffer:
                buffer = bucket.workspace(bucket.data.dtype, "torch_buffer")
                buffer.copy_(bucket.data)
            view = TorchGradBucket(bucket, buffer, self._offsets[bucket.index], last)
            result = self.torch_hook(self.state, view)
            if result is None or isinstance(result, Tensor):
                return result  # not torch's contract, but nothing is in flight
            turn.future = result
            value = yield result
            return value
        finally:
            turn.ended = True


def from_torch(
    torch_hook: Callable[[Any, Any], Any],
    state: Any = None,
    *,
    copy_buffer: bool | None = None,
    allow_prescale: bool = False,
) -> TorchHook:
    """Run torch DDP hook `torch_hook(state, bucket)` (`allreduce_hook`, `fp16_compress_hook`,
    `bf16_compress_hook`, `powerSGD_hook` with a `PowerSGDState`, `fp16_compress_wrapper(...)`,
    `batched_powerSGD_hook` or your own) on megabuf's buckets, all-reduce mode: register the
    result with `model.register_comm_hook(...)`. `state` as torch takes it (a process group for
    the default hooks, None for the default group). `copy_buffer`: give the hook a copy of the
    bucket instead of the bucket itself (default: only for `batched_powerSGD_hook`, which resizes
    it). `allow_prescale`: see [Note: torch hooks on megabuf buckets]."""
    return TorchHook(torch_hook, state, copy_buffer=copy_buffer, allow_prescale=allow_prescale)


_FUTURE_OF_TENSOR = torch.futures.Future[torch.Tensor]
_UNCHECKED = (inspect.Parameter.empty, Any)  # no annotation, or one that claims nothing


def check_torch_hook(hook: object, user: str) -> None:
    """torch DDP's registration checks on a torch hook, so a wrong one fails at registration
    (naming what is wrong) rather than in the first backward: callable, callable as
    `hook(state, bucket)`, and where annotated, `bucket` as `dist.GradBucket` and the return as
    `torch.futures.Future[torch.Tensor]`. `user` names the caller in the errors."""
    if not callable(hook):
        raise TypeError(
            f"megabuf: {user}: the communication hook must be callable as hook(state, bucket), "
            f"got {hook!r} ({type(hook).__name__})"
        )
    sig = _signature(hook)
    if sig is None:  # a builtin without a signature: nothing more to check
        return
    name = getattr(_unwrap(hook), "__qualname__", type(hook).__name__)
    try:
        sig.bind(None, None)
    except TypeError as exc:
        raise TypeError(
            f"megabuf: {user}: torch hook {name}{sig} cannot be called as hook(state, bucket) "
            f"({exc}); a torch DDP hook takes the state and a dist.GradBucket"
        ) from None
    params = list(sig.parameters.values())
    bucket = sig.parameters.get("bucket", params[1] if len(params) > 1 else None)
    wanted = bucket.annotation if bucket is not None else _UNCHECKED[0]
    if wanted not in _UNCHECKED and wanted is not dist.GradBucket:
        raise ValueError(
            f"megabuf: {user}: torch hook {name}'s bucket annotation should be dist.GradBucket, "
            f"got {wanted!r}; megabuf hands it torch's GradBucket interface (annotate it "
            "dist.GradBucket or leave it unannotated)"
        )
    returns = sig.return_annotation
    if returns not in _UNCHECKED and returns != _FUTURE_OF_TENSOR:
        raise ValueError(
            f"megabuf: {user}: torch hook {name}'s return annotation should be "
            f"torch.futures.Future[torch.Tensor], got {returns!r}; a torch hook returns a Future "
            "holding the reduced bucket (annotate it so or leave it unannotated)"
        )


def _signature(hook: object) -> inspect.Signature | None:
    """The hook's signature with string annotations (`from __future__ import annotations`)
    resolved where they can be; None when it has none."""
    try:
        return inspect.signature(hook, eval_str=True)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return None
    except Exception:  # an annotation that does not evaluate: check the rest without it
        return inspect.signature(hook)  # type: ignore[arg-type]


def _torch_form(state: object, hook: object) -> tuple[object, object]:
    return state, hook


def _megabuf_form(hook: object) -> object:
    return hook


def hook_of_call(args: tuple[object, ...], kwargs: dict[str, object]) -> object:
    """The hook `register_comm_hook(*args, **kwargs)` registers: megabuf's form `(hook)` as it
    is, torch's form `(state, hook)` (positional or keyword) as `from_torch(hook, state)`."""
    try:
        if len(args) + len(kwargs) != 2:
            return _megabuf_form(*args, **kwargs)
        state, hook = _torch_form(*args, **kwargs)
    except TypeError:
        given = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
        raise TypeError(
            f"megabuf: register_comm_hook({', '.join(given)}): call it as "
            "register_comm_hook(hook, buffers=...) with a megabuf hook, or as torch DDP does, "
            "register_comm_hook(state, hook) with a torch hook hook(state, bucket)"
        ) from None
    check_torch_hook(hook, "register_comm_hook(state, hook)")
    return from_torch(hook, state)  # type: ignore[arg-type]  # checked callable


def _unwrap(hook: Any) -> Any:
    while isinstance(hook, functools.partial):
        hook = hook.func
    return hook


def _state_group(state: Any) -> Any:
    """The process group a torch hook's state reduces over (None: the default group), or
    _NO_GROUP when it has none that can be seen."""
    if state is None or isinstance(state, ProcessGroup):
        return state
    return getattr(state, "process_group", _NO_GROUP)
