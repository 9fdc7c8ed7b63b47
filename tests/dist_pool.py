"""One small spawn helper for multi-process tests: a pool of real gloo ranks, started once.

`DistPool(world_size).run(fn, *args)` runs the module-level function `fn(*args)` on every rank
(each rank already inside `init_process_group("gloo")`) and returns the per-rank results in rank
order. Process start-up (Python + torch import + gloo rendezvous, seconds on 2 cores) is paid once
per world size per test session, not once per case; the imports once per session ([Note:
preloaded workers]).

If any rank raises, `run` raises with that rank's traceback. If a case does not finish within
`timeout_s` (a hang: mismatched collectives), the pool is torn down and restarted on next use.

A sweep of cases runs in one `run` with `run_each` on the rank side: each case starts from the
same RNG seeds, and a case that raises becomes a `CaseFailure` (its traceback) while the other
cases still run. The test side turns one case's per-rank results back into values with
`case_result`, which fails that case's test with the rank's traceback. (A case that raises on some
ranks only leaves its peers in a collective: gloo's timeout or `timeout_s` then ends the sweep.)

[Note: clean worker state]
Workers live for the whole session, so a case must not see what an earlier one left behind:
- RNG: `run_each` reseeds before every case.
- Process groups: `ProcessGroups.build` makes new gloo groups on every call (never destroyed,
  each with its sockets and threads: a few per call, alive until the worker exits), so
  `moe_cases.groups` caches them per worker and cases reuse them. A group is thus shared by
  cases as WORLD is, and what a case leaves in flight on it is handled as below.
- Collectives in flight: a case that raised may leave an async collective (or a send) issued on
  some ranks only, which would pair with the next case's first collective on the same group and
  hand it wrong data or hang it. So after a case fails on *some* ranks but not all (agreed over a
  control group of its own, created at start-up, that no case uses), `run_each` runs no further
  case in that sweep (they become `CaseFailure`s saying so). A case that failed on every rank
  (an assertion or a named error, the usual failure) leaves no peer inside a collective, so the
  sweep goes on and one failing case hides no other. After a `run` in which any rank raised or
  any case failed, the pool is restarted before the next `run`.
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

# [Note: preloaded workers]
# Workers are forked from a forkserver that imported torch and megabuf once, not spawned: a pool
# (re)start then costs the gloo rendezvous, not an interpreter and a torch import per rank
# (~10 s on 2 loaded cores, paid again after every run in which a rank raised). The server
# imports modules only: it runs no tensor op (no intra-op thread pool to fork) and never touches
# CUDA, so a worker still reads CUDA_LAUNCH_BLOCKING at its first CUDA call and an "nccl" pool
# still binds its device itself; what a worker sees is otherwise what a spawned one saw, except
# that its environment is the test process's when the server started (the session's first pool)
# plus the pool's `env`, the one way a test hands its workers variables.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "megabuf"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    env: dict[str, str],
    inbox: Any,
    outbox: Any,
) -> None:
    os.environ.update(env)  # before the first CUDA call, which reads CUDA_LAUNCH_BLOCKING
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    global _CONTROL
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60)
        )
        _CONTROL = dist.new_group(backend="gloo")  # see [Note: clean worker state]
    except BaseException:  # the parent starts again on another port if it was taken
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, _READY))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, True, fn(*args)))
        except BaseException:  # report everything to the parent
            outbox.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


_CONTROL: Any = None  # rank side: a gloo group over all ranks that no case uses
_READY = "ready"  # a worker's first message: its process group is up
PORT_ATTEMPTS = 3  # as megabuf.testing.spawn ([Note: a port taken before rank 0 binds it])


def _any_rank_failed(failed: bool) -> list[int]:
    """Rank side: the ranks on which the last case failed, agreed over the control group."""
    import torch
    import torch.distributed as dist

    if _CONTROL is None:  # not in a pool worker: only this rank's own outcome is known
        return [dist.get_rank()] if failed else []
    flags = torch.zeros(dist.get_world_size(_CONTROL))
    flags[dist.get_rank(_CONTROL)] = float(failed)
    dist.all_reduce(flags, group=_CONTROL)
    return [r for r, f in enumerate(flags.tolist()) if f]


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


class DistPool:
    """`backend` "nccl" binds rank r to cuda:r; "gloo" ranks share cuda:0 if a case asks for CUDA.
    `env` is added to every rank's environment (e.g. CUDA_LAUNCH_BLOCKING=1)."""

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 120.0,
        backend: str = "gloo",
        env: dict[str, str] | None = None,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.env = dict(env or {})
        self.timeout_s = timeout_s
        self._procs: list[Any] = []

    def _start(self) -> None:
        """Start the ranks and wait until every process group is up. A port that was free when
        chosen but taken before rank 0's store bound it (EADDRINUSE) starts the pool again on
        another, PORT_ATTEMPTS times in all ([Note: a port taken before rank 0 binds it] in
        megabuf/testing/launch.py)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._spawn(_free_port())
            failure = self._wait_ready()
            if failure is None:
                return
            self.close()
            if "EADDRINUSE" not in failure or attempt == PORT_ATTEMPTS:
                raise RuntimeError(f"the {self.world_size}-rank pool did not start:\n{failure}")

    def _wait_ready(self) -> str | None:
        """None once every rank reported its process group up; else the first failure."""
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout_s)
            except queue.Empty:
                return f"no rank reported within {self.timeout_s}s"
            if not ok:
                return f"rank {rank}: {value}"
        return None

    def _spawn(self, port: int) -> None:
        self._inboxes = [_CTX.Queue() for _ in range(self.world_size)]
        self._outbox = _CTX.Queue()
        self._procs = [
            _CTX.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    port,
                    self.backend,
                    self.env,
                    self._inboxes[r],
                    self._outbox,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for inbox in self._inboxes:
            inbox.put((fn, args))
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        for _ in range(self.world_size):
            # once a rank has failed, its peers may be stuck in a collective: wait less
            timeout = 15.0 if failures else self.timeout_s
            try:
                rank, ok, value = self._outbox.get(timeout=timeout)
            except queue.Empty:
                self.close()
                if failures:
                    break
                raise TimeoutError(
                    f"{fn.__name__} did not finish on all {self.world_size} ranks within "
                    f"{self.timeout_s}s (finished: {sorted(results) + sorted(failures)})"
                ) from None
            (results if ok else failures)[rank] = value
        if failures:
            self.close()  # [Note: clean worker state]: collectives may be left in flight
            rank = min(failures)
            raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{failures[rank]}")
        if any(_has_case_failure(v) for v in results.values()):
            self.close()
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []


@dataclass(frozen=True)
class CaseFailure:
    """What `run_each` returns for a case that raised on this rank."""

    traceback: str


def reset_rng(seed: int = 0) -> None:
    """Every case starts from the same global RNG state, whatever ran before it in this worker."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)


