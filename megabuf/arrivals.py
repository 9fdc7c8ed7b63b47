"""`CountedArrivals`: a bucket group's grad arrivals counted without a Python call per grad.

[Note: counted arrivals]
A Python post-accumulate-grad hook costs about 1.5 us a call on the host beyond torch's own
dispatch to a hook (an interpreter frame, megabuf's per-grad bookkeeping), and a model of
thousands of small tensors pays it thousands of times a backward: about 2 % of many_small's step
on 2 CPU ranks (BENCHMARKS.md). For a bucket group whose params are all small and linked
([Note: small grads accumulate in place] in grads.py) a hook has nothing to do per grad but
count: autograd accumulates into `main_grad` itself. So once the group has learned how many
grads an iteration brings ([Note: grad readiness] in dispatch.py; under synchronous reduction
at its first sync), its params' hooks become one C-level callable, `partial(next, chain)` with
`chain = itertools.chain.from_iterable(counter)`: an arrival takes one item from a list
iterator of Nones, which runs no Python code; when the items run out `chain` asks the counter for
the next iterator, and that runs Python. The counter hands out as many items as arrivals are to
pass silently, so Python runs at:
- the group's first arrival after a reset (a new iteration, a dispatch, a sync, `no_sync()`
  entered or left): the per-backward bookkeeping ([Note: one bookkeeping per backward] in
  grad_sync.py), the grad-state check, and the choice: count up to the learned total if this
  backward dispatches the group, else pass a long run of arrivals (`no_sync()`, overlap off);
- the arrival that completes the learned total: the group is ready (dispatched, or handed to
  its dispatch chain);
- every arrival after that: one that finds the group DISPATCHED raises, as the per-param hook
  did (naming the group's first and last param: a counted arrival does not know its own);
  SYNCED (a backward accumulating on top) owes the sync again.
So every backward that reaches a group runs Python at the group's first arrival, also one that
never passed through the wrapper's forward (a loss from `model.module`): the bookkeeping there
arms the sync at backward's end as a per-param hook would have. A reset exhausts the list
iterator in O(1) (`__setstate__`), so the next arrival asks again.
What the per-param hook did with each grad is done for the whole group just before it is
dispatched (`reconcile`, one pass over its params): a param whose `.grad` is a tensor of its own
(it was None when its grad arrived: after the user cleared it, or before the backward's
bookkeeping linked it) is copied into `main_grad` and linked; one that requires grad
(`backward(create_graph=True)`) is refused by name; one whose `.grad` is None got no grad and is
zero-filled (also when the user set it to None after its grad arrived, in the window between
backward and the sync that only `sync_grads_at_backward_end=False` leaves: as torch would read
it; a per-param hook had taken that grad into `main_grad` already).
Readiness is counted per group, not per param: a backward that brings the learned
total in another mix still finishes every grad before the group's last arrival, one that brings
more raises at the first extra arrival after the dispatch, one that brings fewer leaves the group
to the sync at backward's end, as before.
Not counted (a Python hook per param, as before): groups with a param that is large, copied in
another dtype or sharded, the distributed optimizer's groups, `error_on_unused_params` (it names
the params that got no grad, so it needs each arrival), and every group until it has learned.
The counter never lets an exception out of `__next__` (`chain` would drop it for good and the
hooks would then return their param): it hands out an iterator that raises it instead, until
the next reset.
"""

from __future__ import annotations

import array
import enum
import functools
import inspect
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.dispatch import GradSyncState
from megabuf.sharding.grads import ShardedGrads
from megabuf.timeline import Timeline

GradHook = Callable[[nn.Parameter], None]


class _Turn(enum.Enum):
    """What the arrival that makes the counter run Python is."""

    FIRST = "first"  # the group's first since a reset
    LAST = "last"  # the one that completes the learned total
    PASSING = "passing"  # the end of a long run of uncounted arrivals
    AFTER = "after"  # one after the group was ready


