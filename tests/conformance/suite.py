"""Runs selected tests of torch's own DDP suites, from the installed wheel, with ranks forked.

Two suites (test ids are `suite.Class.test_name`):
- `dist`: `DistributedTest._DistTestBase` of torch/testing/_internal/distributed/
  distributed_test.py, the class torch's test/distributed/test_distributed_spawn.py runs. Here on
  gloo, CPU, world size 2 (env BACKEND, WORLD_SIZE as that driver sets them).
- `rpc`: the DDP tests of ddp_under_dist_autograd_test.py, on the TensorPipe agent at the world
  sizes those classes fix themselves (4 trainers; 4 trainers + a remote worker + a master).

[Note: forked ranks]
torch's `MultiProcessTestCase` starts the ranks of each test with `spawn`: a fresh interpreter
that imports torch and the test module, several seconds per rank per test on 2 shared cores.
Here each test's ranks are forked from the runner process instead (`fork` context, the same
`_start_processes` torch uses), so they inherit the imports and the DDP binding
([Note: binding] in binding.py) and start in milliseconds. The runner never initialises a
process group, RPC or CUDA itself, so nothing that fork cannot copy is live when it forks.
Every test keeps torch's own bound: its ranks are killed after `per_test_timeout_s` (torch's
`get_timeout`, overridden here), and the test reads as `timeout`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import time
import unittest
from dataclasses import dataclass
from typing import Any

WORLD_SIZE = 2
DIST_CLASS = "DistributedTest"
RPC_CLASSES = ("DdpComparisonTest", "DdpUnderDistAutogradTest")
OUTCOMES = ("pass", "fail", "error", "timeout", "crash", "skip")


@dataclass(frozen=True)
class Outcome:
    """What one selected test did: `outcome` is one of OUTCOMES; `exception` the type name of
    the rank's exception (AssertionError for `fail`), empty otherwise; `message` its first line."""

    test_id: str
    outcome: str
    exception: str = ""
    message: str = ""
    seconds: float = 0.0
    ddp_built: bool | None = None  # only known under the torch-probe binding