def _has_case_failure(result: Any) -> bool:
    return isinstance(result, dict) and any(isinstance(v, CaseFailure) for v in result.values())


def run_each(cases: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    """Rank side of a sweep: `{name: (fn, *args)}` -> `{name: fn(*args) or a CaseFailure}`.

    After a case that failed on some ranks but not all, the rest are not run ([Note: clean worker
    state])."""
    out: dict[str, Any] = {}
    for name, (fn, *args) in cases.items():
        reset_rng()
        try:
            out[name] = fn(*args)
        except Exception:  # one case's error must not hide the others'
            out[name] = CaseFailure(traceback.format_exc())
        failed_ranks = _any_rank_failed(isinstance(out[name], CaseFailure))
        if failed_ranks and len(failed_ranks) < _world_size():
            skipped = CaseFailure(
                f"not run: case {name!r} failed on ranks {failed_ranks} earlier in this sweep and "
                "may have left collectives in flight that would pair with this case's"
            )
            return out | {later: skipped for later in cases if later not in out}
    return out


def case_result(per_rank: list[dict[str, Any]], name: str) -> list[Any]:
    """Test side: one case's results in rank order; fails the test if the case raised anywhere."""
    failed = [r for r, results in enumerate(per_rank) if isinstance(results[name], CaseFailure)]
    if failed:
        import pytest

        detail = per_rank[failed[0]][name].traceback
        pytest.fail(f"case {name} raised on ranks {failed}; rank {failed[0]}:\n{detail}", False)
    return [results[name] for results in per_rank]
