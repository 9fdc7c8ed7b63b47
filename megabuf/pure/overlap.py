"""The overlap report: how much gradient communication was hidden behind backward, per step.

Input is the event list of a `Timeline` (see `DistributedDataParallel.enable_timeline`):
`(group_id, event, perf_counter seconds)` with events "ready" (every grad of the bucket group is
in), "dispatch" (its collectives were issued), "finish" (`finish_grad_sync` saw them complete) and
one "backward_end" marker (group id -1) when `finish_grad_sync()` starts. Other events (e.g. phase
markers a benchmark adds) are ignored. Everything here is pure arithmetic on those timestamps.

[Note: what the overlap report measures]
- exposed communication = last "finish" - "backward_end": time after backward during which the
  step waited for (or, without overlap, ran) gradient communication. This is the cost overlap
  tries to remove.
- overlap window = "backward_end" - first "dispatch" (0 if nothing was dispatched before
  backward ended): how long communication was outstanding while backward still computed. It is
  an upper bound of the hidden communication time (a collective may finish early inside it).
- dispatch delay = "dispatch" - "ready" per group: "dispatch" is recorded once the collectives
  were issued, so this is the dispatch cost on the backward thread (scaling the bucket by
  1/dp_size, issuing the collectives) plus any wait for an earlier group in the dispatch chain
  (see [Note: dispatch order] in bucket_group.py).
A step is the events from its first "ready"/"dispatch" (or its "backward_end") up to the last
"finish" before the next step's "ready" or "backward_end". A "replan" event (bucket_size="auto",
[Note: auto bucket re-plan] in autobucket.py) marks where the bucket plan changed: the report
says before which step, so per-step figures on both plans are not read as one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from megabuf.pure.timeline import Event  # (group_id, event name, seconds)

GROUP_EVENTS = ("ready", "dispatch", "finish")
BACKWARD_END = "backward_end"
REPLAN = "replan"


@dataclass(frozen=True)
class GroupTimes:
    """One bucket group in one step; seconds relative to that step's backward end."""

    group_id: int
    ready_s: float | None  # None when never marked ready (no overlap, or inside no_sync)
    dispatch_s: float
    finish_s: float

    @property
    def dispatch_delay_s(self) -> float:
        return 0.0 if self.ready_s is None else max(0.0, self.dispatch_s - self.ready_s)


@dataclass(frozen=True)
class StepOverlap:
    """Overlap figures of one step; see [Note: what the overlap report measures]."""

    backward_end: float  # perf_counter seconds
    groups: tuple[GroupTimes, ...]  # in dispatch order

    @property
    def exposed_s(self) -> float:
        return max((max(0.0, g.finish_s) for g in self.groups), default=0.0)

    @property
    def overlap_window_s(self) -> float:
        first = min((g.dispatch_s for g in self.groups), default=0.0)
        return max(0.0, -first)

    @property
    def dispatched_before_backward_end(self) -> int:
        return sum(1 for g in self.groups if g.dispatch_s < 0.0)

    @property
    def dispatch_delay_s(self) -> float:
        return sum(g.dispatch_delay_s for g in self.groups)


def split_steps(events: Sequence[Event]) -> list[list[Event]]:
    """Cut an event list into steps (see the module docstring); unknown events are dropped."""
    steps: list[list[Event]] = []
    current: list[Event] = []
    after_backward = False
    for event in events:
        name = event[1]
        if name not in GROUP_EVENTS and name != BACKWARD_END:
            continue
        if after_backward and name in ("ready", BACKWARD_END):
            steps.append(current)
            current, after_backward = [], False
        current.append(event)
        after_backward = after_backward or name == BACKWARD_END
    if current and after_backward:
        steps.append(current)
    return steps


