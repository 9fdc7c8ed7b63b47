"""The ZeRO-3 unit runtime: module hooks that gather and release each shard unit's params.

[Note: who gathers when]
Under optim_grads_params the unit module owns *when* a gather happens and its bucket groups'
`ShardedParams` own *what* is gathered ([Note: sharded param lifecycle] in params.py). Per unit:
1. pre-forward: gather unless already unsharded (a prefetch is reused), start the prefetch of the
   next `prefetch_units` units of the recorded forward order, wait for its own gather, and, in a
   grad-enabled forward, put a post-backward autograd function on the unit's tensor inputs;
2. post-forward: release if `reshard_after_forward`, the unit is not the root and this is not a
   recompute (activation checkpointing re-runs forward inside backward); in a grad-enabled
   forward, a pre-backward hook goes on the outputs. A forward without grad (evaluation) has no
   backward: every unit, the root included, is released at its post-forward;
3. pre-backward (first grad of an output): gather again if released, prefetch the units before
   it in the recorded order (backward runs forward order in reverse);
4. post-backward (the autograd function on its inputs fires, i.e. the unit's whole backward is
   done; not when its grads are ready, since frozen params or later nodes of the unit may still
   read the weights): release;
5. end of backward (an autograd callback queued by the first pre-backward): finish and release
   whatever is still gathered (the root, units whose inputs need no grad, prefetches unused).
Recorded order: the units in the order their pre-forward ran, recorded per kind of forward
(grad on / off) at the first one, checked at every later one. A different order warns once and
is re-recorded; until then prefetches follow the old one, which costs memory and time, never
correctness, because every unit gathers and waits for its own params before it runs.
Collective order: every gather is started from these hooks, whose order is the module call order
and autograd's, so every dp rank starts the same gathers in the same order as long as every rank
runs the same units (the same contract as FSDP). Nothing is gathered at step time: the optimizer
writes the shards (`release_all` first drops any full copy that would turn stale).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from megabuf.sharding.params import ParamShardState, ShardedParams
from megabuf.sharding.read_guard import StrayReadGuard


@dataclass
class RuntimeUnit:
    """One shard unit as the runtime sees it: its module and its groups' param storages."""

    index: int
    name: str  # dotted module path; "" for the root
    module: nn.Module
    params: list[ShardedParams] = field(default_factory=list)

    @property
    def is_root(self) -> bool:
        return self.index == 0

    def start_gather(self) -> None:
        for p in self.params:
            if p.state is ParamShardState.SHARDED:
                p.start_param_gather()

    def wait_gather(self) -> None:
        for p in self.params:
            if p.state is ParamShardState.GATHERING:
                p.finish_param_gather()

    def release(self) -> None:
        for p in self.params:
            p.ensure_released()


def in_backward() -> bool:
    """Autograd is running a backward on this thread (a recompute of activation
    checkpointing runs its forward there)."""
    return bool(torch._C._current_graph_task_id() != -1)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the unit's backward is done."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *inputs: torch.Tensor) -> Any:
        ctx.on_backward = on_backward
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.on_backward()
        return (None, *grads)


