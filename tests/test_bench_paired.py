"""The paired benchmark ([Note: paired measurement] in megabuf/bench/paired.py): pure tests of
its statistics and order, its refusals, and one run on 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from background_jobs import Call, Runner

from megabuf.bench.options import parse_systems, split_system
from megabuf.bench.paired import check_options, median_interval, round_order, summarize

REPO = Path(__file__).resolve().parent.parent


def test_rounds_alternate_forward_and_reversed() -> None:
    assert round_order(3, 0) == [0, 1, 2]
    assert round_order(3, 1) == [2, 1, 0]
    assert round_order(3, 2) == [0, 1, 2]
    for r in range(5):  # every system once a round
        assert sorted(round_order(4, r)) == [0, 1, 2, 3]


def test_median_interval_is_the_binomial_order_statistics() -> None:
    xs = [float(v) for v in range(30, 0, -1)]  # 30 values, unsorted
    # n = 30: P(B <= 9) = 0.021 <= 0.025 < P(B <= 10) = 0.049, so the 10th smallest and largest
    assert median_interval(xs) == (10.0, 21.0)
    # n = 9: P(B <= 1) = 0.0195 <= 0.025 < P(B <= 2) = 0.090
    assert median_interval([float(v) for v in range(1, 10)]) == (2.0, 8.0)
    # n = 5: P(B <= 0) = 1/32 > 0.025: no interval narrower than the range
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)
    assert median_interval([7.0]) == (7.0, 7.0)
    # a lower confidence gives a narrower interval
    low, high = median_interval(xs, confidence=0.5)
    assert 10.0 < low <= high < 21.0
    with pytest.raises(ValueError, match="no values"):
        median_interval([])


def test_a_drift_common_to_a_round_cancels_and_the_slowest_rank_counts() -> None:
    """Rounds alternate a fast and a 10x slower machine; the second system is 0.8x the baseline
    in every round: the per-round ratio is exactly 0.8 with an interval of zero width (a ratio
    to the baseline's overall median would spread from 0.08 to 8)."""
    drift = [1.0 if r % 2 == 0 else 10.0 for r in range(9)]
    rank0 = [drift, [0.8 * d for d in drift]]
    rank1 = [[d / 2 for d in drift], [0.4 * d for d in drift]]  # faster: never the step's time
    rank1[1][3] = 100.0  # rank 1 slowest in one round: that round's step is 100 s
    base, other = summarize("m", ["a", "b"], [rank0, rank1])
    assert (base.ratio, base.ratio_low, base.ratio_high, base.faster_rounds) == (1.0, 1.0, 1.0, 0)
    assert other.ratio == pytest.approx(0.8) and other.rounds == 9
    assert other.ratio_low == pytest.approx(0.8) and other.ratio_high == pytest.approx(0.8)
    assert other.faster_rounds == 8  # round 3: 100 s against the baseline's 10 s
    assert base.step_ms == pytest.approx(1e3 * 1.0) and other.step_ms == pytest.approx(800.0)


@pytest.mark.parametrize(
    ("systems", "rounds", "warmup", "match"),
    [
        (("torch_ddp_gabv",), 30, 5, "--systems needs a baseline"),
        (("torch_ddp_gabv", "megabuf_ar_overlap", "torch_ddp_gabv"), 30, 5, "names a system twice"),
        (("torch_ddp_gabv", "megabuf_ar_overlap"), 0, 5, "--rounds must be >= 1"),
        (("torch_ddp_gabv", "megabuf_ar_auto"), 30, 2, "--warmup must be >= 3"),
    ],
)
def test_misuse_is_refused_naming_the_option(
    systems: tuple[str, ...], rounds: int, warmup: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_options(systems, rounds, warmup)
    check_options(("torch_ddp_gabv", "megabuf_ar_auto"), 1, 3)  # the smallest valid run


def test_a_system_may_carry_a_bucket_size_and_misuse_names_it() -> None:
    sized = ("megabuf_ar_overlap", {"bucket_size": 262144})
    assert split_system("megabuf_ar_overlap@262144") == sized
    assert split_system("torch_ddp_gabv") == ("torch_ddp_gabv", {})
    assert parse_systems("torch_ddp_gabv, megabuf_ar_sync@10") == (
        "torch_ddp_gabv", "megabuf_ar_sync@10")  # fmt: skip
    for bad in ("torch_ddp_gabv@100", "megabuf_ar_overlap@", "megabuf_ar_overlap@1e6"):
        with pytest.raises(ValueError, match="bucket size in elements"):
            parse_systems(f"torch_ddp_gabv,{bad}")
    with pytest.raises(ValueError, match="unknown systems"):
        parse_systems("torch_ddp_gabv,megabuf_nope@10")
    assert split_system("megabuf_ar_sync+pyhooks") == ("megabuf_ar_sync", {"python_hooks": True})
    assert split_system("megabuf_ar_overlap@64+pyhooks") == (
        "megabuf_ar_overlap", {"bucket_size": 64, "python_hooks": True})  # fmt: skip
    with pytest.raises(ValueError, match="'\\+pyhooks' follows a megabuf system"):
        parse_systems("torch_ddp_gabv,torch_ddp_gabv+pyhooks")
    with pytest.raises(ValueError, match="unknown systems"):
        parse_systems("torch_ddp_gabv,megabuf_ar_sync+nope")


def _paired_run() -> dict[str, Any]:
    """`python -m megabuf.bench.paired ...` in a temporary directory: exit status, output and
    result lines (run beside the suite: [Note: background jobs] in background_jobs.py)."""
    with tempfile.TemporaryDirectory(prefix="megabuf-paired-") as tmp:
        out = Path(tmp) / "p.jsonl"
        cmd = [sys.executable, "-m", "megabuf.bench.paired", "--models", "gpt_tiny:2",
               "--systems",
               "torch_ddp_gabv,megabuf_ar_auto,megabuf_ar_overlap@64,megabuf_ar_overlap@64+pyhooks",
               "--rounds", "4", "--warmup", "3",
               "--out", str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
        lines = out.read_text() if out.exists() else ""
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "lines": lines}  # fmt: skip


PAIRED = Call("bench: paired run", _paired_run)


@pytest.mark.background(PAIRED)
def test_paired_run_end_to_end(background: Runner) -> None:
    """Two systems on 2 gloo ranks: each checked against the single-process step, the auto plan
    chosen in warm-up (before the rounds), every round timed on both ranks."""
    proc = background.result(PAIRED)
    assert proc["returncode"] == 0, proc["stdout"] + proc["stderr"]
    head, *rows = (json.loads(line) for line in proc["lines"].splitlines())
    names = ["torch_ddp_gabv", "megabuf_ar_auto", "megabuf_ar_overlap@64",
             "megabuf_ar_overlap@64+pyhooks"]  # fmt: skip
    assert head["kind"] == "run" and head["systems"] == names
    assert [r["system"] for r in rows] == head["systems"]
    base, auto, sized, python_hooks = rows
    assert base["ratio"] == 1.0 and base["rounds"] == auto["rounds"] == 4
    # a bucket size of its own: 64 elements, so about one bucket group per param
    assert sized["bucket_groups"] > 2 * auto["bucket_groups"], (sized, auto)
    # groups of small params alone (norms, biases) count their arrivals, except under +pyhooks
    assert sized["counted_groups"] > 0 == python_hooks["counted_groups"], (sized, python_hooks)
    assert python_hooks["bucket_groups"] == sized["bucket_groups"]
    for row in rows:
        assert row["check_max_abs_error"] <= 1e-5, row
        assert [len(s) for s in row["step_s_per_rank"]] == [4, 4], row
        assert row["ratio_low"] <= row["ratio"] <= row["ratio_high"], row
    assert "auto_plan" in auto and auto["exposed_ms"] is not None, auto
    assert "exposed_ms" not in base  # torch DDP has no megabuf timeline
    assert "megabuf_ar_auto" in proc["stdout"] and "95% interval" in proc["stdout"]