def analyze_step(events: Sequence[Event]) -> StepOverlap:
    """Figures of one step's events (as returned by `split_steps`)."""
    ends = [t for _, name, t in events if name == BACKWARD_END]
    if len(ends) != 1:
        raise ValueError(f"megabuf: a step needs exactly one backward_end event, got {len(ends)}")
    end = ends[0]
    seen: dict[int, dict[str, float]] = {}
    for group_id, name, t in events:
        if name in GROUP_EVENTS:
            seen.setdefault(group_id, {})[name] = t - end
    groups = []
    for group_id, times in seen.items():
        missing = [n for n in ("dispatch", "finish") if n not in times]
        if missing:
            raise ValueError(f"megabuf: bucket group {group_id} has no {missing} event in a step")
        groups.append(GroupTimes(group_id, times.get("ready"), times["dispatch"], times["finish"]))
    groups.sort(key=lambda g: g.dispatch_s)
    return StepOverlap(end, tuple(groups))


@dataclass(frozen=True)
class OverlapReport:
    """Per-step overlap figures and their medians."""

    steps: tuple[StepOverlap, ...]
    replanned_before_step: int | None = None  # index in `steps` of the first on the new plan

    def _median(self, values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    @property
    def median_exposed_s(self) -> float:
        return self._median([s.exposed_s for s in self.steps])

    @property
    def median_overlap_window_s(self) -> float:
        return self._median([s.overlap_window_s for s in self.steps])

    @property
    def median_dispatch_delay_s(self) -> float:
        return self._median([s.dispatch_delay_s for s in self.steps])

    def to_dict(self) -> dict[str, float | int]:
        groups = len(self.steps[-1].groups) if self.steps else 0
        early = self._median([float(s.dispatched_before_backward_end) for s in self.steps])
        return {
            "steps": len(self.steps),
            "bucket_groups": groups,
            "median_exposed_ms": 1e3 * self.median_exposed_s,
            "median_overlap_window_ms": 1e3 * self.median_overlap_window_s,
            "median_dispatch_delay_ms": 1e3 * self.median_dispatch_delay_s,
            "median_dispatched_before_backward_end": early,
            "replanned_before_step": -1
            if self.replanned_before_step is None
            else self.replanned_before_step,
        }

    def __str__(self) -> str:
        return self.format()

    def format(self) -> str:
        """A short human-readable summary (medians over steps, milliseconds); also `str()`."""
        if not self.steps:
            return "overlap report: no complete steps recorded"
        d = self.to_dict()
        lines = [
            f"overlap report: {d['steps']} steps, {d['bucket_groups']} bucket groups per step",
            f"  exposed communication after backward: {d['median_exposed_ms']:.2f} ms (median)",
            f"  communication outstanding during backward: {d['median_overlap_window_ms']:.2f} ms",
            f"  groups dispatched before backward ended: "
            f"{d['median_dispatched_before_backward_end']:g}/{d['bucket_groups']}",
            f"  ready -> dispatched (scaling, issuing, chain wait): "
            f"{d['median_dispatch_delay_ms']:.2f} ms",
            "  group  ready_ms  dispatch_ms  finish_ms   (last step, relative to backward end)",
        ]
        if self.replanned_before_step is not None:
            lines.insert(
                1,
                f"  buckets re-planned (bucket_size=auto) before step {self.replanned_before_step}"
                " of these; medians mix both plans, the table is the last step's",
            )
        for g in self.steps[-1].groups:
            ready = "-" if g.ready_s is None else f"{1e3 * g.ready_s:.2f}"
            dispatch, finish = 1e3 * g.dispatch_s, 1e3 * g.finish_s
            lines.append(f"  {g.group_id:5d}  {ready:>8}  {dispatch:11.2f}  {finish:9.2f}")
        return "\n".join(lines)


def analyze(events: Sequence[Event], *, skip_steps: int = 0) -> OverlapReport:
    """The report over every complete step after the first `skip_steps` (warm-up)."""
    steps = split_steps(events)
    replan = _replan_step(events, steps)
    if replan is not None:
        replan = max(0, replan - skip_steps)
    return OverlapReport(tuple(analyze_step(s) for s in steps[skip_steps:]), replan)


def _replan_step(events: Sequence[Event], steps: list[list[Event]]) -> int | None:
    """How many complete steps ended (their last event) before the first "replan" event."""
    at = next((t for _, name, t in events if name == REPLAN), None)
    if at is None:
        return None
    return sum(1 for step in steps if step[-1][2] <= at)
