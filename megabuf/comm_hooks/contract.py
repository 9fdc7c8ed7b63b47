"""The communication-hook contract: what a hook sees (`GradBucket`), what it returns, and how the
engine drives what it returned (`HookWork`).

[Note: comm hook contract]
A hook replaces the engine's reduction of one bucket. It is registered once per buffer kind
(dense / expert), before the first backward, and declares the modes it supports (`modes`, a
subset of {"all_reduce", "reduce_scatter"}; the model's mode is all-reduce, or reduce-scatter
with `use_distributed_optimizer`). When a bucket group is dispatched (during backward with
overlap_grad_reduce, else in finish_grad_sync), the engine
  1. zero-fills unwritten grads and runs the NaN check, as without a hook;
  2. multiplies each bucket's `data` by its gradient_scaling_factor, in the grad dtype, in both
     modes (so a hook that casts to fp16 casts already-divided values), unless the hook says
     `prescaled = False` (torch's hooks divide by the group size themselves: `from_torch`);
  3. calls `hook(bucket)` for each bucket of the group, in bucket order.
The hook must leave in `bucket.target` (`data` in all-reduce mode, this rank's `shard` of it in
reduce-scatter mode) the SUM over `bucket.group` of every rank's `data` (or that sum divided by
`group_size` when `bucket.average` is set: average_in_collective). The rest of `data` is
undefined afterwards in reduce-scatter mode, as without a hook. The hook issues its collectives
through `bucket.collectives` (counted, interceptable) on `bucket.group` (dp or expert-dp: never
a group the hook captured itself) and returns one of
  - None: the result is already in place;
  - a Tensor shaped like `target`: the engine copies it in (unless it is `target` itself);
  - a waitable (`wait()`, e.g. a `PendingCollective` or a torch Future); if `wait()` returns a
    Tensor it is treated as above;
  - a generator that yields waitables and may `return` a Tensor: a multi-stage hook. The engine
    runs it up to its first `yield` at dispatch (so stage one overlaps the rest of backward),
    and resumes it where it waits for its own collective today, in `finish_grad_sync`: each
    yielded waitable is waited on and the generator resumed with what `wait()` returned.
No threads and no completion callbacks: a stage runs only at dispatch or at finish, and both
happen in `DispatchChain` order on every rank ([Note: dispatch order]), so every rank issues
the hooks' collectives in the same order on every backend. (Advancing a generator when its work
happens to be complete, e.g. from a grad hook, would make that order depend on timing on each
rank and pair up the wrong collectives.) A result shaped unlike `target`, or anything else
returned or yielded, raises `CommHookResultError` naming the hook, the bucket and the rank.

Without a registered hook none of this runs: the engine's own path is unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.transport.collectives import Collectives, CommStats, PendingCollective

Mode = Literal["all_reduce", "reduce_scatter"]
MODES: frozenset[str] = frozenset({"all_reduce", "reduce_scatter"})


class CommHookError(RuntimeError):
    """Base of megabuf's communication-hook errors."""


class CommHookRegistrationError(CommHookError):
    """A hook registered twice for the same buffers, or after the first backward."""


class CommHookModeError(CommHookError, ValueError):
    """A hook that does not support the model's mode (all-reduce vs reduce-scatter)."""


class CommHookHybridError(CommHookModeError):
    """A hook that cannot run on both levels of a hybrid reduction ([Note: comm hooks under
    hybrid] in megabuf/sharding/replica_hooks.py)."""


class CommHookResultError(CommHookError):
    """A hook returned, yielded or left something that is not the bucket's result."""


class CommHookTimeoutError(CommHookError):
    """A hook's work did not complete within `comm_hook_timeout_s` ([Note: bounded hook wait])."""


@runtime_checkable
class Waitable(Protocol):
    def wait(self) -> Any: ...


class CommHook(Protocol):
    """What `register_comm_hook` accepts: see [Note: comm hook contract]."""

    modes: frozenset[str]

    def __call__(self, bucket: GradBucket) -> Any: ...


@dataclass
class HookTally:
    """What a hook issued for one bucket through `bucket.collectives`, over every dispatch since
    the last reset: the engine's counts (`CommStats`) taken while the hook's stages ran
    (`megabuf.comm_hooks.telemetry.hook_report` reads it)."""

    dispatches: int = 0  # hook calls: one per synced step
    stats: CommStats = field(default_factory=CommStats)

    @contextmanager
    def counting(self, engine: CommStats) -> Iterator[None]:
        """Add to `stats` what `engine` counts inside the block (one stage of the hook)."""
        before = engine.snapshot()
        try:
            yield
        finally:
            self.stats.add_since(engine, before)

    def reset(self) -> None:
        self.dispatches = 0
        self.stats.reset()


