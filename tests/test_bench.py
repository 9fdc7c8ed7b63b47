"""Benchmark plumbing: the byte counter's counts of what each call handed to torch.distributed
(figures worked out by hand below, never from megabuf's layout or formulas), the timeline of a
real DDP, the report helpers, and a `--quick` run end to end."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from background_jobs import Call, Runner
from bench_cases import STEPS, count_bytes, wrapper_bytes
from dist_pool import case_result, run_each

from megabuf.bench.options import parse_options
from megabuf.bench.report import Progress, add_ratios, combine_ranks, results_table

REPO = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, dict[str, Any]] = {
    "ar_sync": {},
    "ar_overlap": {"overlap_grad_reduce": True, "bucket_size": 100},
    "distopt": {"use_distributed_optimizer": True, "bucket_size": 100},
    "distopt_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "bucket_size": 100,
    },
}

# KnownNet: fp32 params of 100, 37, 64, 5 elements (registration order) = 206 elements = 824 B.
# All-reduce (no padding): the whole buffer, 824 B per step whatever the buckets; with
#   bucket_size=100, reverse order p3 (5) + p2 (64) + p1 (37) = 106 closes bucket 0, p0 (100) is
#   bucket 1: two calls of 424 B and 400 B.
# Distributed optimizer, bucket_size=100, dp 2 or 4 (params start at multiples of 64, buckets
#   end at multiples of lcm(dp, 128) = 128): p3 at [0, 5), p2 at [64, 128) -> 128 elements
#   close bucket 0 = [0, 128); p1 at [128, 165), p0 at [192, 292) -> bucket 1 padded to
#   [128, 384). Per step, per rank:
#   reduce-scatter (gloo: all-to-all of the whole bucket into a scratch of its size):
#     in 128*4 + 256*4 = 1536 B, out (scratch) 1536 B;
#   all-gather (gloo: point-to-point, this rank's shard isend to each of dp-1 peers, one irecv
#     from each): shards 128/dp + 256/dp elements -> (dp-1) * 1536/dp B each way:
#     dp 2: 768 B, dp 4: 3 * 384 = 1152 B.
# Ring figure (a model of the wire): all-reduce 2(dp-1)/dp * 824 = 824 (dp 2) or 1236 (dp 4);
#   reduce-scatter and all-gather (dp-1)/dp * 1536 = 768 (dp 2) or 1152 (dp 4) each.
HANDED: dict[tuple[int, str], dict[str, tuple[int, int, int, int]]] = {}
for _dp, _ag, _ar_ring in ((2, 768, 824), (4, 1152, 1236)):  # (in, out, ring, calls) per step
    HANDED[_dp, "ar_sync"] = {"all_reduce": (824, 824, _ar_ring, 1)}
    HANDED[_dp, "ar_overlap"] = {"all_reduce": (824, 824, _ar_ring, 2)}
    for _name in ("distopt", "distopt_overlap"):
        HANDED[_dp, _name] = {
            "reduce_scatter": (1536, 1536, _ag, 2),
            "all_gather": (_ag, _ag, _ag, 2),
        }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda dp: f"dp{dp}")
def counted(request: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    cases: dict[str, Any] = {name: (count_bytes, values) for name, values in CONFIGS.items()}
    cases["wrappers"] = (wrapper_bytes,)
    return request.param, pools(request.param).run(run_each, cases)


@pytest.mark.parametrize("name", CONFIGS)
def test_bytes_handed_to_torch_distributed(counted: Any, name: str) -> None:
    dp, per_rank = counted
    expected = {op: tuple(STEPS * v for v in per_step) for op, per_step in HANDED[dp, name].items()}
    for rank, res in enumerate(case_result(per_rank, name)):
        keys = ("input", "output", "ring", "calls")
        got = {op: tuple(res[k][op] for k in keys) for op in res["calls"]}
        assert got == expected, (name, rank)


def wrapper_figures(dp: int, rank: int) -> dict[str, tuple[int, int, int, int]]:
    """By hand, per op (input, output, ring bytes, calls) for `wrapper_bytes` on `rank`."""
    peers = dp - 1
    return {
        # 10 fp32 + 6 bf16 = 52 B in place; ring 2(dp-1)/dp each: 2*40*p//dp + 2*12*p//dp
        "all_reduce": (52, 52, 2 * peers * 40 // dp + 2 * peers * 12 // dp, 2),
        # input 3*dp fp32; gloo lands it whole in a scratch of the same size; ring (dp-1)*12
        "reduce_scatter": (12 * dp, 12 * dp, 12 * peers, 1),
        # 5 fp32 (20 B) isend to each peer, one 20 B irecv from each
        "all_gather": (20 * peers, 20 * peers, 20 * peers, 1),
        # (2*dp, 3) fp64 in and out; rows for other ranks: 2*(dp-1) rows of 24 B
        "all_to_all": (48 * dp, 48 * dp, 48 * peers, 1),
        # 7 fp32 from rank 0, received by the others
        "broadcast": (28, 0, 28, 1) if rank == 0 else (0, 28, 0, 1),
        "barrier": (0, 0, 0, 1),
        "max_all_reduce": (8, 8, 2 * peers * 8 // dp, 1),
        **({"send": (72, 0, 72, 1)} if rank == 0 else {}),
        **({"recv": (0, 72, 0, 1)} if rank == 1 else {}),
    }


def test_each_wrapper_counts_its_arguments(counted: Any) -> None:
    dp, per_rank = counted
    for rank, got in enumerate(case_result(per_rank, "wrappers")):
        assert {op: tuple(v) for op, v in got.items()} == wrapper_figures(dp, rank), rank


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
    named = parse_options(["--models", "many_small,mlp_tiny"])  # in both lists: the full batch
    assert named.models == {"many_small": 32, "mlp_tiny": 8}
    with pytest.raises(ValueError, match="unknown systems"):
        parse_options(["--systems", "deepspeed"])


QUICK_SYSTEMS = "no_comm,torch_ddp_gabv,megabuf_ar_overlap,megabuf_distopt_overlap"


def _quick_run() -> dict[str, Any]:
    """`python -m megabuf.bench --quick ...` in a temporary directory: its exit status, output,
    result lines and whether rank 1's trace was written (run beside the suite: [Note:
    background jobs] in background_jobs.py)."""
    with tempfile.TemporaryDirectory(prefix="megabuf-bench-") as tmp:
        out, trace = Path(tmp) / "r.jsonl", Path(tmp) / "trace"
        cmd = [sys.executable, "-m", "megabuf.bench", "--quick", "--models", "gpt_tiny:2",
               "--systems", QUICK_SYSTEMS, "--out", str(out), "--trace", str(trace),
               "--hooks", "megabuf_ar_overlap+bf16"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
        return {
            "returncode": proc.returncode,
            "output": proc.stdout + proc.stderr,
            "stdout": proc.stdout,
            "lines": out.read_text() if out.exists() else "",
            "trace_rank1": (trace / "gpt_tiny_megabuf_ar_overlap_rank1.json").exists(),
        }


QUICK = Call("bench: quick run", _quick_run)


@pytest.mark.background(QUICK)
def test_quick_run_end_to_end(background: Runner) -> None:
    systems = QUICK_SYSTEMS
    proc = background.result(QUICK)
    assert proc["returncode"] == 0, proc["output"]
    lines = [json.loads(line) for line in proc["lines"].splitlines()]
    assert lines[0]["kind"] == "run" and len(lines) == 7  # + megabuf and torch with bf16
    rows = {r["system"]: r for r in lines[1:]}
    for name in systems.split(","):
        assert rows[name]["status"] == "ok", rows[name]
        if name != "no_comm":
            assert rows[name]["check_max_abs_error"] <= 1e-5, rows[name]
    assert rows["torch_ddp_gabv"]["ratio_to_ddp"] == 1.0
    # model state measured by a storage walk equals the exact formula ([Note: memory formula])
    distopt = rows["megabuf_distopt_overlap"]
    assert distopt["persistent_nbytes"] == distopt["persistent_formula_nbytes"] > 0
    for name in ("megabuf_ar_overlap", "megabuf_distopt_overlap"):
        by_op = rows[name]["bytes_by_op"]
        layout = rows[name]["theoretical_bytes_layout"]
        # at dp 2 `layout` (the ring figure over the padded buffers, 2 * 1/2 of them) is the
        # padded grad bytes themselves: all-reduced whole, or handed whole to the all-to-all
        # reduce-scatter, half of them (this rank's shard) isent to the one peer
        handed = rows[name]["handed_bytes_by_op"]
        if name == "megabuf_ar_overlap":
            assert by_op == {"all_reduce": layout}
            assert handed == {"all_reduce": layout}
        else:  # (the distributed optimizer also all-reduces the grad norm: a few bytes)
            assert by_op["reduce_scatter"] + by_op["all_gather"] == layout, by_op
            assert (handed["reduce_scatter"], 2 * handed["all_gather"]) == (layout, layout)
        assert rows[name]["overlap"]["steps"] == 2
    assert proc["trace_rank1"]
    assert "megabuf_distopt_overlap" in proc["stdout"] and "x DDP" in proc["stdout"]
    # the comm-hook rows: Compress(bf16) counted at exactly its formula, half of fp32's bytes
    hooked, torch_bf16 = rows["megabuf_ar_overlap+bf16"], rows["torch_ddp_gabv+bf16"]
    assert hooked["status"] == torch_bf16["status"] == "ok", (hooked, torch_bf16)
    wire = hooked["hook_wire_bytes_per_step"]
    assert wire == hooked["theoretical_bytes_per_step"] == hooked["bytes_per_step"], hooked
    assert 2 * wire == rows["megabuf_ar_overlap"]["bytes_per_step"]
    assert hooked["ratio_to_same_hook"] == hooked["step_ms"] / torch_bf16["step_ms"]
    assert 0 < hooked["check_max_abs_error"] <= 2e-3 and "Comm hooks" in proc["stdout"]


def test_auto_rows_show_the_planners_prediction_next_to_the_measured_exposed_time() -> None:
    from megabuf.bench.report import _exposed_cell

    assert _exposed_cell(92.04, 80.12) == "92.0 (model 80.1)"  # bucket_size="auto" rows
    assert _exposed_cell(92.04, None) == "92.0"
    assert _exposed_cell(None, None) == "-"


def test_auto_systems_are_the_overlapped_systems_on_the_auto_plan() -> None:
    """Each `*_auto` bench system is its overlapped sibling with bucket_size="auto", so the
    pair's rows compare the plans alone."""
    from megabuf import DistributedDataParallelConfig
    from megabuf.bench.options import SYSTEM_NAMES
    from megabuf.bench.systems import MEGABUF_CONFIGS

    for auto, sibling in (
        ("megabuf_ar_auto", "megabuf_ar_overlap"),
        ("megabuf_distopt_auto", "megabuf_distopt_overlap"),
    ):
        assert auto in SYSTEM_NAMES and sibling in SYSTEM_NAMES
        fields = dict(MEGABUF_CONFIGS[auto])
        assert fields.pop("bucket_size") == "auto" and fields.pop("auto_bucket_warmup_steps") >= 2
        assert fields == MEGABUF_CONFIGS[sibling]
        DistributedDataParallelConfig(**MEGABUF_CONFIGS[auto])  # a valid config