class UnitRuntime:
    """Hooks of every unit of one wrapped model; see [Note: who gathers when]."""

    def __init__(
        self,
        units: Sequence[RuntimeUnit],
        *,
        reshard_after_forward: bool,
        prefetch_units: int,
        rank: int,
        owners: Mapping[nn.Parameter, tuple[str, str, ShardedParams]] | None = None,
        entry_guard: Callable[[str], None] | None = None,
    ) -> None:
        self.units = list(units)  # units[0] is the root
        self.reshard_after_forward = reshard_after_forward
        self.prefetch_units = prefetch_units
        self.rank = rank
        self.orders: dict[bool, list[int]] = {}  # grad enabled? -> recorded unit order
        self._current: list[int] = []  # units of the running forward, in pre-forward order
        self._current_grad = True
        self._diverged = False
        self._backward_cursor = 0
        self._final_queued = False
        self._handles: list[RemovableHandle] = []
        self._running: list[str] = []  # names of the units whose forward runs, innermost last
        self._guard: StrayReadGuard | None = None  # [Note: stray reads]
        self._owners = owners or {}
        # raises while the engine is offloaded ([Note: offloaded engine] in residency.py):
        # the first thing a unit's forward or backward runs, before any gather reads a shard
        self.entry_guard: Callable[[str], None] = entry_guard or (lambda entry: None)

    # ---- installation -------------------------------------------------------------------------
    def install(self) -> None:
        for unit in self.units:
            if unit.params or unit.is_root:
                self._handles.append(
                    unit.module.register_forward_pre_hook(
                        self._pre_forward_hook(unit), with_kwargs=True
                    )
                )
                self._handles.append(
                    unit.module.register_forward_hook(self._post_forward_hook(unit))
                )
        root = self.units[0].module
        self._handles.append(root.register_forward_hook(self._exit_guard, always_call=True))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_forward_hook(self, unit: RuntimeUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            return self._pre_forward(unit, args, kwargs)

        return hook

    def _post_forward_hook(self, unit: RuntimeUnit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._post_forward(unit, output)

        return hook

    # ---- forward ------------------------------------------------------------------------------
    def _pre_forward(self, unit: RuntimeUnit, args: Any, kwargs: Any) -> Any:
        self.entry_guard("forward")
        if in_backward():  # a recompute: the unit's pre-backward gathered it already
            unit.start_gather()
            unit.wait_gather()
            return None
        if unit.is_root:
            self._begin_forward()
        self._running.append(unit.name)
        position = len(self._current)
        self._current.append(unit.index)
        unit.start_gather()
        self._prefetch_forward(unit, position)
        unit.wait_gather()
        if not torch.is_grad_enabled():
            return None
        return self._wrap_inputs(unit, args, kwargs)

    def _begin_forward(self) -> None:
        self._current = []
        self._current_grad = torch.is_grad_enabled()
        self._diverged = False
        self._final_queued = False  # a backward that raised never ran its callback
        self._running = []
        if self._current_grad not in self.orders and self._owners and self._guard is None:
            guard = StrayReadGuard(self._owners, self._innermost, self.rank)
            guard.__enter__()
            self._guard = guard

    def _innermost(self) -> str:
        return self._running[-1] if self._running else ""

    def _exit_guard(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's last forward hook (also run when forward raised)."""
        if self._guard is not None and not in_backward():
            guard, self._guard = self._guard, None
            guard.__exit__(None, None, None)

    def _post_forward(self, unit: RuntimeUnit, output: Any) -> None:
        if in_backward():
            return
        if self._running:
            self._running.pop()
        if not torch.is_grad_enabled():
            unit.release()  # no backward will come
        else:
            if self.reshard_after_forward and not unit.is_root:
                unit.release()
            self._hook_outputs(unit, output)
        if unit.is_root:
            self._end_forward()

    def _end_forward(self) -> None:
        """Record the order at the first forward of its kind; a different one re-records."""
        recorded = self.orders.get(self._current_grad)
        if recorded is not None and recorded != self._current:
            warnings.warn(
                f"megabuf: the shard units ran in a different order in this forward than in "
                f"the recorded one (rank {self.rank}): {self._names(self._current)} instead of "
                f"{self._names(recorded)}; prefetch follows the new order from now on (a "
                "changing order costs time and memory, never correctness)",
                stacklevel=2,
            )
        self.orders[self._current_grad] = list(self._current)
        self._backward_cursor = len(self._current)

    def _names(self, order: Sequence[int]) -> list[str]:
        return [self.units[i].name or "<root>" for i in order]

    def _prefetch_forward(self, unit: RuntimeUnit, position: int) -> None:
        recorded = self.orders.get(self._current_grad)
        if recorded is None or self.prefetch_units == 0:
            return
        if self._diverged or position >= len(recorded) or recorded[position] != unit.index:
            self._diverged = True  # re-recorded (and warned about) at the root's post-forward
            return
        self._prefetch(recorded[position + 1 :], unit)

    def _prefetch(self, candidates: Sequence[int], unit: RuntimeUnit) -> None:
        """Start the gathers of the first `prefetch_units` distinct units of `candidates`."""
        taken: list[int] = []
        for index in candidates:
            if len(taken) == self.prefetch_units:
                break
            if index == unit.index or index in taken or not self.units[index].params:
                continue
            taken.append(index)
            self.units[index].start_gather()

    def _wrap_inputs(self, unit: RuntimeUnit, args: Any, kwargs: Any) -> Any:
        """Route the unit's tensor inputs that need grad through `_PostBackward`."""
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where or (unit.is_root and not unit.params):
            return None
        outs = _PostBackward.apply(lambda: self._post_backward(unit), *[flat[i] for i in where])
        for i, out in zip(where, outs, strict=True):
            flat[i] = out
        return tree_unflatten(flat, spec)

    def _hook_outputs(self, unit: RuntimeUnit, output: Any) -> None:
        flat, _ = tree_flatten(output)
        tensors = [x for x in flat if isinstance(x, torch.Tensor) and x.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grad: self._pre_backward(unit), mode="any"
            )

    # ---- backward -----------------------------------------------------------------------------
    def _pre_backward(self, unit: RuntimeUnit) -> None:
        self.entry_guard("backward")
        if torch.is_grad_enabled():  # the engine runs hooks in grad mode only for create_graph
            where = repr(unit.name) if unit.name else "the root"
            raise RuntimeError(
                f"megabuf: a backward with create_graph=True reached shard unit {where} under "
                "optim_grads_params: the graph it builds reads the unit's params after "
                "the unit is released, so a second-order backward (a gradient penalty) cannot "
                'run here. Use data_parallel_sharding_strategy="optim_grads", and call '
                "model.reset_iter_state()"
            )
        if not self._final_queued:
            Variable._execution_engine.queue_callback(self._on_backward_end)  # type: ignore[attr-defined]
            self._final_queued = True
        unit.start_gather()
        self._prefetch_backward(unit)
        unit.wait_gather()

    def _prefetch_backward(self, unit: RuntimeUnit) -> None:
        recorded = self.orders.get(True)
        if recorded is None or self.prefetch_units == 0:
            return
        cursor = min(self._backward_cursor, len(recorded))
        if unit.is_root:  # its outputs' grads come first: the last units run backward next
            self._prefetch(recorded[cursor - 1 :: -1] if cursor else [], unit)
            return
        for i in range(cursor - 1, -1, -1):
            if recorded[i] == unit.index:
                self._backward_cursor = i
                self._prefetch(recorded[i - 1 :: -1] if i else [], unit)
                return

    def _post_backward(self, unit: RuntimeUnit) -> None:
        unit.release()

    def _on_backward_end(self) -> None:
        self._final_queued = False
        self.release_all()
        recorded = self.orders.get(True)
        self._backward_cursor = len(recorded) if recorded is not None else 0

    # ---- outside forward/backward ------------------------------------------------------------
    def release_all(self) -> None:
        """Finish every gather in flight and release every unit (not collective)."""
        for unit in self.units:
            unit.release()

    def gather_all(self) -> None:
        """Gather every unit (collective: every dp rank, same states)."""
        for unit in self.units:
            unit.start_gather()
        for unit in self.units:
            unit.wait_gather()

    def reset(self) -> None:
        """After an exception mid-iteration: nothing gathered, no forward in progress."""
        self.release_all()
        self._current = []
        self._final_queued = False