@dataclass(frozen=True, eq=False)
class GradBucket:
    """One bucket as a hook sees it; built once at registration, the same object every step."""

    index: int  # stable from step 0: dense buffers' buckets first, then expert, in plan order
    group_id: int  # the bucket group it is dispatched with
    expert: bool
    mode: Mode
    data: Tensor  # 1-D, grad dtype, padded bucket numel: the main_grad storage itself
    shard: Tensor | None  # reduce_scatter: this rank's 1/group_size of `data` (a view); else None
    params: tuple[torch.nn.Parameter, ...]
    param_names: tuple[str, ...]
    group: ProcessGroup | None  # dp or expert-dp; None is the default group
    group_size: int
    group_rank: int
    rank: int  # global rank, for messages
    average: bool  # average_in_collective: divide the sum by group_size
    collectives: Collectives
    _workspace: dict[tuple[torch.dtype, str, int], Tensor] = field(default_factory=dict, repr=False)
    gradient_scaling_factor: float = 1.0  # what the engine multiplies `data` by before the hook
    _grads: tuple[Tensor, ...] | None = field(default=None, repr=False)  # set by with_data
    tally: HookTally = field(default_factory=HookTally, repr=False)  # the hook's wire bytes

    @property
    def target(self) -> Tensor:
        """Where the result must end up: `shard` in reduce-scatter mode, else `data`."""
        return self.shard if self.shard is not None else self.data

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this rank's shard in `data`, in elements."""
        numel = self.data.numel() // self.group_size
        return self.group_rank * numel, (self.group_rank + 1) * numel

    def gradients(self) -> list[Tensor]:
        """Each param's main_grad (param-shaped views into `data`, no padding)."""
        if self._grads is not None:
            return list(self._grads)
        return [p.main_grad for p in self.params]  # type: ignore[attr-defined]

    def param_offsets(self) -> list[int]:
        """Where each param's gradient starts in `data`, in elements (params' order)."""
        base = int(self.data.storage_offset())
        return [int(g.storage_offset()) - base for g in self.gradients()]

    def with_data(self, data: Tensor) -> GradBucket:
        """The same bucket (index, params, group, mode) over another flat tensor of `data`'s
        numel, e.g. a low-precision copy: `gradients()` and `shard` are views into `data`, and
        it has workspaces of its own. Build it once and keep it (wrappers do, per bucket)."""
        if data.dim() != 1 or data.numel() != self.data.numel():
            raise ValueError(
                f"megabuf: GradBucket.with_data needs a 1-D tensor of {self.data.numel()} "
                f"elements for {self.describe()}, got shape {tuple(data.shape)}"
            )
        grads = tuple(
            data[o : o + g.numel()].view(g.shape)
            for o, g in zip(self.param_offsets(), self.gradients(), strict=True)
        )
        shard = data[slice(*self.shard_range)] if self.shard is not None else None
        return dataclasses.replace(self, data=data, shard=shard, _grads=grads, _workspace={})

    def workspace(self, dtype: torch.dtype, name: str, numel: int | None = None) -> Tensor:
        """A persistent 1-D tensor of `numel` (default: `data`'s numel) elements in `dtype`, one
        per (dtype, name, numel), allocated on first use on `data`'s device, so steady-state
        steps allocate nothing. Its contents are whatever the hook left there."""
        numel = self.data.numel() if numel is None else numel
        key = (dtype, name, numel)
        if key not in self._workspace:
            self._workspace[key] = torch.empty(numel, dtype=dtype, device=self.data.device)
        return self._workspace[key]

    def reduce_scatter_scratch(self, tensor: Tensor) -> Tensor | None:
        """The persistent all-to-all landing zone for a reduce-scatter of `tensor` where the
        strategy needs one (gloo on CPU), else None: what `Collectives.reduce_scatter` takes."""
        strategy = self.collectives.strategy(self.group, tensor.device)
        if strategy.reduce_scatter != "all_to_all":
            return None
        return self.workspace(tensor.dtype, "scratch", tensor.numel())

    def describe(self) -> str:
        kind = "expert" if self.expert else "dense"
        numel, dtype = self.data.numel(), self.data.dtype
        return f"{kind} bucket {self.index} ({numel} elements, {dtype}, rank {self.rank})"


def hook_name(hook: object) -> str:
    return getattr(hook, "name", None) or type(hook).__name__


