"""The benchmark's comm-hook rows without processes (megabuf/bench/hooks.py): which variants a
command line selects, the skip of a hook `build` does not know, the ratio to torch with the same
hook, the hook table's cells, and the torch-side formulas (figures by hand). The rows run for
real in tests/test_bench.py::test_quick_run_end_to_end; the loss-curve script runs two short
curves here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from megabuf.bench.curves import VARIANTS, curve_record
from megabuf.bench.curves import main as curves_main
from megabuf.bench.curves import parse_args as parse_curves_args
from megabuf.bench.curves_plot import read_curves, smooth
from megabuf.bench.hooks import (
    DEFAULT_HOOKS,
    HOOK_VARIANTS,
    LOSSY_CHECK_ATOL,
    hook_check_atol,
    parse_hooks,
    torch_hook_ring_nbytes,
    unavailable_reason,
)
from megabuf.bench.main import make_jobs
from megabuf.bench.options import parse_options
from megabuf.bench.report import Progress, add_ratios, hook_table
from megabuf.testing import build_model

M, T = "megabuf_ar_overlap", "torch_ddp_gabv"


def test_default_hook_rows_are_the_issues_and_only_on_full_runs() -> None:
    issue_rows = (
        f"{M}+bf16", f"{M}+powersgd_r1", f"{M}+powersgd_r4",
        f"{T}+bf16", f"{T}+powersgd_r1", f"{T}+powersgd_r4",
    )  # fmt: skip
    assert issue_rows == DEFAULT_HOOKS
    full = parse_options([])
    assert full.hooks == DEFAULT_HOOKS and (full.hook_model, full.hook_batch) == ("gpt_small", 4)
    assert parse_options(["--quick"]).hooks == ()
    assert parse_options(["--systems", "no_comm"]).hooks == ()
    assert parse_options(["--hooks", "none"]).hooks == ()
    assert parse_options(["--hooks", "all"]).hooks == tuple(HOOK_VARIANTS)
    # a megabuf row brings the torch row with the same hook along
    picked = parse_options(["--quick", "--hooks", f"{M}+bf16_fp32acc", "--hook-model", "mlp_tiny"])
    assert picked.hooks == (f"{M}+bf16_fp32acc", f"{T}+bf16")
    assert (picked.hook_model, picked.hook_batch) == ("mlp_tiny", 8)
    with pytest.raises(ValueError, match="unknown --hooks"):
        parse_hooks("megabuf+lz4", ())


def test_jobs_add_hook_rows_and_their_baseline_on_the_hook_model_only() -> None:
    opts = parse_options(["--quick", "--systems", "no_comm", "--hooks", f"{M}+reduce"])
    refs: Any = {m: None for m in ("gpt_tiny", "mlp_tiny", "many_small")}
    jobs = make_jobs(opts, refs, Progress(1), opts.hooks)
    pairs = [(j.model, j.system) for j in jobs]
    assert pairs == [("gpt_tiny", "no_comm"), ("mlp_tiny", "no_comm"), ("many_small", "no_comm"),
                     ("gpt_tiny", T), ("gpt_tiny", f"{M}+reduce")]  # fmt: skip


def test_a_hook_build_does_not_know_is_skipped_with_its_reason() -> None:
    assert unavailable_reason(f"{M}+bf16") is None
    assert unavailable_reason(f"{T}+powersgd_r1") is None  # torch's hooks are always there
    reason = unavailable_reason(f"{M}+powersgd_r1")
    try:
        from megabuf.comm_hooks import build

        build({"name": "powersgd", "rank": 1, "start_step": 2})
    except ValueError:
        assert reason is not None and "'powersgd' not available" in reason
    else:  # after the PowerSGD merge the row runs
        assert reason is None


def _row(system: str, step_ms: float, **extra: Any) -> dict[str, Any]:
    return {"status": "ok", "model": "m", "system": system, "step_ms": step_ms,
            "batch_per_rank": 1, "check_max_abs_error": 1e-7, **extra}  # fmt: skip


def test_ratio_to_the_torch_row_with_the_same_hook_and_the_hook_table() -> None:
    rows = [
        _row(T, 100.0, theoretical_bytes_per_step=8_000_000),
        _row(f"{T}+bf16", 80.0, theoretical_bytes_per_step=4_000_000,
             check_max_abs_error=1.5e-3),
        _row(f"{M}+bf16", 72.0, theoretical_bytes_per_step=4_000_000,
             hook_wire_bytes_per_step=4_000_000, bytes_per_step=4_000_010),
        _row(f"{M}+reduce", 90.0, theoretical_bytes_per_step=8_000_000,
             hook_wire_bytes_per_step=8_000_064),
        _row(f"{M}+powersgd_r4", 50.0),  # its torch row is missing from the run
        {"model": "m", "system": f"{T}+powersgd_r1", "status": "n/a (not available)"},
        _row("no_comm", 10.0),
    ]  # fmt: skip
    add_ratios(rows, world_size=2)
    assert rows[2]["ratio_to_same_hook"] == pytest.approx(0.9)  # 72 / 80
    assert rows[3]["ratio_to_same_hook"] == pytest.approx(0.9)  # Reduce: vs plain torch DDP
    assert rows[4]["ratio_to_same_hook"] is None
    assert "ratio_to_same_hook" not in rows[1]  # torch rows are the 1.00x
    table = hook_table(rows, tolerance=1e-5)
    cells = {line.split("|")[2].strip(): [c.strip() for c in line.split("|")[1:-1]]
             for line in table.splitlines()[2:]}  # fmt: skip
    assert list(cells) == [
        T,
        f"{T}+bf16",
        f"{M}+bf16",
        f"{M}+reduce",
        f"{M}+powersgd_r4",
        f"{T}+powersgd_r1",
    ]  # fmt: skip (no_comm is not a hook row)
    assert cells[f"{M}+bf16"][2:] == ["72.0", "0.90", "0.72", "4.000", "4.000", "yes",
                                      "ok 1.0e-07"]  # fmt: skip
    assert cells[f"{M}+reduce"][5:8] == ["8.000", "8.000", "no (+64 B)"]
    assert cells[f"{T}+bf16"][5:] == ["-", "4.000", "-", "ok 1.5e-03"]  # lossy: 2 lr
    assert cells[f"{T}+powersgd_r1"][-1] == "n/a (not available)"
    assert hook_table([_row(T, 1.0)], 1e-5) == ""  # no hook row, no table


def test_lossy_hooks_are_checked_to_two_learning_rates() -> None:
    assert hook_check_atol(f"{M}+bf16", 1e-5) == LOSSY_CHECK_ATOL == 2e-3
    assert hook_check_atol(f"{M}+reduce", 1e-5) == 1e-5
    assert hook_check_atol(T, 1e-5) == 1e-5


def test_torch_hook_formulas() -> None:
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8, bias=False))  # 2048+64 + 512 fp32
    numel = 2048 + 64 + 512
    assert torch_hook_ring_nbytes(net, {"hook": "bf16_compress"}, 2) == numel * 2
    # r=1: 64x32 -> P 64, Q 32; 8x64 -> (8+64)*1*2 = 144 < 512: P 8, Q 64; bias 64 uncompressed
    assert torch_hook_ring_nbytes(net, {"hook": "powersgd", "rank": 1}, 2) == 4 * (
        64 + 64 + 32 + 8 + 64
    )
    # dp 4: 2 * 3/4 of the bytes
    assert torch_hook_ring_nbytes(net, {"hook": "bf16_compress"}, 4) == 2 * 3 * numel * 2 // 4


# ---- loss curves (megabuf/bench/curves.py) -------------------------------------------------------
def test_curves_options_and_smoothing() -> None:
    args = parse_curves_args([])
    assert args.steps == 300 and args.model == "gpt_tiny" and args.variants == list(VARIANTS)
    every = (M, f"{M}+bf16", f"{M}+powersgd_r1", f"{M}+powersgd_r4",
             T, f"{T}+bf16", f"{T}+powersgd_r1", f"{T}+powersgd_r4")  # fmt: skip
    assert every == VARIANTS
    with pytest.raises(SystemExit):
        parse_curves_args(["--variants", "megabuf+gzip"])
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert curve_record(f"{T}+powersgd_r4", {"losses": [1.0]})["spec"] == {
        "hook": "powersgd", "rank": 4,
    }  # fmt: skip
    assert curve_record(M, {"losses": []})["hook"] == "none"


def test_curves_run_end_to_end(tmp_path: Path, capsys: Any) -> None:
    """Two curves, 3 steps: same first loss (same model and batch), the JSON lines the plot
    reads, and the megabuf hook's wire bytes (bf16: half of the fp32 params' bytes at dp=2)."""
    jsonl = tmp_path / "c.jsonl"
    argv = ["--steps", "3", "--variants", f"{M}+bf16,{T}+bf16", "--jsonl", str(jsonl),
            "--out", str(tmp_path / "c.png")]  # fmt: skip
    assert curves_main(argv) == 0
    header, curves = read_curves(str(jsonl))
    assert header["options"]["steps"] == 3 and "gpt_tiny" in header["title"]
    assert [c["variant"] for c in curves] == [f"{M}+bf16", f"{T}+bf16"]
    assert all(len(c["losses"]) == 3 for c in curves)
    assert curves[0]["losses"][0] == curves[1]["losses"][0]
    assert curves[0]["losses"][-1] < curves[0]["losses"][0]  # it trains
    n_params = sum(p.numel() for p in build_model("gpt_tiny", seed=0).parameters())
    assert curves[0]["hook_wire_bytes_per_step"] == 2 * n_params  # dp 2: bf16 bytes once
    out = capsys.readouterr().out
    assert "wrote" in out and "c.png" in out, out


def test_torch_powersgd_rows_use_one_bucket_and_the_others_torchs_default() -> None:
    """[Note: torch PowerSGD on gloo]: torch's powerSGD_hook races its callback-issued all-reduce
    against the next bucket's, so its torch rows get one bucket; bf16 keeps torch's default."""
    from megabuf.bench.hooks import ONE_BUCKET_MB, torch_bucket_cap_mb

    torch_specs = {v.spec["hook"]: v.spec for v in HOOK_VARIANTS.values() if v.engine == "torch"}
    assert torch_bucket_cap_mb(torch_specs["powersgd"]) == ONE_BUCKET_MB
    assert torch_bucket_cap_mb(torch_specs["bf16_compress"]) is None
