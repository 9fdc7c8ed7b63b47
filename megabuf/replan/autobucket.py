"""`bucket_size = "auto"`: measure the warm-up steps, agree the numbers, choose the boundaries.

[Note: auto bucket re-plan]
With `bucket_size = "auto"` the engine starts on the default plan and an `AutoBucket` watches:
- Measure (megabuf/replan/warmup.py): a post-accumulate-grad hook per param (registered after the
  engine's, so it fires once the grad is in `main_grad`) records "param_ready" into a
  `Timeline` of its own, and the grad sync records "backward_end" there at the start of each
  `finish_grad_sync()`. The first step is not used (it learns arrival counts and reduces at
  the end); for each later overlapped warm-up step, each param's last ready time relative to
  that step's backward end; the median over the measured steps. A param without a grad in a
  step counts as ready at backward end. With 3 or more warm-up steps the last is quiet, its
  reductions after backward ([Note: quiet step] in warmup.py).
- Collective model: at the re-plan, a probe of all-reduces of two sizes on the dp group (the
  same communicator, dtype and device as the grads; one untimed round, then the fastest of three)
  fitted by `fit_collective_model` (latency + bytes / bandwidth), then calibrated against the
  warm-up ([Note: calibrated collective model] below).
- Agree: every number above goes through one all-reduce MAX over the dp group, so every rank
  plans from the same (most pessimistic) numbers: a rank-local plan could differ across ranks
  and pair collectives of different sizes (a hang or wrong sums). `plan_buckets` is
  deterministic, so the same numbers give the same boundaries everywhere ([Note: auto bucket
  plan] in bucket_planner.py). At dp 1 nothing is measured and the plan that ran is kept ([Note:
  auto bucket plan at dp 1]).
- Re-plan: once, in `zero_grad_buffer()` after the `auto_bucket_warmup_steps`-th grad sync (every
  rank syncs the same number of times, so every rank re-plans at the same call), or at the first one
  after that outside `no_sync()` (whose exit would reset the replaced grad sync's flag); in a
  torch-style loop also at a forward ([Note: auto bucket re-plan in a torch-style loop]). Under
  "optim", "optim_grads" and "optim_grads_params" the buffers are padded and sharded, so the
  re-plan allocates new ones and the optimizer carries its state across in model space ([Note:
  sharded auto bucket re-plan] in sharded_replan.py). Under "optim_grads_params" a shard unit's
  bucket group is reduced once all of the unit's grads are in, so the planner counts each param
  ready when its unit's last grad is and cuts at unit ends (`placed`); within a unit it then
  only weighs the per-collective latency. On the unsharded path the buffer
  layout has no padding, so every param keeps its offset, `param.data`, `param.main_grad`, `.grad`
  links and anything an optimizer or the user holds stay valid; what changes is the buckets (new
  views of the same grad storage, zeroed) and everything built on them, rebuilt by the engine
  (bucket groups, chains, grad hooks, the grad sync with its no_sync state and timeline, the
  comm-hook registry, the param side). A comm hook registered by then holds per-bucket state: the
  re-plan raises naming it. Checkpoints do not depend on the bucket plan (model-space optimizer
  state, [Note: checkpoint layout]), so nothing there changes.

[Note: auto bucket re-plan in a torch-style loop]
A loop written for torch DDP never calls `zero_grad_buffer()`: it clears grads with a torch
optimizer's `zero_grad()` (`.grad` set to None, [Note: grads the user changed] in grads.py).
So the quiet step and the re-plan also start at a grad-enabled forward of the wrapper outside
`no_sync()` that begins an iteration: the last grad sync handed its grads out (phase SYNCED)
and, on every dp rank, every exposed `.grad` is None (one all-reduce MAX of a flag per such
forward, only while the warm-up waits for that start: the flag is the user's state and may
differ by rank; a rank-local decision would pair a re-plan's collectives with nothing). That
forward then runs `zero_grad_buffer()` first: with every `.grad` None it changes nothing the
user sees. Only where grads are exposed ("no_shard"): the sharded strategies step megabuf's
optimizer, whose `zero_grad()` is `zero_grad_buffer()`. A loop that gives no such start (grads
zeroed in place, micro-batches whose first forward runs inside `no_sync()`, a
`zero_grad_buffer()` only inside `no_sync()`) would stay on the warm-up's per-param hooks, its
timeline growing every step: after OVERDUE_SYNCS grad syncs past the warm-up the default plan
is kept, the hooks removed, and a warning says how to get the re-plan. While it waits (a few
steps), a grad-enabled forward through the wrapper is collective, as it already is for a module
with buffers to broadcast: run a rank-local forward under `torch.no_grad()` or on
`model.module`.

[Note: calibrated collective model]
The probe times collectives on an idle machine, but the buckets' collectives run while backward
computes: on a GPU they share memory bandwidth and SMs, on CPU ranks (gloo) they share the cores,
and there the idle probe predicted a fifth of the exposed time the bench then measured
(mlp_34m, BENCHMARKS.md), so the planner chose a plan worse than the default. The warm-up
already ran a plan on the real step: the grad sync records "synced" when every reduction of the
step has landed, so each measured step also gives the exposed time of the plan it ran (synced -
backward_end; the least over the measured steps, as load from outside the step only adds
time; agreed by MAX like every number). Before
planning, `calibrate` (bucket_planner.py) slows the probed model down by the least factor
(1 to MAX_SLOWDOWN) with which the model predicts at least that exposed time for the plan that
ran (the largest over the buffers, as `predicted_exposed_s`); a probe that already predicts as
much is kept. One factor for latency and bandwidth alike: the simplest model that reproduces
the one measured point; the factor is logged. What the model still leaves out is what each
extra bucket costs during backward (its dispatch, its share of the device or the cores): chosen
boundaries with more buckets than the ones that ran replace them only if they are predicted to
save at least MIN_GAIN (2 %) of the backward's length, ones with no more buckets if they are not
predicted worse (`worth_changing`); otherwise the re-plan keeps the boundaries that ran (logged
as such) and the engine rebuilds nothing.

[Note: auto bucket plan at dp 1]
A dp group of one rank has nothing to overlap: nothing is measured and the plan that ran (the
int default's) is kept, so the engine rebuilds nothing. Re-planning to one bucket per buffer was
the first design; on one H100 (BENCHMARKS.md, GPU section 5) it ran no faster than the plan
that ran (step time within 0.4 %), while under the distributed optimizer its rebuild put new
buffers beside the old ones: +1225 MiB of peak CUDA memory and +4.7 GiB of host memory for the
optimizer state in transit, for nothing.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import BufferPlan, Plan, build_plan
from megabuf.planning.replicas import param_specs
from megabuf.pure.bucket_planner import (
    BucketChoice,
    CollectiveModel,
    calibrate,
    format_bucket_ends,
    plan_buckets,
    predict_exposed,
    reduce_at_end,
    worth_changing,
)
from megabuf.pure.layout import placement_order
from megabuf.pure.timeline import Timeline
from megabuf.replan.warmup import (
    BACKWARD_END,
    PARAM_READY,
    QUIET,
    SYNCED,
    Measurement,
    agree,
    measured,
    probe_collective,
)
from megabuf.transport.collectives import Collectives, Group

logger = logging.getLogger(__name__)
OVERDUE_SYNCS = 2  # [Note: auto bucket re-plan in a torch-style loop]


def calibrated(plan: Plan, numels: Sequence[int], measurement: Measurement) -> Measurement:
    """`measurement` with its model slowed down until it predicts, for `plan` (the plan the
    warm-up ran), the exposed time measured with it ([Note: calibrated collective model])."""
    model, factor = _calibrated_model(plan, numels, measurement, measurement.exposed_s, max)
    return replace(measurement, model=model, slowdown=factor)


def at_end(
    plan: Plan, numels: Sequence[int], own_bucket: Sequence[bool], measurement: Measurement
) -> tuple[BucketChoice, ...]:
    """Each buffer as few buckets as the layout allows (one, but for params with a bucket of
    their own), all reduced after backward, predicted with the model calibrated on the quiet
    step: slowed until the plan that ran, reduced after backward buffer after buffer, takes
    the quiet step's exposed time ([Note: quiet step] in warmup.py)."""
    after = replace(measurement, ready_s=tuple(0.0 for _ in measurement.ready_s))
    model, _ = _calibrated_model(plan, numels, after, measurement.quiet_exposed_s, sum)
    return choose_buckets(plan, numels, own_bucket, replace(after, model=model))


