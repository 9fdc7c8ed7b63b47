"""A finished job exits 0 (issue 48): every strategy, with and without overlap_param_gather,
each way a script ends (destroy_process_group() or not, the model dropped first, gathers in
flight) and each checkpoint mode (none, synchronous, asynchronous waited for or never waited
for), on 2 gloo ranks with the CPU loaded: exit status 0 and no `terminate called` on any
rank, and a save never waited for is committed at exit or, after destroy_process_group(),
reported as not committed by every rank. The runs live in tests/exit_runs.py (`make test-exit`
repeats them); here two runs go at a time besides the busy process, so each run's ranks share
the CPU with the other run's as well (about a third less wall time than one at a time), and the
matrix runs beside the rest of the suite ([Note: background jobs] in background_jobs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from background_jobs import Job, Runner
from exit_runs import CHECKPOINTS, ENDS, STRATEGIES, Outcome, Run, matrix

HERE = Path(__file__).resolve().parent


def test_the_matrix_covers_every_strategy_end_and_checkpoint() -> None:
    runs = matrix()
    assert {(r.strategy, r.overlap_param_gather, r.end) for r in runs} == {
        (s, o, e) for s, o in STRATEGIES for e in ENDS
    }
    assert {(r.strategy, r.overlap_param_gather, r.checkpoint) for r in runs} == {
        (s, o, c) for s, o in STRATEGIES for c in CHECKPOINTS
    }


def test_the_verdict_sees_each_way_to_end_badly() -> None:
    run = Run("optim", True, "sync", "publish_destroy")
    assert Outcome(run, (0, 0), ("", ""), True).ok
    assert not Outcome(run, (0, -6), ("", ""), True).ok  # SIGABRT
    assert not Outcome(run, (0, 0), ("", "terminate called without an active exception"), True).ok
    assert not Outcome(run, (0, 0), ("", ""), False).ok  # a lost checkpoint
    unwaited = Run("optim", True, "async_unwaited", "publish_destroy")
    said = "megabuf: ... was written but not committed ..."
    assert Outcome(unwaited, (0, 0), (said, said), False).ok
    assert not Outcome(unwaited, (0, 0), (said, ""), False).ok  # a rank kept quiet
    assert not Outcome(Run("optim", True, "async_unwaited", "no_destroy"), (0, 0), ("", ""),
                       False).ok  # fmt: skip


MATRIX = Job(
    "exit-status matrix",
    (sys.executable, str(HERE / "exit_runs.py"), "--load", "1", "--jobs", "2"),
    900,
)


@pytest.mark.background(MATRIX)
def test_every_run_of_the_matrix_exits_zero_under_load(background: Runner) -> None:
    done = background.result(MATRIX)  # [Note: background jobs]
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert f"{len(matrix())} passed, 0 failed" in done.stdout
