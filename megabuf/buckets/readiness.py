"""`GradReadiness`: a bucket group's part that knows when the grads of an iteration have all
arrived ([Note: grad readiness] in dispatch.py): the group's grad lifecycle state (what the
per-grad path checks first), the per-param arrival counts and, once the group is switched to
them, its counted arrivals ([Note: counted arrivals] in arrivals.py).

The group owns one and builds it with its callbacks: `on_ready` (every grad arrived) and
`on_reopen` (a grad found the group synced: a new backward accumulates on top), and what its
refusals name. The per-grad entry,
`register_grad_ready_at`, is this object's bound method, which the group publishes as its own
attribute, so a grad costs no Python call more than when readiness was a mixin.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

from torch import nn

from megabuf.buckets.arrivals import CountedArrivals
from megabuf.buckets.dispatch import GradSyncState, expect_state


class NotCounted:
    """The counted part of a group whose arrivals are counted per param (the default)."""

    total = 0

    def reset(self) -> None:
        pass

    def reconcile(self) -> None:
        pass


NOT_COUNTED = NotCounted()


class GradReadiness:
    """One bucket group's readiness over its `n` params; see the module docstring."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        *,
        overlap: bool,
        on_ready: Callable[[], None],
        on_reopen: Callable[[str], None],
        name_of: Callable[[nn.Parameter], str],
        keeps_across_syncs: bool,  # grads may accumulate across syncs (not sharded optimizer)
        group_id: int,
        rank: int,
    ) -> None:
        self.state = GradSyncState.IDLE  # the group's grad lifecycle (its `grad_state`)
        self.overlap = overlap  # overlap_grad_reduce: readiness dispatches during backward
        self._last = True  # this backward ends with the group's reduction (not no_sync())
        self.counting = overlap  # overlap and last: this backward's arrivals make it ready
        self._on_ready = on_ready
        self._on_reopen = on_reopen
        self._name_of = name_of
        self._span = (params[0], params[-1]) if params else None
        n = len(params)
        self._keeps_across_syncs = keeps_across_syncs
        self.group_id = group_id
        self.rank = rank
        # grad arrivals per param per iteration; None until learned
        self.expected: list[int] | None = None
        self._no_arrivals = array.array("H", bytes(2 * n))  # a count > 65535 raises
        # flat array reset in place each iteration: a list of 2000 ints took 0.4-2.3 ms
        self.arrivals = array.array("H", self._no_arrivals)
        self.num_pending = n
        self._n = n
        self.counter: CountedArrivals | NotCounted = NOT_COUNTED  # [Note: counted arrivals]

    @property
    def is_last_microbatch(self) -> bool:
        return self._last

    @is_last_microbatch.setter
    def is_last_microbatch(self, value: bool) -> None:
        self._last = value
        self.counting = self.overlap and value

    def expect(self, *states: GradSyncState) -> None:
        """The grad lifecycle's guard: raise naming both states unless in one of `states`."""
        hint = "did you call zero_grad_buffer() between iterations and finish_grad_sync() after "
        hint += "backward?"
        expect_state(self.state, states, "grad sync", self.group_id, self.rank, hint)

    # ---- the per-grad path --------------------------------------------------------------------
    def register_grad_ready_at(self, i: int, param: nn.Parameter) -> None:
        """The backward hook's entry (it knows `i`, the param's position in the group's
        `params_list`). O(1), allocation-free in steady state."""
        if self.state is not GradSyncState.IDLE:
            self.late(i, param)
        if not self.counting:
            return  # synchronous reduction, or inside no_sync(): accumulate only
        self.arrivals[i] += 1
        expected = self.expected
        if expected is None or self.arrivals[i] != expected[i]:
            return  # learning iteration, or more arrivals to come
        self.num_pending -= 1
        if self.num_pending == 0:
            self.all_arrived()

    def all_arrived(self) -> None:
        """Every grad this iteration brings arrived (per param, or counted)."""
        self.num_pending = 0  # all_ready (a counted group does not count per param)
        self._on_ready()

    def late(self, i: int | None, param: nn.Parameter | None) -> None:
        """A grad (of param `i`; None: a counted arrival) found the group DISPATCHED (raises)
        or SYNCED (a new backward without zero_grad_buffer(): accumulate on top, as torch
        does, where the reductions allow it)."""
        name = self._name_or_span(param)
        if self.state is GradSyncState.DISPATCHED:
            got = self.arrivals[i] if i is not None else self.expected_total
            raise RuntimeError(
                f"megabuf: {name} received a gradient after its bucket group {self.group_id} "
                f"was dispatched (rank {self.rank}), the group already having received {got} "
                "this iteration, as many as learned in the first iteration. "
                "Two backward passes in one iteration need no_sync() around all but the last; "
                "a param whose number of gradient contributions per backward varies between "
                "iterations needs overlap_grad_reduce=False"
            )
        if not self._keeps_across_syncs:
            raise RuntimeError(
                f"megabuf: backward after finish_grad_sync() without zero_grad_buffer() (rank "
                f"{self.rank}, {name}); with use_distributed_optimizer only "
                "this rank's shard of the buffer is reduced, so grads cannot be accumulated "
                "across syncs. Use no_sync() for gradient accumulation"
            )
        self._on_reopen(name)

    def _name_or_span(self, param: nn.Parameter | None) -> str:
        """`param`'s name; without one (a counted arrival) the group's first and last."""
        if param is not None or self._span is None:
            return self._name_of(param) if param is not None else "a param"
        first, last = self._span
        return f"a param of {self._name_of(first)} .. {self._name_of(last)}"

    # ---- per iteration ------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget this iteration's (or micro-batch's) arrivals; the group accepts grads."""
        self.arrivals[:] = self._no_arrivals
        self.counter.reset()
        self.num_pending = self._n
        self.state = GradSyncState.IDLE

    @property
    def learned(self) -> bool:
        return self.expected is not None

    @property
    def all_ready(self) -> bool:
        return self.expected is not None and self.num_pending == 0

    @property
    def expected_total(self) -> int:
        """Grads one iteration brings, as learned; 0 before (or without overlap)."""
        return sum(self.expected or ())

    def learn(self) -> None:
        """End of the first overlapped iteration: every param must from now on get as many
        grads per iteration as it got in this one (at least one) before its group is ready."""
        if self.expected is None and self.overlap:
            self.expected = [max(1, n) for n in self.arrivals]
