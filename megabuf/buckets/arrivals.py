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

import enum
import functools
import inspect
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Protocol

from torch import nn

GradHook = Callable[[nn.Parameter], None]


class CountedGroup(Protocol):
    """What a counter asks of its bucket group (`BucketGroup` in bucket_group.py)."""

    params_list: list[nn.Parameter]
    rank: int
    releases_buckets: bool  # its grad storage is released between reductions (sharded)

    @property
    def accepts_grads(self) -> bool: ...

    @property
    def counts_arrivals(self) -> bool: ...

    def on_all_arrived(self) -> None: ...

    def on_counted_grad_outside_idle(self) -> None: ...

    def set_unwritten(self, flags: bytearray) -> None: ...

    def name_of(self, param: nn.Parameter) -> str: ...


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
        group: CountedGroup,
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


def countable(group: CountedGroup, small: set[nn.Parameter], unused_check: bool) -> bool:
    """Whether `group`'s arrivals can be counted ([Note: counted arrivals]): every param small
    and linked (`small`), its grad storage kept between reductions (not sharded), no
    per-param unused check."""
    if unused_check or group.releases_buckets:
        return False
    return all(p in small for p in group.params_list)


def weak_callable(fn: Callable[[], None]) -> Callable[[], Callable[[], None] | None]:
    """`fn` held weakly if it is a bound method (of the engine): [Note: hooks hold the engine
    weakly] in hooks.py. Calling the result gives `fn`, or None once its owner is gone."""
    if inspect.ismethod(fn):
        return weakref.WeakMethod(fn)
    return lambda: fn  # a plain function holds no engine


def refuse_create_graph(group: CountedGroup, param: nn.Parameter) -> None:
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