def _calibrated_model(
    plan: Plan, numels: Sequence[int], measurement: Measurement, measured_s: float,
    over_buffers: Callable[[list[float]], float],
) -> tuple[CollectiveModel, float]:  # fmt: skip
    """`calibrate` of the measurement's model on `plan`: its buffers' predicted exposed times,
    combined by `over_buffers` (max: overlapped, sum: one after the other), against
    `measured_s`."""

    def predict(model: CollectiveModel) -> float:
        current = current_choices(plan, numels, replace(measurement, model=model))
        return over_buffers([c.predicted_exposed_s for c in current] or [0.0])

    return calibrate(measurement.model, predict, measured_s)


def current_choices(
    plan: Plan, numels: Sequence[int], measurement: Measurement
) -> tuple[BucketChoice, ...]:
    """`plan`'s own boundaries as choices, with the model's exposed time of each buffer."""
    out = []
    for buf in plan.buffers:
        order, ready, _ = placed(plan, buf, measurement)
        buckets = sorted(buf.layout.buckets, key=lambda b: b.start)
        counts = tuple(len(b.param_ids) for b in buckets)
        exposed = predict_exposed(
            counts, [numels[i] for i in order], ready, 0.0, measurement.model,
            element_size=buf.grad_dtype.itemsize,
        )  # fmt: skip
        out.append(BucketChoice(counts, tuple(b.numel for b in buckets), exposed))
    return tuple(out)


