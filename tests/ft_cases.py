"""Launching replica groups under megabuf.ft for tests/test_ft.py, and the reference they must
equal.

[Note: ft test reference]
Each group runs tests/ft_worker.py, one process per group rank, as its own gloo world; the
lighthouse runs in this (the test's) process, one per strategy so that a restarted group joins
the strategy it died in. Every group's model starts from the same seed and every rank's batch
depends only on (committed step, group rank), so every participating group contributes the
same first-level grad g (the group mean: sum over group ranks of grad / S). The Manager then sums
n identical tensors and divides by n, the contributing groups of that step, which is not
exactly g in floating point (3g / 3 may differ from g in its last bit).
Every run, killed ones included, appends
(strategy, step, participants, committed) per step to a record file; every group that committed
step s saw the same count n_s. The reference (`reference` in tests/ft_fake_cases.py) replays
steps 0..last in one process: per-rank grads of the same module and batches, pre-scaled by 1/S
and summed in rank order, then multiplied by n_s and divided by n_s (an n-fold sum of identical
values is their product, bitwise), then torch's SGD with momentum on the whole params, as the
megabuf optimizer does on its shards (pointwise, so the same bits). Voted-down steps change
nothing and are not replayed. At the end every group's params and main params must equal each
other's, and group 0's params the reference's, bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import megabuf

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "ft_worker.py"
# where the megabuf under test lives (a mutant's copy under tests/mutants.py), for the workers
MEGABUF_ROOT = Path(megabuf.__file__).resolve().parents[1]
KILLED = 17


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Scenario:
    groups: int
    size: int
    strategies: list[str]
    steps: int = 4
    kills: list[dict[str, Any]] = field(default_factory=list)
    stalls: list[dict[str, Any]] = field(default_factory=list)
    timeout_s: float = 6.0
    quorum_timeout_s: float = 20.0
    run_s: float = 400.0
    bucket_size: int | str = 40


@dataclass
class GroupRun:
    group: int
    restarts: int
    procs: list[subprocess.Popen[bytes]]
    outs: list[Path]
    logs: list[Path]


def _spawn(sc: Scenario, lighthouses: dict[str, str], group: int, restarts: int,
           strategies: list[str], tmp: Path, go: Path | None = None) -> GroupRun:  # fmt: skip
    """One group's processes; with `go`, a standby that imports now and starts when `go`
    exists (a restart then costs no interpreter start-up)."""
    port = _free_port()
    procs, outs, logs = [], [], []
    for rank in range(sc.size):
        out = tmp / f"g{group}_r{rank}_{restarts}.pt"
        log = tmp / f"g{group}_r{rank}_{restarts}.log"
        spec = {
            "group": group, "rank": rank, "size": sc.size, "port": port, "groups": sc.groups,
            "lighthouses": lighthouses, "strategies": strategies, "steps": sc.steps,
            "kills": sc.kills, "restarts": restarts, "timeout_s": sc.timeout_s,
            "quorum_timeout_s": sc.quorum_timeout_s, "run_s": sc.run_s, "out": str(out),
            "bucket_size": sc.bucket_size, "stalls": sc.stalls, "barrier": str(tmp / "ready"),
            "go": str(go) if go is not None else None,
            "record": str(tmp / f"rec_g{group}_r{rank}_{restarts}.jsonl"),
        }  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(MEGABUF_ROOT), "OMP_NUM_THREADS": "1",
               "RUST_LOG": "error"}  # fmt: skip
        with open(log, "wb") as f:
            procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)],
                                          stdout=f, stderr=subprocess.STDOUT, env=env))  # fmt: skip
        outs.append(out)
        logs.append(log)
    return GroupRun(group, restarts, procs, outs, logs)


def _kill(run: GroupRun) -> None:
    for p in run.procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def _tail(run: GroupRun) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in run.logs)


def run_scenario(sc: Scenario, deadline_s: float = 110.0) -> dict[int, list[Any]]:
    """Run `sc` to its end, restarting each killed group (all its ranks) once per kill; every
    wait is bounded by `deadline_s` (a hang fails the test). Per group, per rank, the worker's
    results (tests/ft_worker.py); under key -1, every step's record of every run."""
    from torchft.coordination import LighthouseServer

    lighthouses = {
        s: LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=300,
                            quorum_tick_ms=20, heartbeat_timeout_ms=1500)
        for s in sc.strategies
    }  # fmt: skip
    addrs = {s: h.address() for s, h in lighthouses.items()}
    tmp = Path(tempfile.mkdtemp(prefix="megabuf-ft-"))
    (tmp / "ready").mkdir()
    runs = {g: _spawn(sc, addrs, g, 0, sc.strategies, tmp) for g in range(sc.groups)}
    chains: dict[int, list[GroupRun]] = {}  # every planned restart, importing from the start
    for g in range(sc.groups):
        chains[g], restarts = [], 0
        while (died_in := _died_in(sc, g, restarts)) is not None:
            rest = sc.strategies[sc.strategies.index(died_in) :]
            go = tmp / f"go_g{g}_{restarts + 1}"
            chains[g].append(_spawn(sc, addrs, g, restarts + 1, rest, tmp, go))
            restarts += 1
    end = time.monotonic() + deadline_s
    try:
        while any(p.poll() is None for r in runs.values() for p in r.procs):
            if time.monotonic() > end:
                raise TimeoutError("megabuf.ft scenario hung:\n" + "\n".join(
                    _tail(r) for r in runs.values()))  # fmt: skip
            for g, run in list(runs.items()):
                codes = [p.poll() for p in run.procs]
                if any(c not in (None, 0) for c in codes):
                    if KILLED not in codes or not chains[g]:
                        raise RuntimeError(f"group {g} failed:\n" + _tail(run))
                    _kill(run)  # the group's other ranks too: a group lives or dies whole
                    runs[g] = chains[g].pop(0)
                    (tmp / f"go_g{g}_{runs[g].restarts}").touch()
            time.sleep(0.05)
        results: dict[int, list[Any]] = {}
        for g, run in runs.items():
            for p in run.procs:
                if p.returncode != 0:
                    raise RuntimeError(f"group {g} failed:\n" + _tail(run))
            results[g] = [_outputs(tmp, g, r, sc.strategies) for r in range(sc.size)]
        results[-1] = [_records(tmp)]
        return results
    finally:
        for run in [*runs.values(), *(r for c in chains.values() for r in c)]:
            _kill(run)
        for h in lighthouses.values():
            h.shutdown()


def _outputs(tmp: Path, group: int, rank: int, strategies: list[str]) -> dict[str, Any]:
    """Per strategy, what the group rank's last run through it saved (a killed run keeps the
    strategies it finished before it died)."""
    out = {}
    for strategy in strategies:
        saved = sorted(tmp.glob(f"g{group}_r{rank}_*.pt.{strategy}"))
        if saved:
            out[strategy] = torch.load(saved[-1], weights_only=False)
    return out


def _records(tmp: Path) -> list[tuple[str, int, int, bool]]:
    """Every step of every run (killed ones included): (strategy, step, participants, ok)."""
    rows = []
    for path in sorted(tmp.glob("rec_*.jsonl")):
        rows += [tuple(json.loads(line)) for line in path.read_text().splitlines() if line]
    return rows  # type: ignore[return-value]


def _died_in(sc: Scenario, group: int, restarts: int) -> str | None:
    """The strategy a planned kill of `group`'s run number `restarts` happens in, if any."""
    for kill in sc.kills:
        if kill["group"] == group and kill.get("restarts", 0) == restarts:
            return str(kill["strategy"])
    return None
