"""The torch DDP conformance tier (issue 40; tests/conformance/): torch's own DDP tests from the
installed wheel, with megabuf bound in place of torch DDP, against expectations.toml.

One subprocess runs the whole selection (`python -m tests.conformance --json`), each test's ranks
forked from it ([Note: forked ranks] in tests/conformance/suite.py), under a hard timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile

import pytest
from background_jobs import Call, Runner
from conformance import expectations, selection, suite

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Each test is bounded by the runner (30 s); the whole selection takes ~50 s here.
TIER_TIMEOUT_S = 300


def test_expectations_cover_the_selection_and_give_reasons() -> None:
    found = expectations.problems(expectations.load(), selection.SELECTED)
    assert not found, "\n".join(found)


def test_changes_are_seen_in_both_directions() -> None:
    expected = {
        "a": expectations.Expectation("pass"),
        "b": expectations.Expectation("error", "TypeError", "refused"),
        "c": expectations.Expectation("fail", "AssertionError", "reads reducer"),
    }
    run = [
        suite.Outcome("a", "error", "ValueError", "m"),  # an expected pass that fails
        suite.Outcome("b", "pass"),  # an excused test that now passes
        suite.Outcome("c", "error", "AttributeError", "m"),  # fails differently
    ]
    assert len(expectations.changes(expected, run)) == 3
    assert expectations.changes(expected, [suite.Outcome("a", "pass")]) == [
        "b: expected error(TypeError), not run",
        "c: expected fail(AssertionError), not run",
    ]
    text = expectations.render(expected, run, ("a", "b", "c"))
    assert '["b"]\noutcome = "pass"\n\n' in text
    assert 'reason = "TODO: m"' in text


def test_classify_reads_the_rank_exception() -> None:
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\n    f()\n'
    err = RuntimeError(
        f"Process 0 exited with error code 10 and exception:\n{tb}"
        "RuntimeError: Connection closed by peer\n\n"
        f"Process 1 exited with error code 10 and exception:\n{tb}"
        "torch.AcceleratorError: megabuf: refused\n  second line\n"
    )
    got = suite.classify("t", "error", err)
    assert (got.outcome, got.exception, got.message) == (
        "error",
        "AcceleratorError",
        "megabuf: refused",
    )
    timed_out = RuntimeError("Process 0 terminated or timed out after 30.1 seconds")
    assert suite.classify("t", "error", timed_out).outcome == "timeout"


def _run_tier(out: pathlib.Path) -> tuple[int, str, str]:
    """`python -m tests.conformance --json out` in a session of its own: on the hard timeout the
    runner and every rank it forked are killed together."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.conformance", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=TIER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        stderr += f"\n(killed after the tier's {TIER_TIMEOUT_S} s)"
    return proc.returncode, stdout, stderr


def _tier() -> tuple[int, str, str, str | None]:
    """The tier run beside the suite ([Note: background jobs] in background_jobs.py): exit
    status, output, and the outcomes it wrote (None: none)."""
    with tempfile.TemporaryDirectory(prefix="megabuf-conformance-") as tmp:
        out = pathlib.Path(tmp) / "outcomes.json"
        rc, stdout, stderr = _run_tier(out)
        return rc, stdout, stderr, out.read_text() if out.exists() else None


TIER = Call("torch DDP conformance tier", _tier)


@pytest.mark.background(TIER)
def test_torch_ddp_tests_on_megabuf_match_expectations(background: Runner) -> None:
    assert importlib.util.find_spec("expecttest"), (
        "torch's test modules import expecttest: install the test extra (pip install -e '.[test]')"
    )
    rc, stdout, stderr, written = background.result(TIER)
    assert written is not None, f"the runner wrote no outcomes (rc {rc}):\n{stderr[-4000:]}"
    outcomes = [suite.Outcome(**o) for o in json.loads(written)]
    found = expectations.changes(expectations.load(), outcomes)
    assert not found, (
        "torch DDP tests changed outcome on megabuf (python -m tests.conformance --refresh "
        "rewrites tests/conformance/expectations.toml; write the reasons):\n"
        + "\n".join(found)
        + f"\n\nrunner output:\n{stdout}"
    )
