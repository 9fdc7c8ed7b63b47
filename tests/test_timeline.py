"""The timeline's clocks (pure: no processes, no GPU): the host path records perf_counter at each
call; a device clock's marks stay pending until `events` is read and are then resolved as
anchor + elapsed time, in record order ([Note: timeline on CUDA]). Made-up elapsed times go
through the same `resolve_marks` arithmetic the CUDA clock uses."""

from __future__ import annotations

import time
from collections.abc import Sequence

import pytest

from megabuf.buckets.bucket_group import Timeline as FromBucketGroup
from megabuf.pure.overlap import analyze
from megabuf.pure.timeline import Event, PendingMark, Timeline, resolve_marks


class FakeClock:
    """Marks are ints; `elapsed_ms[i]` is mark i's device time after the reference."""

    def __init__(self, elapsed_ms: Sequence[float], anchor_s: float) -> None:
        self.elapsed_ms = list(elapsed_ms)
        self.anchor_s = anchor_s
        self.marks = 0
        self.resolves = 0

    def mark(self) -> int:
        self.marks += 1
        return self.marks - 1

    def resolve(self, pending: Sequence[PendingMark]) -> list[Event]:
        self.resolves += 1
        return resolve_marks(self.anchor_s, pending, lambda i: self.elapsed_ms[i])


def test_resolve_marks_is_anchor_plus_elapsed_in_record_order() -> None:
    pending: list[PendingMark] = [(0, "ready", "a"), (-1, "backward_end", "b"), (0, "finish", "c")]
    ms = {"a": 2.0, "b": 1.5, "c": 250.0}  # out of time order on purpose: order is record order
    events = resolve_marks(100.0, pending, ms.__getitem__)
    assert [(g, n) for g, n, _ in events] == [(0, "ready"), (-1, "backward_end"), (0, "finish")]
    assert [t for _, _, t in events] == pytest.approx([100.002, 100.0015, 100.25])
    assert resolve_marks(5.0, [], ms.__getitem__) == []


def test_host_timeline_records_perf_counter_at_each_call() -> None:
    assert FromBucketGroup is Timeline  # bucket_group and ddp keep importing it from there
    for device in (None, "cpu"):
        timeline = Timeline(device)
        assert not timeline.on_device
        before = time.perf_counter()
        timeline.record(3, "dispatch")
        timeline.record(3, "finish")
        after = time.perf_counter()
        events = timeline.events
        assert [(g, n) for g, n, _ in events] == [(3, "dispatch"), (3, "finish")]
        assert before <= events[0][2] <= events[1][2] <= after


def test_device_marks_stay_pending_until_read_then_resolve_once() -> None:
    clock = FakeClock([1.0, 4.0, 9.0, 30.0, 31.0], anchor_s=7.0)
    timeline = Timeline(clock=clock)
    assert timeline.on_device
    timeline.record(0, "ready")
    timeline.record(0, "dispatch")
    assert clock.marks == 2 and clock.resolves == 0  # nothing waits inside the step
    first = timeline.events
    assert clock.resolves == 1
    assert [(g, n) for g, n, _ in first] == [(0, "ready"), (0, "dispatch")]
    assert [t for *_, t in first] == pytest.approx([7.001, 7.004])
    for name in ("backward_end", "finish"):
        timeline.record(-1 if name == "backward_end" else 0, name)
    again = timeline.events
    assert clock.resolves == 2 and len(again) == 4  # earlier events kept, new ones appended
    assert [t for *_, t in again[2:]] == pytest.approx([7.009, 7.030])
    assert timeline.events == again and clock.resolves == 2  # nothing pending: no wait


def _record_step(timeline: Timeline, overlapped: bool) -> None:
    names: list[tuple[int, str]] = [(0, "ready"), (0, "dispatch")] if overlapped else []
    names += [(-1, "backward_end")] + ([] if overlapped else [(0, "dispatch")]) + [(0, "finish")]
    for group_id, name in names:
        timeline.record(group_id, name)


def _device_times(overlapped: bool, t0: float) -> list[float]:
    # device ms: comm takes 20 ms from dispatch; backward ends at t0 + 30
    if overlapped:  # dispatched at t0 + 5, done at t0 + 25, usable once backward ends
        return [t0 + 5.0, t0 + 5.0, t0 + 30.0, t0 + 30.0]
    return [t0 + 30.0, t0 + 30.0, t0 + 50.0]  # all of it after backward


@pytest.mark.parametrize("overlapped,exposed_ms", [(False, 20.0), (True, 0.0)])
def test_resolved_device_times_feed_the_overlap_report(overlapped: bool, exposed_ms: float) -> None:
    times: list[float] = []
    for step in range(3):
        times += _device_times(overlapped, 100.0 * step)
    timeline = Timeline(clock=FakeClock(times, anchor_s=50.0))
    for _ in range(3):
        _record_step(timeline, overlapped)
    report = analyze(timeline.events)
    assert len(report.steps) == 3
    assert report.median_exposed_s == pytest.approx(exposed_ms / 1e3)
    assert report.median_overlap_window_s == pytest.approx(0.025 if overlapped else 0.0)