class HookWork:
    """One bucket's hook in flight: a typed record the engine waits on like a collective.
    `timeout_s` bounds each wait ([Note: bounded hook wait]); None waits without a bound."""

    def __init__(self, hook: object, bucket: GradBucket, timeout_s: float | None = None) -> None:
        self.hook_name = hook_name(hook)
        self.bucket = bucket
        self.timeout_s = timeout_s
        self._stages: Generator[Any, Any, Any] | None = None
        self._current: Waitable | None = None
        self._value: Any = None
        self._stage = 1  # which wait (1 = the hook's first return or first yield), for messages
        self._tally = bucket.tally
        self._tally.dispatches += 1
        with (
            torch.profiler.record_function(f"megabuf::comm_hook::{self.hook_name}"),
            self._tally.counting(bucket.collectives.stats),
        ):
            self._accept(hook(bucket))  # type: ignore[operator]

    def _accept(self, result: Any) -> None:
        if isinstance(result, Generator):
            self._stages = result
            self._advance(None)  # stage one, at dispatch
        elif result is None or isinstance(result, Tensor):
            self._value = result
        elif isinstance(result, Waitable):
            self._current = result
        else:
            raise self._error(f"returned a {type(result).__name__}")

    def _advance(self, sent: Any) -> None:
        if self._stages is None:
            return
        try:
            step = self._stages.send(sent)
        except StopIteration as stop:
            self._stages, self._current, self._value = None, None, stop.value
            return
        if not isinstance(step, Waitable):
            raise self._error(f"yielded a {type(step).__name__}, not something with wait()")
        self._current = step

    def wait(self) -> None:
        """Drive the hook to its end (later stages run here), then store its result."""
        with torch.profiler.record_function(f"megabuf::wait_comm_hook::{self.hook_name}"):
            try:
                while self._current is not None:
                    current, self._current = self._current, None
                    value = self._bounded_wait(current)
                    self._stage += 1
                    if self._stages is not None:
                        with self._tally.counting(self.bucket.collectives.stats):
                            self._advance(value)
                    else:
                        self._value = value
            except BaseException:
                self._close()  # waiting again (after an error) is a no-op
                raise
            value, self._value = self._value, None
            store_result(self.hook_name, self.bucket, value)

    def _close(self) -> None:
        stages, self._stages, self._current, self._value = self._stages, None, None, None
        if stages is not None:
            stages.close()

    def _bounded_wait(self, waitable: Waitable) -> Any:
        """[Note: bounded hook wait]"""
        timeout, on_cpu = self.timeout_s, self.bucket.data.device.type == "cpu"
        if timeout is None:
            return waitable.wait()
        done = getattr(waitable, "done", None)
        if callable(done):  # a torch Future: poll
            deadline, pause = time.monotonic() + timeout, 1e-5
            while not done():
                if time.monotonic() >= deadline:
                    raise self._timeout(waitable)
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            return waitable.wait()
        if not (on_cpu and isinstance(waitable, (PendingCollective, dist.Work))):
            return waitable.wait()
        start = time.monotonic()
        try:
            return waitable.wait(timeout=datetime.timedelta(seconds=timeout))  # type: ignore[call-arg]
        except RuntimeError as exc:
            if time.monotonic() - start < 0.9 * timeout:
                raise  # the work failed, it did not time out
            raise self._timeout(waitable) from exc

    def _timeout(self, waitable: Waitable) -> CommHookTimeoutError:
        b = self.bucket
        where = "its first return" if self._stages is None and self._stage == 1 else None
        where = where or f"stage {self._stage} (what it returned or yielded)"
        return CommHookTimeoutError(
            f"megabuf: comm hook {self.hook_name} did not complete within {self.timeout_s} s "
            f"for {b.describe()}: a {type(waitable).__name__} from {where} never completed. "
            "If the work is only slow, raise DistributedDataParallelConfig.comm_hook_timeout_s; "
            "otherwise every rank must issue the hook's collectives in the same order, and a "
            "torch Future the hook returns must get its result"
        )

    def _error(self, what: str) -> CommHookResultError:
        return result_error(self.hook_name, self.bucket, what)


def store_result(hook: str, bucket: GradBucket, value: Any) -> None:
    """Copy a hook's result into `bucket.target` (unless it is `target` itself); a list or tuple
    of one tensor (a c10d Future's value) counts as that tensor."""
    if value is None:
        return
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], Tensor):
        value = value[0]
    target = bucket.target
    if not isinstance(value, Tensor):
        raise result_error(hook, bucket, f"left a {type(value).__name__} as its result")
    if value.shape != target.shape:
        where = "the shard" if bucket.shard is not None else "data"
        raise result_error(
            hook, bucket,
            f"left a result of shape {tuple(value.shape)}, expected {tuple(target.shape)} "
            f"({bucket.mode} mode: {where})",
        )  # fmt: skip
    if value.data_ptr() != target.data_ptr() or value.dtype != target.dtype:
        target.copy_(value)


def result_error(hook: str, bucket: GradBucket, what: str) -> CommHookResultError:
    return CommHookResultError(
        f"megabuf: comm hook {hook} {what} for {bucket.describe()}; "
        "see [Note: comm hook contract]: return None, a Tensor shaped like bucket.target, "
        "something with wait(), or a generator yielding such"
    )


def check_modes(hook: object, mode: Mode, what: str) -> None:
    """Raise `CommHookModeError` unless `hook` declares support for `mode`."""
    modes = getattr(hook, "modes", None)
    if not isinstance(modes, (set, frozenset)) or not modes <= MODES:
        raise CommHookModeError(
            f"megabuf: comm hook {hook_name(hook)} must declare `modes`, a set drawn from "
            f"{sorted(MODES)}; got {modes!r} ({what})"
            + ("; a torch DDP hook hook(state, bucket) is registered as torch does, "
               "register_comm_hook(state, hook)" if modes is None and callable(hook) else "")
        )  # fmt: skip
    if mode not in modes:
        why = getattr(hook, "mode_notes", {}).get(mode)  # optional: why a mode is unsupported
        raise CommHookModeError(
            f"megabuf: comm hook {hook_name(hook)} supports {sorted(modes)}, but {what} "
            f"reduces by {mode}" + (f": {why}" if why else "")
        )
