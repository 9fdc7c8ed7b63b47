"""`BackwardEndSync`: finishes a model's grad sync when backward ends, as torch DDP does.

[Note: grad sync at backward end]
A torch-DDP loop never calls `finish_grad_sync()`: grads must be reduced by the time
`backward()` returns. The autograd engine runs callbacks queued during a backward when that
backward ends, so the first grad of a backward queues one that runs `finish_grad_sync()`. Which
"first grad": a hook on the forward's outputs, since the outputs' grads come first in the
outermost backward. A param's grad hook would do only as a fallback (outputs the forward did
not return as tensors, a loss computed from `model.module` directly): under reentrant activation
checkpointing it runs inside the checkpoint's nested backward, whose end is not the end of the
real one (the sync would then dispatch groups early and a later grad raises, naming the param).
The callback syncs only if a param grad arrived since the last sync: a backward through the
outputs that reaches no param (`torch.autograd.grad` of the inputs with `create_graph=True`,
the first half of a gradient penalty) must not reduce the still-empty grads and close the
iteration before the backward that brings them. Nothing is queued when sync is off
(`no_sync()`, `require_backward_grad_sync = False`), inside `deferred()` (pipeline schedules,
which finish the sync themselves after later chunks' work), or with
`sync_grads_at_backward_end = false`; except that under reduce_each_microbatch a no_sync
backward still reduces its micro-batch at its end, deferred or not. Every forward clears
`queued` and the param-grad flag: a backward that raised never runs its callbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd import Variable

from megabuf.sync.grads import find_tensors


class BackwardEndSync:
    """The end-of-backward trigger of one model; `finish` is its `finish_grad_sync`."""

    def __init__(
        self, enabled: bool, finish: Callable[[], None], *, every_backward: bool = False
    ) -> None:
        self.enabled = enabled  # DistributedDataParallelConfig.sync_grads_at_backward_end
        self.require_sync = True  # torch's require_backward_grad_sync
        self.defer_depth = 0  # deferred() nesting
        self.queued = False  # a callback is queued on the running backward
        self.param_grads = False  # a param grad arrived since the last sync (or clear())
        # also finish backwards run without grad sync (optim_grads with reduce_each_microbatch:
        # `finish` then reduces one micro-batch into the grad shards)
        self.every_backward = every_backward
        self._finish = finish

    def set_require_sync(self, value: bool) -> None:
        """`no_sync()`'s flag, set by the grad sync that owns this trigger."""
        self.require_sync = value

    def wanted(self) -> bool:
        if not self.enabled:
            return False
        if self.require_sync:
            return not self.defer_depth
        # deferred() defers the grad sync only: a no_sync micro-batch's own reduction
        # (every_backward) cannot wait, since the next backward (a pipeline's cool-down runs
        # several in a row) would find its groups dispatched
        return self.every_backward

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self.defer_depth += 1
        try:
            yield
        finally:
            self.defer_depth -= 1

    @torch.compiler.disable
    def watch(self, output: Any) -> None:
        """A forward ran with grad enabled: its outputs' grads arm the callback."""
        for tensor in find_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)

    def on_grad(self) -> None:
        """A param's grad arrived: this backward has grads to sync (and the fallback trigger,
        see the Note)."""
        self.param_grads = True
        if not self.queued and self.wanted():
            self._queue()

    def clear(self) -> None:
        """A forward or a new iteration: a backward that raised never ran its callback."""
        self.queued = False
        self.param_grads = False

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        del grad
        if not self.queued and self.wanted():
            self._queue()

    def _queue(self) -> None:
        Variable._execution_engine.queue_callback(self._run)  # type: ignore[attr-defined]
        self.queued = True

    def _run(self) -> None:
        """The backward ended. Only a backward that brought param grads syncs: a pass through
        the outputs that reached no param (`torch.autograd.grad` of the inputs, a gradient
        penalty's first backward) leaves the iteration open for the one that does."""
        self.queued = False
        if self.param_grads and self.wanted():
            self.param_grads = False
            self._finish()