def choose_buckets(
    plan: Plan, numels: Sequence[int], own_bucket: Sequence[bool], measurement: Measurement
) -> tuple[BucketChoice, ...]:
    """One choice per planned buffer: params in buffer order, a param with a bucket of its own
    cut on both sides, a shard unit's last param cut after (ZeRO-3)."""
    choices = []
    for buf in plan.buffers:
        order, ready, unit_ends = placed(plan, buf, measurement)
        own = [own_bucket[i] for i in order]
        cuts = [
            own[p] or unit_ends[p] or (p + 1 < len(order) and own[p + 1]) for p in range(len(order))
        ]
        choices.append(
            plan_buckets(
                [numels[i] for i in order], ready, 0.0, measurement.model,
                element_size=buf.grad_dtype.itemsize, breaks_after=cuts,
            )
        )  # fmt: skip
    return tuple(choices)


def placed(
    plan: Plan, buf: BufferPlan, measurement: Measurement
) -> tuple[list[int], list[float], list[bool]]:
    """`buf`'s spec ids in placement order, the order `bucket_ends` counts in ([Note: buffer
    layout]), their ready times and whether a shard unit ends after each. Under ZeRO-3 a unit's
    bucket group is reduced once every grad of the unit is in ([Note: unit-aligned plan]), so
    each param counts as ready when its unit's last grad is."""
    units = plan.unit_of_spec
    unit_ids = None if units is None else [units[i] for i in buf.param_ids]
    order = [buf.param_ids[p] for p in placement_order(len(buf.param_ids), unit_ids)]
    if units is None:
        return order, [measurement.ready_s[i] for i in order], [False] * len(order)
    unit_ready: dict[int, float] = {}
    for i in order:
        unit_ready[units[i]] = max(unit_ready.get(units[i], -math.inf), measurement.ready_s[i])
    ends = [p + 1 == len(order) or units[order[p + 1]] != units[i] for p, i in enumerate(order)]
    return order, [unit_ready[units[i]] for i in order], ends


def ends_of(choice: BucketChoice) -> tuple[int, ...]:
    """Cumulative param counts: the layout's `bucket_ends`."""
    out, total = [], 0
    for count in choice.param_counts:
        total += count
        out.append(total)
    return tuple(out)


