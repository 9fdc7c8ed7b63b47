"""The overlap report's arithmetic on synthetic timestamps (pure: no processes)."""

from __future__ import annotations

import pytest

from megabuf.pure.overlap import analyze, analyze_step, split_steps


def overlapped_step(t0: float) -> list[tuple[int, str, float]]:
    """Two groups dispatched during backward; backward ends at t0 + 10."""
    return [
        (-1, "forward_start", t0 - 5.0),  # unknown markers are ignored
        (0, "ready", t0 + 2.0),
        (0, "dispatch", t0 + 2.0),
        (1, "ready", t0 + 6.0),
        (1, "dispatch", t0 + 7.0),  # 1.0 between ready and dispatched
        (-1, "backward_end", t0 + 10.0),
        (0, "finish", t0 + 10.5),
        (1, "finish", t0 + 13.0),
    ]


def sync_step(t0: float) -> list[tuple[int, str, float]]:
    """No overlap: dispatch and finish inside finish_grad_sync, after backward."""
    return [
        (-1, "backward_end", t0),
        (0, "dispatch", t0 + 0.5),
        (0, "finish", t0 + 2.5),
        (1, "dispatch", t0 + 2.5),
        (1, "finish", t0 + 4.0),
    ]


def test_overlapped_step_figures() -> None:
    step = analyze_step(overlapped_step(100.0))
    assert step.backward_end == pytest.approx(110.0)
    assert [g.group_id for g in step.groups] == [0, 1]
    assert step.exposed_s == pytest.approx(3.0)
    assert step.overlap_window_s == pytest.approx(8.0)
    assert step.dispatched_before_backward_end == 2
    assert step.dispatch_delay_s == pytest.approx(1.0)
    assert step.groups[1].dispatch_s == pytest.approx(-3.0)
    assert step.groups[1].finish_s == pytest.approx(3.0)


def test_sync_step_exposes_everything() -> None:
    step = analyze_step(sync_step(50.0))
    assert step.exposed_s == pytest.approx(4.0)
    assert step.overlap_window_s == 0.0
    assert step.dispatched_before_backward_end == 0
    assert all(g.ready_s is None for g in step.groups)
    assert step.dispatch_delay_s == 0.0


def test_split_and_median_over_mixed_steps() -> None:
    events = overlapped_step(0.0) + sync_step(20.0) + overlapped_step(30.0)
    steps = split_steps(events)
    assert [len(s) for s in steps] == [7, 5, 7]  # the forward_start markers are dropped
    report = analyze(events)
    assert [s.exposed_s for s in report.steps] == pytest.approx([3.0, 4.0, 3.0])
    assert report.median_exposed_s == pytest.approx(3.0)
    assert report.median_overlap_window_s == pytest.approx(8.0)
    assert analyze(events, skip_steps=1).median_exposed_s == pytest.approx(3.5)
    d = report.to_dict()
    assert d["steps"] == 3 and d["bucket_groups"] == 2
    assert d["median_exposed_ms"] == pytest.approx(3000.0)
    text = report.format()
    assert "3 steps, 2 bucket groups" in text and "3000.00 ms" in text
    assert str(report) == text  # print(report) reads like the summary, not a dataclass repr


def test_incomplete_last_step_is_dropped_and_bad_steps_raise() -> None:
    events = [*sync_step(0.0), (0, "ready", 9.0), (0, "dispatch", 9.0)]  # backward still running
    assert len(analyze(events).steps) == 1
    with pytest.raises(ValueError, match="no \\['finish'\\] event"):
        analyze_step([(-1, "backward_end", 1.0), (0, "dispatch", 1.5)])
    with pytest.raises(ValueError, match="exactly one backward_end"):
        analyze_step([(0, "dispatch", 1.5), (0, "finish", 2.0)])
    assert analyze([]).format() == "overlap report: no complete steps recorded"
