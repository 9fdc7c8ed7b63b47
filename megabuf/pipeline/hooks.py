"""`ScheduleHooks`: the four callbacks through which a schedule drives data parallelism (Megatron's
`config.no_sync_func`, `grad_sync_func`, `param_sync_func`, `finalize_model_grads_func`).

- no_sync_func: a context-manager factory per chunk (or one for all); inside it, backward only
  accumulates grads. The schedules enter it before the first micro-batch and leave it before the
  backward whose grads should be reduced.
- grad_sync_func(params): dispatch a chunk's grad reduction now (with overlap_grad_reduce).
  1F1B calls it on every stage after the cool-down, which is where stages > 0 launch their
  reduction (in the pipeline bubble, at the same time on all stages); stage 0 instead leaves
  no_sync before its last backward so the bucket hooks overlap it with that backward.
  The interleaved schedule calls it for chunk c pp_rank backward steps after c's last backward.
- param_sync_func(params): dispatch a chunk's param all-gather (align_param_gather); only the
  interleaved schedule uses it, as in Megatron.
- finalize_model_grads_func(model_chunks, num_tokens): last call of every schedule run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import Tensor, nn

from megabuf.ddp import DistributedDataParallel
from megabuf.training.finalize import finalize_model_grads

NoSyncFunc = Callable[[], AbstractContextManager[Any]]
SyncFunc = Callable[[Iterable[nn.Parameter]], Any]
FinalizeFunc = Callable[[list[nn.Module], Tensor | None], Any]


@dataclass(kw_only=True)
class ScheduleHooks:
    """Callbacks of a schedule; a single callable or one per model chunk (see module doc)."""

    no_sync_func: NoSyncFunc | Sequence[NoSyncFunc] | None = None
    """Context manager(s) that suspend grad reduction; None: each chunk's `no_sync` if it has
    one."""
    grad_sync_func: SyncFunc | Sequence[SyncFunc] | None = None
    """Dispatch a chunk's grad reduction; None: rely on the bucket hooks (no overlap hook)."""
    param_sync_func: SyncFunc | Sequence[SyncFunc] | None = None
    """Dispatch a chunk's param all-gather (interleaved schedule only); None: lazy pre-hooks."""
    finalize_model_grads_func: FinalizeFunc | None = None
    """Called last with (model_chunks, total num_tokens or None); None: nothing."""


def per_chunk(value: Any, num_chunks: int, name: str) -> list[Any] | None:
    """Normalise a hook to one callable per chunk."""
    if value is None:
        return None
    if callable(value):
        if num_chunks != 1:
            raise ValueError(
                f"megabuf: ScheduleHooks.{name} must be a list with one callable per model chunk "
                f"({num_chunks} chunks), got a single callable"
            )
        return [value]
    funcs = list(value)
    if len(funcs) != num_chunks:
        raise ValueError(
            f"megabuf: ScheduleHooks.{name} has {len(funcs)} callables for {num_chunks} chunks"
        )
    return funcs


class GradSyncSwitch:
    """Megatron's disable_grad_sync / enable_grad_sync: enter every chunk's no_sync context, or
    leave them all. Idempotent both ways."""

    def __init__(self, hooks: ScheduleHooks, model_chunks: Sequence[nn.Module]) -> None:
        funcs = hooks.no_sync_func
        if funcs is not None and callable(funcs):
            self._funcs: list[NoSyncFunc] = [funcs]  # one context for all chunks
        elif funcs is not None:
            self._funcs = list(funcs)
        else:
            self._funcs = [getattr(c, "no_sync", nullcontext) for c in model_chunks]
        self._stack: ExitStack | None = None

    def disable(self) -> None:
        if self._stack is None:
            stack = ExitStack()
            for func in self._funcs:
                stack.enter_context(func())
            self._stack = stack

    def enable(self) -> None:
        if self._stack is not None:
            stack, self._stack = self._stack, None
            stack.close()

    @property
    def disabled(self) -> bool:
        return self._stack is not None


def _start_grad_sync(chunk: DistributedDataParallel, params: Iterable[nn.Parameter]) -> None:
    del params
    chunk.start_grad_sync()


def _start_param_sync(chunk: DistributedDataParallel, params: Iterable[nn.Parameter]) -> None:
    del params
    chunk.start_param_sync(force_dispatch=True)


def default_schedule_hooks(model_chunks: Sequence[DistributedDataParallel]) -> ScheduleHooks:
    """Megatron's training-loop wiring for megabuf chunks: no_sync per chunk; start_grad_sync as
    grad_sync_func with overlap_grad_reduce; start_param_sync(force_dispatch=True) as
    param_sync_func with align_param_gather; finalize_model_grads last."""
    cfg = model_chunks[0].ddp_config
    return ScheduleHooks(
        no_sync_func=[c.no_sync for c in model_chunks],
        grad_sync_func=(
            [partial(_start_grad_sync, c) for c in model_chunks]
            if cfg.overlap_grad_reduce
            else None
        ),
        param_sync_func=(
            [partial(_start_param_sync, c) for c in model_chunks]
            if cfg.align_param_gather
            else None
        ),
        finalize_model_grads_func=finalize_model_grads,  # type: ignore[arg-type]
    )
