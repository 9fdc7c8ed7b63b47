"""Benchmark plumbing: the byte counter's exact counts on a known layout (against the ring
formulas), the timeline of a real DDP, the report helpers, and a `--quick` run end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench_cases import STEPS, count_bytes
from dist_pool import case_result, run_each

from megabuf.bench.options import parse_options
from megabuf.bench.report import Progress, add_ratios, combine_ranks, results_table

REPO = Path(__file__).resolve().parents[1]
UNPADDED = 206 * 4  # KnownNet payload, bytes
PADDED = 384 * 4  # its sharded buffer at bucket_size=100 (see test_inspect.py), bytes
CONFIGS: dict[str, dict[str, Any]] = {
    "ar_sync": {},
    "ar_overlap": {"overlap_grad_reduce": True, "bucket_size": 100},  # buckets of 106 and 100
    "distopt": {"use_distributed_optimizer": True, "bucket_size": 100},
    "distopt_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "bucket_size": 100,
    },
}


def ring(nbytes: int, dp: int, halves: int) -> int:
    return halves * (dp - 1) * nbytes // dp


@pytest.fixture(scope="module", params=[2, 4], ids=lambda dp: f"dp{dp}")
def counted(request: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    cases = {name: (count_bytes, values) for name, values in CONFIGS.items()}
    return request.param, pools(request.param).run(run_each, cases)


# by hand: 206 fp32 elements all-reduced at dp=2 = 824 B; shards of 64 + 128
BY_HAND = {(2, "ar_sync"): ("all_reduce", 824), (2, "distopt"): ("reduce_scatter", 768)}


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_sent_match_the_ring_formulas(counted: Any, name: str) -> None:
    dp, per_rank = counted
    for rank, res in enumerate(case_result(per_rank, name)):
        per_step = {op: b // STEPS for op, b in res["bytes"].items()}
        if name.startswith("ar_"):
            assert per_step == {"all_reduce": ring(UNPADDED, dp, 2)}, rank
            assert res["calls"] == {"all_reduce": STEPS * (2 if name == "ar_overlap" else 1)}
        else:
            assert per_step == {
                "reduce_scatter": ring(PADDED, dp, 1),
                "all_gather": ring(PADDED, dp, 1),
            }, (name, rank)
            assert res["calls"] == {"reduce_scatter": 2 * STEPS, "all_gather": 2 * STEPS}
            # the same split in two; more than the unpadded all-reduce by exactly the padding
            padding = ring(PADDED - UNPADDED, dp, 2)
            assert sum(per_step.values()) == ring(UNPADDED, dp, 2) + padding
        if (dp, name) in BY_HAND:
            op, nbytes = BY_HAND[dp, name]
            assert per_step[op] == nbytes, (name, rank)


# The first overlapped iteration learns each param's grad arrivals and dispatches at
# finish_grad_sync ([Note: grad readiness]); from the second on, while backward runs.
LEARNED = [0] + [2] * (STEPS - 1)


@pytest.mark.parametrize(
    ("name", "groups", "early"),
    [
        ("ar_sync", 1, [0] * STEPS),  # everything after backward: all exposed
        ("ar_overlap", 2, LEARNED),
        ("distopt_overlap", 2, LEARNED),
    ],
)
def test_timeline_of_a_real_ddp(counted: Any, name: str, groups: int, early: list[int]) -> None:
    for res in case_result(counted[1], name):
        assert res["steps"] == STEPS, name
        assert res["groups"] == [groups] * STEPS, name
        assert all(e >= 0.0 for e in res["exposed"]), name
        assert res["early"] == early, name


def test_report_helpers() -> None:
    stream = io.StringIO()
    bar = Progress(4, width=8, stream=stream)
    assert bar.prefix(2, "gpt x") == "[####....] 2/4 gpt x"
    bar.show(3, "m s")
    assert stream.getvalue() == "[######..] 3/4 m s\n"  # not a terminal: one line per update
    ok = {"status": "ok", "model": "m", "batch_per_rank": 4, "peak_rss_bytes": 2 << 20,
          "optimizer_state_nbytes": 1 << 20, "check_max_abs_error": 1e-7,
          "theoretical_bytes_per_step": 10**6, "phase_ms": {},
          "loadavg_1min": [1.5, 2.0], "cpu_s": 1.0, "wall_s": 1.0,
          "machine_busy_s": 2.0 + (os.cpu_count() or 1) * 0.25}  # fmt: skip
    rows = [
        combine_ranks([{**ok, "system": "torch_ddp_gabv", "rank": r, "step_ms": 100.0 + r}
                       for r in range(2)]),
        combine_ranks([{**ok, "system": "no_comm", "rank": r, "step_ms": 50.0} for r in range(2)]),
        combine_ranks([{**ok, "system": "megabuf_ar_overlap", "rank": r, "step_ms": 90.9,
                        "bytes_per_step": 10**6} for r in range(2)]),
        {"model": "m", "system": "megabuf_distopt_sync", "status": "n/a (not available)"},
    ]  # fmt: skip
    add_ratios(rows, world_size=2)
    assert rows[0]["step_ms"] == 101.0 and rows[0]["ratio_to_ddp"] == 1.0
    assert rows[2]["ratio_to_ddp"] == pytest.approx(0.9) and rows[2]["ratio_to_floor"] == 90.9 / 50
    assert rows[1]["samples_per_s"] == pytest.approx(160.0)
    table = results_table(rows, tolerance=1e-5)
    cells = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in table.splitlines()[2:]}  # fmt: skip
    assert cells["megabuf_ar_overlap"][:6] == ["m", "megabuf_ar_overlap", "90.9", "0.90", "1.82",
                                               "88.0"]  # fmt: skip
    assert cells["megabuf_ar_overlap"][8:] == ["1.00", "1.00", "-", "25", "ok 1.0e-07"]
    assert cells["torch_ddp_gabv"][8:10] == ["-", "1.00"]  # theoretical only
    assert cells["megabuf_distopt_sync"][-1] == "n/a (not available)"


def test_options() -> None:
    quick = parse_options(["--quick"])
    assert quick.steps == 2 and not quick.isolate and "gpt_tiny" in quick.models
    full = parse_options(["--models", "gpt_small:2,mlp_34m", "--systems", "no_comm"])
    assert full.models == {"gpt_small": 2, "mlp_34m": 64} and full.isolate
    with pytest.raises(ValueError, match="unknown systems"):
        parse_options(["--systems", "deepspeed"])


def test_quick_run_end_to_end(tmp_path: Path) -> None:
    systems = "no_comm,torch_ddp_gabv,megabuf_ar_overlap,megabuf_distopt_overlap"
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, "-m", "megabuf.bench", "--quick", "--models", "gpt_tiny:2",
           "--systems", systems, "--out", str(out), "--trace", str(tmp_path / "trace")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "run" and len(lines) == 5
    rows = {r["system"]: r for r in lines[1:]}
    for name in systems.split(","):
        assert rows[name]["status"] == "ok", rows[name]
        if name != "no_comm":
            assert rows[name]["check_max_abs_error"] <= 1e-5, rows[name]
    assert rows["torch_ddp_gabv"]["ratio_to_ddp"] == 1.0
    for name in ("megabuf_ar_overlap", "megabuf_distopt_overlap"):
        by_op = rows[name]["bytes_by_op"]
        layout = rows[name]["theoretical_bytes_layout"]
        if name == "megabuf_ar_overlap":
            assert by_op == {"all_reduce": layout}
        else:  # (the distributed optimizer also all-reduces the grad norm: a few bytes)
            assert by_op["reduce_scatter"] + by_op["all_gather"] == layout, by_op
        assert rows[name]["overlap"]["steps"] == 2
    assert (tmp_path / "trace" / "gpt_tiny_megabuf_ar_overlap_rank1.json").exists()
    assert "megabuf_distopt_overlap" in proc.stdout and "x DDP" in proc.stdout
