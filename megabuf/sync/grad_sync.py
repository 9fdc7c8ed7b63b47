"""`GradSync`: one engine's gradient synchronisation, as one object with one phase.

It owns the bucket groups (dense then expert), their dispatch chains ([Note: dispatch order] in
bucket_group.py), the end-of-backward trigger ([Note: grad sync at backward end] in
backward_sync.py) and the grads the sync hands out ([Note: grad contract] in grads.py); the
wrapper's grad-sync methods (`finish_grad_sync`, `no_sync`, `zero_grad_buffer`, ...) are thin
calls into it. It never asks torch.distributed anything itself, so it runs under a recording
fake of the collectives in tests (tests/test_grad_sync.py).

[Note: step phase]
What the engine owes the optimizer, one enum behind one guard (as `BucketGroup`'s lifecycles):

    ACCUMULATING --finish_grad_sync()--> SYNCED --zero_grad_buffer() or a grad--> ACCUMULATING
    ACCUMULATING --a no_sync() forward under reduce_each_microbatch--> MICROBATCH_OWED
    MICROBATCH_OWED --finish_microbatch() (its backward's end, or the next forward)--> ACCUMULATING
    MICROBATCH_OWED --finish_grad_sync() (the owed grads reduce with the sync's)--> SYNCED
    any --reset_iter_state()--> ACCUMULATING

ACCUMULATING: grads accumulate into the buffers (micro-batches, or a backward in progress);
MICROBATCH_OWED: optim_grads* with reduce_each_microbatch, a micro-batch run inside `no_sync()`
whose reduction into the grad shards has not finished yet; SYNCED: the last `finish_grad_sync()`
handed out this iteration's reduced grads and ran the checks; `finish_grad_sync()` is then a
no-op (a later backward accumulates on top, as in torch, and owes the sync again). The groups'
own states say whether their grads are still this iteration's: `unsynced_group()`.

[Note: one bookkeeping per backward]
What a grad hook does for the engine as a whole (the offload check, the phase, the user's grad
changes, arming the end-of-backward sync: `Engine._on_grad`) is owed once per backward, not
once per param, and on a model of thousands of small tensors a few Python calls a param are a
measurable share of backward. So after the first grad of a backward has done it, `in_backward`
is set and the hooks skip it; it is cleared by a callback queued on that backward (run when it
ends) and, because a backward that raised never runs its callbacks, also at every forward,
`zero_grad_buffer()` and grad sync. It is set only after the bookkeeping passed, so a hook that
raised (an offloaded engine) raises again at the next grad.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from torch.autograd import Variable

from megabuf.buckets.bucket_group import BucketGroup, DispatchChain, GradSyncState
from megabuf.buckets.grad_math import foreach_scale
from megabuf.config import DistributedDataParallelConfig
from megabuf.pure.timeline import Timeline
from megabuf.sync.backward_sync import BackwardEndSync
from megabuf.sync.grads import ExposedGrads
from megabuf.sync.microbatches import MicrobatchAgreement

BACKWARD_END_GROUP_ID = -1  # group id of the timeline's "backward_end" marker


class OutsideGrads(Protocol):
    """Grads the sync reduces beside the bucket groups: the sparse ones ([Note: sparse grads
    outside the buffer] in sparse_grads.py)."""

    def start_grad_sync(self) -> None: ...
    def finish_grad_sync(self) -> None: ...
    def clear(self) -> None: ...


class NoOutsideGrads:
    """Every grad lives in a buffer."""

    def start_grad_sync(self) -> None:
        pass

    def finish_grad_sync(self) -> None:
        pass

    def clear(self) -> None:
        pass


class SyncPhase(enum.Enum):
    ACCUMULATING = "accumulating"
    MICROBATCH_OWED = "microbatch_owed"
    SYNCED = "synced"


class GradSync:
    """See [Note: step phase]. `checks` run after every reduction of a grad sync has landed and
    before the grads are handed out (the NaN check, unused params): each raises on every rank."""

    def __init__(
        self,
        groups: Sequence[BucketGroup],
        chains: Sequence[DispatchChain[BucketGroup]],
        config: DistributedDataParallelConfig,
        grads: ExposedGrads,
        *,
        before_sync: Callable[[], None] = lambda: None,
        checks: Sequence[Callable[[], None]] = (),
        agreement: MicrobatchAgreement | None = None,
        outside: OutsideGrads | None = None,
        on_backward_end: Callable[[], None] | None = None,
        on_synced: Callable[[], None] | None = None,
        on_first_sync: Callable[[], Callable[[], None] | None] | None = None,
    ) -> None:
        self.groups = list(groups)  # dense then expert
        self.outside: OutsideGrads = outside if outside is not None else NoOutsideGrads()
        self.chains = list(chains)
        self.grads = grads
        self.reduce_each = config.sharding.shards_grads and (
            config.sharded_grad_accumulation == "reduce_each_microbatch"
        )
        self.backward_end = BackwardEndSync(
            config.sync_grads_at_backward_end, self._backward_ended, every_backward=self.reduce_each
        )
        self.defer_dispatch = False  # this iteration reduces after backward ([Note: quiet step])
        self.phase = SyncPhase.ACCUMULATING
        # shared with the grad hooks: [Note: one bookkeeping per backward]
        self.in_backward = [False]
        self.timeline: Timeline | None = None
        # bucket_size="auto" warm-up: told when each grad sync starts ([Note: auto bucket re-plan])
        self.on_backward_end = on_backward_end
        self.on_synced = on_synced  # ... and when its reductions landed
        # once, after the first sync learned the arrivals ([Note: counted arrivals]); held
        # weakly: returns the callback, or None once its owner is gone
        self.on_first_sync = on_first_sync
        self._before_sync = before_sync
        self._checks = tuple(checks)
        self.agreement = agreement  # [Note: micro-batch agreement]; None: counts may differ
        self._rescale = 1.0  # the next sync's reduced grads times this ([Note: uneven inputs])

    # ---- no_sync ------------------------------------------------------------------------------
    @property
    def require_sync(self) -> bool:
        """torch DDP's `require_backward_grad_sync`: False makes backward only accumulate."""
        return self.backward_end.require_sync

    def set_require_sync(self, value: bool) -> None:
        """Set `require_sync` (`no_sync()`, the wrapper's `require_backward_grad_sync`)."""
        self.backward_end.set_require_sync(bool(value))
        for group in self.groups:
            group.is_last_microbatch = self._dispatches_in_backward(bool(value))
            group.is_final_microbatch = bool(value)  # [Note: two-level reduction]
            if group.counted is not None:  # the next arrival decides afresh whether to count
                group.counted.reset()

    def _dispatches_in_backward(self, require_sync: bool) -> bool:
        return (require_sync or self.reduce_each) and not self.defer_dispatch

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        before = self.require_sync
        self.set_require_sync(False)
        try:
            yield
        finally:
            self.set_require_sync(before)

    def deferred(self) -> AbstractContextManager[None]:
        return self.backward_end.deferred()

    # ---- forward and backward -----------------------------------------------------------------
    def before_forward(self, grad_enabled: bool) -> None:
        """A forward starts: a backward that raised never ran its callbacks; a micro-batch
        whose reduction is still owed (its backward's sync was deferred) finishes now."""
        self.backward_end.clear()
        self.in_backward[0] = False
        if self.phase is SyncPhase.MICROBATCH_OWED:
            self.finish_microbatch()
        if self.agreement is not None and grad_enabled:
            self._agree(lambda a: a.forward(last=self.require_sync))
        if self.reduce_each and grad_enabled and not self.require_sync:
            self.phase = SyncPhase.MICROBATCH_OWED

    def watch(self, output: Any) -> None:
        """A training forward's outputs arm the end-of-backward sync."""
        if self.backward_end.wanted():
            self.backward_end.watch(output)

    def on_grad(self) -> None:
        """Every param grad hook's first step (hot path): see [Note: grads the user changed]
        in grads.py and [Note: grad sync at backward end]."""
        if self.phase is SyncPhase.SYNCED:
            self.phase = SyncPhase.ACCUMULATING  # accumulates on top: the sync is owed again
        if self.grads.exposed:
            self.grads.begin_backward()
        elif self.grads.armed:
            self.grads.link_small()
        self.backward_end.on_grad()

    def skip_until_backward_ends(self) -> None:
        """The grad hooks skip `on_grad` for the rest of this backward ([Note: one bookkeeping
        per backward])."""
        self.in_backward[0] = True
        Variable._execution_engine.queue_callback(self._backward_over)  # type: ignore[attr-defined]

    def _backward_over(self) -> None:
        self.in_backward[0] = False

    def _backward_ended(self) -> None:
        """The end-of-backward callback: the grad sync, or under reduce_each_microbatch inside
        no_sync() this micro-batch's reduction."""
        if self.require_sync:
            self.finish()
        else:
            self.phase = SyncPhase.MICROBATCH_OWED  # also when its forward ran with sync on
            self.finish_microbatch()

    # ---- the sync -----------------------------------------------------------------------------
    def start(self) -> None:
        """Dispatch every reduction not yet dispatched, in chain order. Collective."""
        for chain in self.chains:
            chain.dispatch_rest()

    def finish_microbatch(self) -> None:
        """MICROBATCH_OWED: dispatch what backward did not, wait, add every reduced shard into
        the grad shards and release the full buckets; a no-op in any other phase."""
        if self.phase is not SyncPhase.MICROBATCH_OWED:
            return
        self.phase = SyncPhase.ACCUMULATING
        for group in self.groups:  # not the step's last: nothing crosses replicas
            group.is_final_microbatch = False
        self._reduce_and_wait()
        for group in self.groups:
            group.next_microbatch()
            group.is_final_microbatch = self.require_sync
        for chain in self.chains:
            chain.reset()

    def finish(self) -> None:
        """Dispatch what backward did not, wait for every reduction, run the checks and hand
        out the grads. A no-op once it ran and no grad arrived since (SYNCED), e.g. when
        backward's end already ran it. Every group SYNCED is not enough: under optim_grads*
        backward itself finishes the groups whose reduction already landed, and the checks
        are collectives every dp rank runs once per iteration."""
        self.in_backward[0] = False
        if self.groups and self.phase is SyncPhase.SYNCED and self.unsynced_group() is None:
            return
        if self.timeline is not None:
            self.timeline.record(BACKWARD_END_GROUP_ID, "backward_end")
        if self.agreement is not None:
            self._agree(MicrobatchAgreement.sync)
        if self.on_backward_end is not None:
            self.on_backward_end()
        self._before_sync()
        self.phase = SyncPhase.ACCUMULATING  # an owed micro-batch reduces with this sync
        for group in self.groups:
            group.end_step_at_sync()  # [Note: two-level reduction]
        self.start()  # the dense groups first, then the sparse grads: the same order on every rank
        self.outside.start_grad_sync()
        self._reduce_and_wait()
        self.outside.finish_grad_sync()
        if self._rescale != 1.0:
            grads = [b.grad_data for group in self.groups for b in group.buckets]
            foreach_scale(grads, [self._rescale] * len(grads))
            self._rescale = 1.0
        if self.on_first_sync is not None:
            first, self.on_first_sync = self.on_first_sync(), None
            if first is not None:
                first()
        if self.on_synced is not None:
            self.on_synced()
        for check in self._checks:
            check()
        self.grads.expose()
        self.phase = SyncPhase.SYNCED

    def drop_first_sync(self) -> None:
        """Never swap in counted arrivals (benchmarks and tests of the per-param Python hooks;
        [Note: counted arrivals]); before the first sync."""
        self.on_first_sync = None

    def rescale_next_sync(self, factor: float) -> None:
        """The next `finish()` multiplies the reduced grads by `factor` before the checks and
        before anyone reads them: under Join with divide_by_initial_world_size=False, dp_size
        over the ranks still training ([Note: uneven inputs] in join.py)."""
        self._rescale = factor

    def _agree(self, act: Callable[[MicrobatchAgreement], None]) -> None:
        """Run an agreement of [Note: micro-batch agreement]; when it raises (on every rank of
        the group), drop this iteration's grads first, as the NaN check does."""
        if self.agreement is None:
            return
        try:
            act(self.agreement)
        except RuntimeError:
            self.abandon()
            raise

    def _reduce_and_wait(self) -> None:
        """Dispatch what is left in chain order, wait for every group, learn arrival counts."""
        self.start()
        for chain in self.chains:
            for group in chain.groups:
                group.finish_grad_sync()
        for group in self.groups:
            group.learn_arrivals()

    def unsynced_group(self) -> BucketGroup | None:
        """A bucket group whose grads are not this iteration's reduced grads, or None."""
        return next((g for g in self.groups if g.grad_state is not GradSyncState.SYNCED), None)

    # ---- a new iteration ----------------------------------------------------------------------
    def zero(self, defer_dispatch: bool = False) -> None:
        """Start a new iteration's grads (lazily: [Note: grad accumulation into main_grad]);
        `defer_dispatch`: its backward only accumulates and the sync reduces everything after
        it (the auto bucket warm-up's quiet step, [Note: quiet step] in warmup.py)."""
        self.defer_dispatch = defer_dispatch
        for group in self.groups:
            group.reset()
        for chain in self.chains:
            chain.reset()
        for group in self.groups:
            group.is_last_microbatch = self._dispatches_in_backward(self.require_sync)
            group.is_final_microbatch = self.require_sync
        self.grads.clear()
        self.outside.clear()
        self.backward_end.clear()
        self.in_backward[0] = False
        self.phase = SyncPhase.ACCUMULATING
        if self.agreement is not None:
            self.agreement.reset()

    def abandon(self) -> None:
        """After an exception mid-iteration: wait out every reduction in flight (its grads are
        dropped), leave no_sync and start a new iteration."""
        for group in self.groups:
            group.abandon_grad_sync()
        self.outside.finish_grad_sync()
        self.set_require_sync(True)
        self.zero()  # phase: ACCUMULATING

    def enable_timeline(self, timeline: Timeline) -> None:
        self.timeline = timeline
        for group in self.groups:
            group.set_timeline(timeline)