class AutoBucket:
    """The warm-up watcher of one engine; see [Note: auto bucket re-plan]."""

    def __init__(
        self,
        trainable: Sequence[tuple[str, nn.Parameter]],
        config: DistributedDataParallelConfig,
        collectives: Collectives,
        group: Group,
        device: torch.device,
        owner: object,
    ) -> None:
        """`owner`: the engine; its hooks go when it is collected before the re-plan."""
        self.trainable = list(trainable)
        self.config = config
        self.collectives = collectives
        self.group = group
        self.device = device
        self.timeline = Timeline(device)
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._hook(i))
            for i, (_, p) in enumerate(self.trainable)
        ]
        weakref.finalize(owner, _remove_all, list(self._handles))
        self.choices: tuple[BucketChoice, ...] = ()
        self.summary = ""  # the chosen plan, as logged (after the re-plan)
        self.replanned = False
        self.kept = False  # the re-plan kept the plan that ran (too small a gain, or `keep`)
        self._current: tuple[BucketChoice, ...] = ()  # the plan that ran, as choices
        self.syncs = 0  # grad syncs seen (the grad sync calls `on_backward_end`)
        # [Note: quiet step] in warmup.py: unsharded grads, something to overlap
        self.quiet_allowed = not config.sharding.shards_grads and collectives.size(group) > 1
        self._quiet_marked = -1  # `syncs` when the quiet step was marked
        self.at_end = False  # the re-plan chose to reduce each buffer after backward
        self.comparison = ""  # the quiet step's comparison, as logged

    def _hook(self, index: int):  # type: ignore[no-untyped-def]
        record = self.timeline.record

        def hook(param: nn.Parameter) -> None:
            record(index, PARAM_READY)

        return hook

    def on_backward_end(self) -> None:
        """The grad sync starts finishing (start of `finish_grad_sync()`)."""
        if not self.replanned:  # a kept plan's grad sync still calls
            self.timeline.record(-1, BACKWARD_END)
            self.syncs += 1

    def on_synced(self) -> None:
        """Every reduction of the step has landed (the grad sync's wait returned)."""
        if not self.replanned:
            self.timeline.record(-1, SYNCED)

    @property
    def wants_iteration_start(self) -> bool:
        """The warm-up waits for an iteration start: the quiet step's or the re-plan's."""
        return self.due or self.quiet_next

    @property
    def overdue(self) -> bool:
        """No iteration start came in OVERDUE_SYNCS grad syncs past the warm-up ([Note: auto
        bucket re-plan in a torch-style loop])."""
        warmup = self.config.auto_bucket_warmup_steps
        return not self.replanned and self.syncs >= warmup + OVERDUE_SYNCS

    def give_up(self, rank: int) -> None:
        """Keep the plan that ran for good: hooks removed, nothing measured any more, a warning."""
        self.close()
        self.replanned, self.kept = True, True
        self.timeline = Timeline(self.device)  # drop the warm-up's events
        self.summary = "kept the default boundaries: no iteration start to re-plan at"
        warnings.warn(
            f'megabuf: bucket_size="auto" found no iteration start to re-plan at in '
            f"{self.syncs} grad syncs (warm-up: {self.config.auto_bucket_warmup_steps}; rank "
            f"{rank}), so the default buckets stay. It re-plans in model.zero_grad_buffer() or "
            "model.zero_grad() called outside no_sync(), or at a forward outside no_sync() "
            "after optimizer.zero_grad() set every .grad to None on every rank. Call "
            "model.zero_grad() at the start of each iteration, or give an int bucket_size",
            stacklevel=4,
        )

    @property
    def due(self) -> bool:
        """True once `auto_bucket_warmup_steps` grad syncs were seen and the re-plan has not
        run yet (no device sync)."""
        return not self.replanned and self.syncs >= self.config.auto_bucket_warmup_steps

    @property
    def quiet_next(self) -> bool:
        """The step about to start is the quiet one: the last warm-up step, of at least 3
        ([Note: quiet step] in warmup.py)."""
        warmup = self.config.auto_bucket_warmup_steps
        due = warmup >= 3 and self.syncs == warmup - 1
        return due and self.quiet_allowed and not self.replanned

    def begin_quiet(self) -> None:
        """Mark the quiet step (once, however often `zero_grad_buffer()` runs before it)."""
        if self._quiet_marked != self.syncs:
            self._quiet_marked = self.syncs
            self.timeline.record(-1, QUIET)

    @property
    def predicted_exposed_s(self) -> float | None:
        """After the re-plan: the model's exposed time of the chosen plan (the largest over
        the buffers; buffers reduced on one chain queue behind each other, so this is a lower
        bound when there are several), for the bench's model check."""
        if not self.replanned:
            return None
        if self.at_end:  # one after the other, after backward
            return sum(c.predicted_exposed_s for c in self.choices)
        return max((c.predicted_exposed_s for c in self.choices), default=0.0)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def measure(self, grad_dtype: torch.dtype) -> Measurement:
        """This rank's numbers: the warm-up's ready times and a probe of the collective
        (collective over the dp group)."""
        model = probe_collective(self.collectives, self.group, self.device, grad_dtype)
        return measured(self.timeline.events, len(self.trainable), model)

    def replan(
        self, plan: Plan, *, dp_size: int, expt_dp_size: int, expert_shares_dp_group: bool
    ) -> Plan:
        """Measure, agree and choose (collective over the dp group); the new plan."""
        self.close()
        self.replanned = True
        grad_dtype = plan.buffers[0].grad_dtype if plan.buffers else torch.float32
        specs = param_specs(self.trainable)
        numels = [s.numel for s in specs]
        if dp_size == 1:  # [Note: auto bucket plan at dp 1]
            nothing = Measurement(tuple(0.0 for _ in specs), CollectiveModel(0.0, 0.0), 0)
            self._current = current_choices(plan, numels, nothing)
            self.keep("a dp group of one rank has nothing to overlap", warn=False)
            return plan
        agreed = agree(self.measure(grad_dtype), self.collectives, self.group, self.device)
        agreed = calibrated(plan, numels, agreed)
        self.choices = choose_buckets(plan, numels, [s.own_bucket for s in specs], agreed)
        current = current_choices(plan, numels, agreed)
        backward_s = -min(agreed.ready_s, default=0.0)
        self._current = current
        self.kept = not worth_changing(self.choices, current, backward_s)
        if self.kept:
            self.choices = current
        if self.quiet_allowed and agreed.quiet_backward_s > 0:
            self._weigh_end(plan, numels, [s.own_bucket for s in specs], agreed, current)
        new_plan = build_plan(
            specs, self.config, dp_size=dp_size, expt_dp_size=expt_dp_size,
            expert_shares_dp_group=expert_shares_dp_group, unit_of_param=plan.unit_of_spec,
            bucket_ends=[ends_of(c) for c in self.choices],
        )  # fmt: skip
        self.summary = describe(self.choices, agreed, self.kept, self.comparison, self.at_end)
        logger.info("megabuf: %s", self.summary)
        return new_plan

    def _weigh_end(
        self, plan: Plan, numels: Sequence[int], own: Sequence[bool], agreed: Measurement,
        current: Sequence[BucketChoice],
    ) -> None:  # fmt: skip
        """Overlapped (the choice so far) or each buffer reduced after backward: [Note: quiet
        step] in warmup.py."""
        end = at_end(plan, numels, own, agreed)
        worst = max((c.predicted_exposed_s for c in self.choices), default=0.0)
        end_exposed = sum(c.predicted_exposed_s for c in end)
        overlapped_s = agreed.backward_s + worst
        end_s = agreed.quiet_backward_s + end_exposed
        self.at_end = reduce_at_end(overlapped_s, end_s, agreed.backward_s)
        ms = [1e3 * x for x in (agreed.backward_s, worst, agreed.quiet_backward_s, end_exposed)]
        self.comparison = (
            f"overlapped: backward {ms[0]:.1f} ms + predicted exposed {ms[1]:.1f} ms; reduced "
            f"after backward: quiet backward {ms[2]:.1f} ms + predicted {ms[3]:.1f} ms -> "
            + ("reduce each buffer after backward" if self.at_end else "overlap")
        )
        if self.at_end:
            self.choices = end
            self.kept = [c.param_counts for c in end] == [c.param_counts for c in current]

    def keep(self, reason: str, *, warn: bool = True) -> None:
        """The plan that ran stays (logged with `reason`; a warning where it was not chosen)."""
        self.kept, self.choices = True, self._current
        self.summary = f"kept the boundaries that ran: {reason}"
        (logger.warning if warn else logger.info)("megabuf: bucket_size=auto %s", self.summary)


