"""The runner of programs beside the suite ([Note: background jobs] in background_jobs.py): a
queued job's output and exit status come back whole, a job past its timeout is killed with its
process group, and one queued while a test had changed the environment does not see it."""

from __future__ import annotations

import os
import sys
import time

from background_jobs import Job, Runner

PY = sys.executable


def test_a_queued_job_returns_its_exit_status_and_output() -> None:
    runner = Runner(workers=1)
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    job = Job("t", (PY, "-c", code), 60)
    runner.start([job])
    done = runner.result(job)
    runner.close()
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    assert not done.timed_out


def test_a_job_past_its_timeout_is_killed_with_its_children() -> None:
    # the child's own child holds the pipes: only killing the group ends the wait
    sleeper = "import time; time.sleep(60)"
    script = f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {sleeper!r}])"
    began = time.monotonic()
    done = Runner(workers=0).result(Job("t", (PY, "-c", script + "\ntime.sleep(60)"), 1.0))
    assert done.timed_out and time.monotonic() - began < 30


def test_queued_jobs_get_the_environment_of_the_session_start() -> None:
    runner = Runner(workers=1)
    job = Job("t", (PY, "-c", "import os; print(os.environ.get('RANK'))"), 60)
    os.environ.pop("RANK", None)
    runner.start([])  # the session starts: its environment is kept
    os.environ["RANK"] = "0"  # as a test's monkeypatch.setenv would
    try:
        runner.start([job])
        assert runner.result(job).stdout == "None\n"
    finally:
        del os.environ["RANK"]
        runner.close()