class CountedArrivals:
    """One bucket group's counter; see [Note: counted arrivals]. `on_grad` is the engine's
    once-per-backward bookkeeping, skipped while `in_backward[0]`; `total` is the learned number
    of grads an iteration brings (0: never counted, the group reduces at the sync)."""

    def __init__(
        self,
        group: GradReadiness,
        total: int,
        on_grad: Callable[[], Callable[[], None] | None],
        in_backward: list[bool],
    ) -> None:
        self._group = weakref.ref(group)
        self._on_grad = on_grad  # returns the bookkeeping, or None once the engine is gone
        self._in_backward = in_backward
        self.total = total
        self._pairs = [(p, p.main_grad) for p in group.params_list]  # type: ignore[attr-defined]
        self._nones: list[None] = [None] * (2 * max(total, len(self._pairs)) + 16)
        self._active: Iterator[None] = iter(self._nones[:0])
        self._turn = _Turn.FIRST
        self.python_turns = 0  # times an arrival ran Python (tests, the bench)
        chain = itertools.chain.from_iterable(self)
        self.hook: GradHook = functools.partial(next, chain)  # type: ignore[assignment]

    def reset(self) -> None:
        """The next arrival runs Python and starts over (a new iteration, a state change)."""
        self._turn = _Turn.FIRST
        self._active.__setstate__(len(self._nones))  # type: ignore[attr-defined]

    def __iter__(self) -> CountedArrivals:
        return self

    def __next__(self) -> Iterator[None]:
        """An arrival whose turn it is to run Python: the iterator for the arrivals until the
        next such turn, this one included. Never raises (see the Note)."""
        self.python_turns += 1
        try:
            silent = self._take_turn()
        except BaseException as exc:  # handed out: raised by the iterator, see the Note
            self._active = _Raising(exc)
            return self._active
        self._active = run = iter(self._nones)
        run.__setstate__(len(self._nones) - silent)  # type: ignore[attr-defined]
        return run

    def _take_turn(self) -> int:
        """Handle this arrival; how many arrivals pass before Python runs again, this one
        included (at least 1)."""
        group = self._group()
        if group is None:  # the engine is gone: the param is plain again
            return len(self._nones)
        if not self._in_backward[0]:
            on_grad = self._on_grad()
            if on_grad is not None:
                on_grad()
        if not group.accepts_grads:
            group.on_counted_grad_outside_idle()  # raises, or starts over (SYNCED)
        if self._turn is _Turn.FIRST:
            if not (self.total and group.counts_arrivals):
                self._turn = _Turn.PASSING
                return len(self._nones)
            self._turn = _Turn.LAST
            if self.total > 1:
                return self.total - 1
        if self._turn is _Turn.LAST:
            group.on_all_arrived()
            self._turn = _Turn.AFTER  # also when the dispatch reset the counter
        return 1 if self._turn is _Turn.AFTER else len(self._nones)

    def reconcile(self) -> None:
        """Just before the group is dispatched: what each param's hook did with its grads,
        for the whole group (see the Note). Sets which params got no grad."""
        group = self._group()
        if group is None:
            return
        unwritten = bytearray(len(self._pairs))
        for i, (param, main_grad) in enumerate(self._pairs):
            grad = param.grad
            if grad is main_grad:
                continue  # accumulated in place (or untouched)
            if grad is None:
                unwritten[i] = 1
                continue
            if grad.requires_grad:
                refuse_create_graph(group, param)
            main_grad.copy_(grad)
            param.grad = main_grad
        group.set_unwritten(unwritten)