def _remove_all(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()


def describe(
    choices: Sequence[BucketChoice], measurement: Measurement, kept: bool, comparison: str = "",
    at_end: bool = False,
) -> str:  # fmt: skip
    """One line per buffer of the chosen plan (logged at the re-plan)."""
    m = measurement.model
    why = "already as few as the layout allows" if at_end else (
        "more buckets for less than MIN_GAIN of backward")  # fmt: skip
    head = f"kept the boundaries that ran ({why}): " if kept else ""
    head += (
        f"bucket_size=auto re-planned from {measurement.steps} measured steps, all-reduce "
        f"latency {1e6 * m.latency_s:.1f} us, {1e-9 / max(m.seconds_per_byte, 1e-30):.3g} GB/s"
        f" (the probe slowed {measurement.slowdown:.3g}x to the {1e3 * measurement.exposed_s:.3f}"
        " ms exposed measured with the default plan)"
    )
    ends = format_bucket_ends([ends_of(c) for c in choices])
    show = f"megabuf inspect <model> --set bucket_size=auto --bucket-ends '{ends}'"
    lines = [head, f"  show it: {show}"] + ([f"  quiet step: {comparison}"] if comparison else [])
    for b, c in enumerate(choices):
        lines.append(
            f"  buffer {b}: {len(c.param_counts)} buckets of {list(c.bucket_numels)} elements, "
            f"predicted exposed {1e3 * c.predicted_exposed_s:.3f} ms"
        )
    return "\n".join(lines)
