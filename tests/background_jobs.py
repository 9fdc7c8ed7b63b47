"""Subprocess checks that run beside the in-process suite, started when the session starts.

A test that runs a whole program (an example, the exit-status matrix) declares it as a `Job`, one
that starts fresh ranks by itself (`megabuf.testing.spawn`) as a `Call` of a module-level
function (run as a program too), and marks itself `@pytest.mark.background(job)` (or marks its
`pytest.param`). When the session starts, conftest.py hands every selected test's jobs to one
`Runner`, which runs them `BACKGROUND_WORKERS` at a time while the in-process tests run, and
moves the marked tests to the end of the session; each then calls `runner.result(job)` and
checks the finished program's output (a call's return value, or its exception raised again)
exactly as it checked what it ran itself.

[Note: background jobs]
The in-process suite leaves much of the 2 cores idle (a pool's ranks wait on each other, the
parent waits on the pool, pure tests use one core), and a job mostly starts interpreters and
trains small models: run side by side they fill each other's gaps, so the session costs less
than the two run one after the other. What a job checks does not change: the same argv,
environment, working directory and timeout, its output read back whole. A job's timeout counts
from when it starts; a job that a test asks for before it started (a test run by itself, or
`--collect-only` never starting anything) runs at once in the test. On the session's end every
job still running is killed with its process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

REPO = Path(__file__).resolve().parent.parent
# Jobs at a time beside the in-process suite; MEGABUF_TEST_BACKGROUND=0 runs each in its test.
BACKGROUND_WORKERS = int(os.environ.get("MEGABUF_TEST_BACKGROUND", "1"))


@dataclass(frozen=True)
class Job:
    """One program run: `argv` in `cwd` (the repository) with os.environ plus `env`."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    env: tuple[tuple[str, str], ...] = ()
    cwd: Path = REPO


@dataclass(frozen=True)
class Call:
    """`fn()` (a module-level function of a test module) in a process of its own, `python
    tests/background_jobs.py MODULE:NAME OUT`: in the test process it would share monkeypatched
    module state (`launch.free_port` in tests/test_spawn_results.py) with the tests beside it.
    Its return value comes back through `torch.save`, its exception as the traceback."""

    name: str
    fn: Callable[[], Any]
    timeout_s: float = 900.0

    def job(self, out: Path) -> Job:
        target = f"{self.fn.__module__}:{self.fn.__qualname__}"
        argv = (sys.executable, str(Path(__file__)), target, str(out))
        path = os.pathsep.join([str(Path(__file__).parent), str(REPO)])
        return Job(self.name, argv, self.timeout_s, (("PYTHONPATH", path),))


@dataclass(frozen=True)
class Finished:
    """A job's end: exit status (None: killed at its timeout), stdout, stderr, seconds run."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass
class Runner:
    """Runs jobs on `workers` threads, each job in a process group of its own."""

    workers: int = BACKGROUND_WORKERS
    _futures: dict[Job | Call, Future[Any]] = field(default_factory=dict)
    _procs: set[subprocess.Popen[str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor | None = None
    _closed: bool = False
    _environ: dict[str, str] | None = None  # os.environ when the session started

    def start(self, jobs: list[Job | Call]) -> None:
        """Queue `jobs` (each once), in order, unless background runs are off. Queued jobs get
        the environment of now, not of whatever test runs when they start (a test may have
        set RANK and WORLD_SIZE, which would make an example think it runs under torchrun)."""
        if self.workers < 1:
            return
        if self._environ is None:
            self._environ = dict(os.environ)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="background-job")
        for job in jobs:
            if job not in self._futures:
                self._futures[job] = self._pool.submit(self._run, job)

    @overload
    def result(self, job: Job) -> Finished: ...
    @overload
    def result(self, job: Call) -> Any: ...
    def result(self, job: Job | Call) -> Any:
        """The job's end (a call's value, or its exception raised here): waited for if it was
        queued, else run now."""
        future = self._futures.get(job)
        return future.result() if future is not None else self._run(job)

    def _run(self, job: Job | Call) -> Any:
        if isinstance(job, Call):
            return _called(job, self._run)
        began = time.monotonic()
        env = {**(self._environ or os.environ), **dict(job.env)}
        with self._lock:
            if self._closed:
                return Finished(None, "", "the session ended before this job started", 0.0)
            proc = subprocess.Popen(
                list(job.argv), cwd=job.cwd, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
            self._procs.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=job.timeout_s)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            stdout, stderr = proc.communicate()
            code = None
        finally:
            with self._lock:
                self._procs.discard(proc)
        return Finished(code, stdout, stderr, time.monotonic() - began)

    def close(self) -> None:
        """Kill what still runs, drop what has not started."""
        with self._lock:
            self._closed = True
            for proc in self._procs:
                _kill_group(proc)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
        os.killpg(proc.pid, signal.SIGKILL)


def _called(call: Call, run: Callable[[Job], Finished]) -> Any:
    """Run `call` as its job; its value, or RuntimeError with its traceback and output."""
    with tempfile.TemporaryDirectory(prefix="megabuf-call-") as tmp:
        out = Path(tmp) / "result.pt"
        done = run(call.job(out))
        if done.returncode == 0 and out.exists():
            import torch

            status, value = torch.load(out, weights_only=False)
            if status == "ok":
                return value
            raise RuntimeError(f"{call.name} raised:\n{value}")
        raise RuntimeError(
            f"{call.name}: exit status {done.returncode} (None: killed at its timeout)\n"
            + done.stdout[-3000:]
            + done.stderr[-3000:]
        )


def _main(target: str, out: str) -> None:
    """In the call's process: import `module:name`, call it, save ("ok", value) or ("error",
    traceback) to `out`."""
    import importlib

    import torch

    module, name = target.split(":")
    try:
        result: tuple[str, Any] = ("ok", getattr(importlib.import_module(module), name)())
    except BaseException:  # pytest's Failed too: its message is the test's
        result = ("error", traceback.format_exc())
    torch.save(result, out)


if __name__ == "__main__":
    _main(*sys.argv[1:])