class GradReadiness:
    """Mixed into `BucketGroup` (whose constructor sets these attributes): when the grads of an
    iteration have all arrived ([Note: grad readiness] in dispatch.py), counted per param by the
    Python hooks or per group by a `CountedArrivals`."""

    params_list: list[nn.Parameter]
    ddp_config: DistributedDataParallelConfig
    grad_state: GradSyncState
    is_last_microbatch: bool
    sharded_grads: ShardedGrads | None
    timeline: Timeline | None
    chain: Any  # its DispatchChain, or None
    group_id: int
    rank: int
    counted: CountedArrivals | None
    _expected_arrivals: list[int] | None
    _arrivals: array.array[int]
    _num_pending: int
    _unwritten: bytearray

    def start_grad_sync(self) -> None:
        raise NotImplementedError

    def _clear_readiness(self) -> None:
        raise NotImplementedError

    def name_of(self, param: nn.Parameter) -> str:
        raise NotImplementedError

    @property
    def reduction_gain(self) -> float:
        raise NotImplementedError

    # ---- readiness ([Note: grad readiness]) ---------------------------------------------------
    @property
    def learned(self) -> bool:
        return self._expected_arrivals is not None

    @property
    def all_ready(self) -> bool:
        return self._expected_arrivals is not None and self._num_pending == 0

    def register_grad_ready_at(self, i: int, param: nn.Parameter) -> None:
        """The backward hook's entry (it knows `i`, the param's position in `params_list`).
        O(1), allocation-free in steady state."""
        if self.grad_state is not GradSyncState.IDLE:
            self._on_grad_outside_idle(i, param)
        if not self.ddp_config.overlap_grad_reduce or not self.is_last_microbatch:
            return  # synchronous reduction, or inside no_sync(): accumulate only
        self._arrivals[i] += 1
        expected = self._expected_arrivals
        if expected is None or self._arrivals[i] != expected[i]:
            return  # learning iteration, or more arrivals to come
        self._num_pending -= 1
        if self._num_pending == 0:
            self.on_all_arrived()

    def on_all_arrived(self) -> None:
        """Every grad this iteration brings arrived: dispatch, in chain order."""
        self._num_pending = 0  # all_ready (a counted group does not count per param)
        if self.timeline is not None:
            self.timeline.record(self.group_id, "ready")
        if self.chain is not None:
            self.chain.on_ready()
        else:
            self.start_grad_sync()

    @property
    def accepts_grads(self) -> bool:
        """Not dispatched or synced: a grad accumulates into this iteration's reduction."""
        return self.grad_state is GradSyncState.IDLE

    @property
    def counts_arrivals(self) -> bool:
        """This backward's grads make the group ready (overlap on, not inside no_sync())."""
        return self.ddp_config.overlap_grad_reduce and self.is_last_microbatch

    @property
    def expected_total(self) -> int:
        """Grads one iteration brings, as learned; 0 before (or without overlap)."""
        return sum(self._expected_arrivals or ())

    def learn_arrivals(self) -> None:
        """End of the first overlapped iteration: every param must from now on get as many
        grads per iteration as it got in this one (at least one) before its group is ready."""
        if self._expected_arrivals is None and self.ddp_config.overlap_grad_reduce:
            self._expected_arrivals = [max(1, n) for n in self._arrivals]

    def on_counted_grad_outside_idle(self) -> None:
        """A counted arrival ([Note: counted arrivals]) found the group dispatched or synced."""
        self._on_grad_outside_idle(None, None)

    def _on_grad_outside_idle(self, i: int | None, param: nn.Parameter | None) -> None:
        name = self._name_or_span(param)
        if self.grad_state is GradSyncState.DISPATCHED:
            got = self._arrivals[i] if i is not None else self.expected_total
            raise RuntimeError(
                f"megabuf: {name} received a gradient after its bucket group {self.group_id} "
                f"was dispatched (rank {self.rank}), the group already having received {got} "
                "this iteration, as many as learned in the first iteration. "
                "Two backward passes in one iteration need no_sync() around all but the last; "
                "a param whose number of gradient contributions per backward varies between "
                "iterations needs overlap_grad_reduce=False"
            )
        # SYNCED: a new backward without zero_grad_buffer(): accumulate on top, as torch does.
        if self.ddp_config.sharding.shards_optimizer:
            raise RuntimeError(
                f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
                f"{self.rank}, {name}); with use_distributed_optimizer only "
                "this rank's shard of the buffer is reduced, so grads cannot be accumulated "
                "across syncs. Use no_sync() for gradient accumulation"
            )
        groups = self.chain.groups if self.chain is not None else [self]
        if any(g.reduction_gain != 1.0 for g in groups):
            raise RuntimeError(
                f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
                f"{self.rank}, {name}): this bucket group's reduction does not "
                "map already-reduced grads to themselves (expert-parallel params are scaled by "
                "1/dp_size but summed over expt_dp only), so accumulating across syncs would be "
                "wrong. Use no_sync() for gradient accumulation"
            )
        for group in groups:
            if group.grad_state is GradSyncState.SYNCED:
                group._clear_readiness()
        if self.chain is not None:
            self.chain.reset()

    def _name_or_span(self, param: nn.Parameter | None) -> str:
        """`param`'s name; without one (a counted arrival) the group's first and last."""
        if param is not None:
            return self.name_of(param)
        first, last = self.params_list[0], self.params_list[-1]
        return f"a param of {self.name_of(first)} .. {self.name_of(last)}"

    def set_unwritten(self, flags: bytearray) -> None:
        """Which params' main_grad holds no grad of this iteration, one flag each (1: none);
        [Note: counted arrivals] in arrivals.py."""
        self._unwritten[:] = flags


class _Raising:
    """An iterator that raises `exc` until the counter's next reset exhausts it."""

    def __init__(self, exc: BaseException) -> None:
        self.exc: BaseException | None = exc

    def __iter__(self) -> _Raising:
        return self

    def __next__(self) -> None:
        if self.exc is None:
            raise StopIteration
        raise self.exc

    def __setstate__(self, _: object) -> None:
        self.exc = None


def countable(group: GradReadiness, small: set[nn.Parameter], unused_check: bool) -> bool:
    """Whether `group`'s arrivals can be counted ([Note: counted arrivals]): every param small
    and linked (`small`), grads not sharded, no per-param unused check."""
    if unused_check or group.sharded_grads is not None:
        return False
    return all(p in small for p in group.params_list)


def weak_callable(fn: Callable[[], None]) -> Callable[[], Callable[[], None] | None]:
    """`fn` held weakly if it is a bound method (of the engine): [Note: hooks hold the engine
    weakly] in hooks.py. Calling the result gives `fn`, or None once its owner is gone."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn  # a plain function holds no engine


def refuse_create_graph(group: GradReadiness, param: nn.Parameter) -> None:
    """A grad with a graph of its own (`backward(create_graph=True)`): megabuf reduces grads
    into `main_grad`, a buffer no graph runs through, so a second-order use of `.grad` could
    not be right."""
    raise RuntimeError(
        f"megabuf: {group.name_of(param)} got a grad that requires grad (rank {group.rank}): "
        "backward(create_graph=True) is not supported, as the reduced grads in main_grad are "
        "not differentiable. For a gradient penalty take torch.autograd.grad(..., "
        "create_graph=True) of the inputs and call backward() without create_graph "
        "(model.reset_iter_state() drops this iteration's grads)"
    )