def prepare_environment(per_test_timeout_s: int) -> None:
    """What torch's test modules read when they are imported; call before importing them."""
    # Set, not defaulted: a WORLD_SIZE left in the environment (torchrun, a test) must not
    # change the selection's conditions.
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(WORLD_SIZE))
    # INIT_METHOD unset: distributed_test.py reads it at import as "env://", one of the two
    # settings torch's own CI runs (ranks still rendezvous through a file, TestDistBackend's).
    os.environ.pop("INIT_METHOD", None)
    # TEMP_DIR (barrier files) is set per test by torch's TestDistBackend.setUp.
    os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"] = str(per_test_timeout_s)
    # CPU only: with fewer visible GPUs than ranks, torch's driver skips every test
    # (TestDistBackend._run), and forked ranks must not inherit a CUDA context.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def build_classes(per_test_timeout_s: int, probe_dir: str | None) -> dict[str, type]:
    """The runnable unittest classes by suite-qualified class name ("dist.DistributedTest", ...)."""
    import torch.multiprocessing
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed import ddp_under_dist_autograd_test as rpc_tests
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )
    from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
        TensorPipeRpcAgentTestFixture,
    )

    # the rpc suite logs every grad dict at INFO
    logging.getLogger(rpc_tests.__name__).setLevel(logging.WARNING)
    # torch's per-test bounds (500 s for test_DistributedDataParallel...) become ours.
    for name in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[name] = per_test_timeout_s
    fork = torch.multiprocessing.get_context("fork").Process
    MultiProcessTestCase = common_distributed.MultiProcessTestCase

    class _Forked:
        """setUp of torch's drivers, with the ranks forked ([Note: forked ranks])."""

        def _fork_ranks(self: Any) -> None:
            if probe_dir is not None:
                os.environ["MEGABUF_CONFORMANCE_PROBE_FILE"] = os.path.join(
                    probe_dir, self.id().split(".")[-1]
                )
            self._start_processes(fork)

    class DistTest(_Forked, TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
        def setUp(self) -> None:
            super().setUp()
            self._fork_ranks()

    classes: dict[str, type] = {f"dist.{DIST_CLASS}": DistTest}
    for name in RPC_CLASSES:
        base = getattr(rpc_tests, name)

        def set_up(self: Any) -> None:
            MultiProcessTestCase.setUp(self)
            self._fork_ranks()

        bases = (_Forked, base, TensorPipeRpcAgentTestFixture, MultiProcessTestCase)
        classes[f"rpc.{name}"] = type(name, bases, {"setUp": set_up})
    for cls in classes.values():
        cls.__module__ = __name__
    return classes


def make_test(classes: dict[str, type], test_id: str) -> unittest.TestCase:
    class_id, _, method = test_id.rpartition(".")
    if class_id not in classes:
        raise ValueError(f"conformance: unknown class in {test_id!r}; one of {sorted(classes)}")
    return classes[class_id](method)


class _Result(unittest.TestResult):
    """Keeps the last (kind, error) unittest reported for the one test it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.kind = "pass"
        self.error: BaseException | str | None = None

    def addError(self, test: Any, err: Any) -> None:
        self.kind, self.error = "error", err[1]

    def addFailure(self, test: Any, err: Any) -> None:
        self.kind, self.error = "fail", err[1]

    def addSkip(self, test: Any, reason: str) -> None:
        self.kind, self.error = "skip", reason


_RANK_ERROR = re.compile(r"Process (\d+) exited with error code \d+ and exception:\n")
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
# A rank that only saw its peer die: never the primary exception when another rank has one.
_PEER_FAILURE = re.compile(r"Connection closed by peer|Connection reset|Broken pipe|timed out")


def _last_exception(traceback_text: str) -> tuple[str, str]:
    """(type name without module, first message line) of a formatted traceback's exception."""
    lines = traceback_text.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    for line in lines[starts[-1] + 1 if starts else 0 :]:
        if line and not line.startswith((" ", "\t")):
            match = _EXC_LINE.match(line)
            if match:
                return match.group(1).rsplit(".", 1)[-1], (match.group(2) or "").strip()
    return "Unknown", lines[-1] if lines else ""


def classify(test_id: str, kind: str, error: BaseException | str | None) -> Outcome:
    """One test's Outcome from what unittest reported in the parent process."""
    if kind in ("pass", "skip"):
        return Outcome(test_id, kind, message=str(error or "")[:300])
    text = str(error)
    if "terminated or timed out" in text or text.startswith("Timing out"):
        return Outcome(test_id, "timeout", message=text.splitlines()[0][:300])
    if "Expected exit code" in text:  # a rank died without a Python exception
        return Outcome(test_id, "crash", message=text.splitlines()[0][:300])
    ranks = _RANK_ERROR.split(text)
    if len(ranks) >= 3:  # [prefix, rank, traceback, rank, traceback, ...]
        found = [_last_exception(ranks[i + 1]) for i in range(1, len(ranks), 2)]
        primary = next((f for f in found if not _PEER_FAILURE.search(f[1])), found[0])
    else:  # raised in the parent itself
        primary = (type(error).__name__, text.splitlines()[0] if text else "")
    outcome = "fail" if primary[0] == "AssertionError" else "error"
    return Outcome(test_id, outcome, primary[0], primary[1][:300])


def run_one(classes: dict[str, type], test_id: str, probe_dir: str | None) -> Outcome:
    test = make_test(classes, test_id)
    result = _Result()
    started = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):  # torch prints to stdout; keep it for reports
        test.run(result)
    outcome = classify(test_id, result.kind, result.error)
    built = None
    if probe_dir is not None:
        built = os.path.exists(os.path.join(probe_dir, test_id.split(".")[-1]))
    return Outcome(
        outcome.test_id,
        outcome.outcome,
        outcome.exception,
        outcome.message,
        round(time.monotonic() - started, 2),
        built,
    )


def run_selection(
    test_ids: list[str], impl: str, per_test_timeout_s: int, log: Any = sys.stderr
) -> list[Outcome]:
    """Runs `test_ids` one after another with `impl` bound as DDP; one Outcome each."""
    prepare_environment(per_test_timeout_s)
    import torch

    torch.set_num_threads(1)  # two ranks on two shared cores
    from . import binding

    with tempfile.TemporaryDirectory(prefix="megabuf-probe-") as scratch:
        probe_dir = scratch if impl == "torch-probe" else None
        classes = build_classes(per_test_timeout_s, probe_dir)
        cls = binding.bind(impl)
        wrong = {name: c for name, c in binding.bound_classes().items() if c is not cls}
        if wrong:
            raise RuntimeError(f"conformance: DDP names not bound to {cls}: {wrong}")
        outcomes = []
        for test_id in test_ids:
            outcome = run_one(classes, test_id, probe_dir)
            print(f"{outcome.outcome:8} {outcome.seconds:6.1f}s {test_id}", file=log, flush=True)
            outcomes.append(outcome)
    return outcomes
