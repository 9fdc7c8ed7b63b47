"""The GPU benchmark's CPU-side logic (pure: no processes, no GPU): world size and GPT size
flags, the model-state bytes/param formula (figures worked out by hand), tokens/s and the CUDA
table. The CUDA run itself is `tests/test_gpu.py::test_bench_quick_on_cuda` (skipped here)."""

from __future__ import annotations

import pytest

from megabuf.bench.memory import state_bytes_per_param
from megabuf.bench.options import default_world_size, gpt_overrides, parse_options
from megabuf.bench.reference import bench_model, tokens_per_sample
from megabuf.bench.report import add_ratios, combine_ranks, cuda_table
from megabuf.testing.models import GPTConfig, MLPConfig

MiB = 1 << 20


def test_world_size_defaults_to_two_cpu_ranks_or_every_visible_gpu() -> None:
    assert parse_options(["--quick"]).world_size == 2
    assert parse_options(["--quick", "--world-size", "3"]).world_size == 3
    assert default_world_size("cpu", 0) == 2
    assert default_world_size("cuda", 1) == 1 and default_world_size("cuda", 8) == 8
    with pytest.raises(ValueError, match="no CUDA device"):
        default_world_size("cuda", 0)


def test_gpt_size_flags_scale_every_gpt_preset() -> None:
    opts = parse_options(["--gpt-width", "1024", "--gpt-depth", "24", "--gpt-seq-len", "512"])
    assert opts.model_overrides == {
        "d_model": 1024, "d_ff": 4096, "n_heads": 16, "n_layers": 24, "seq_len": 512,
    }  # fmt: skip
    assert parse_options([]).model_overrides == {}
    assert gpt_overrides(32, None, None) == {"d_model": 32, "d_ff": 128, "n_heads": 1}
    with pytest.raises(ValueError, match="multiple of 64"):
        gpt_overrides(100, None, None)
    cfg = bench_model("gpt_small", opts.model_overrides)
    assert isinstance(cfg, GPTConfig)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_ff, cfg.seq_len) == (
        1024, 24, 16, 4096, 512,
    )  # fmt: skip
    assert cfg.vocab_size == 8192  # the preset's
    assert tokens_per_sample(cfg) == 512
    mlp = bench_model("mlp_tiny", opts.model_overrides)  # not a GPT: flags ignored
    assert mlp == MLPConfig(d=32, n_layers=3) and tokens_per_sample(mlp) is None
    with pytest.raises(ValueError, match="unknown model"):
        bench_model("gpt_huge")


@pytest.mark.parametrize(
    "system,dp,want",
    [
        ("no_comm", 1, 16.0),  # 4 param + 4 grad + 8 Adam moments
        ("torch_ddp_gabv", 4, 16.0),
        ("megabuf_ar_overlap", 2, 16.0),
        ("torch_ddp", 2, 20.0),  # + 4: grads copied into DDP's buckets
        ("zero_ddp", 4, 14.0),  # 4 + 4 + 4 + 8/4
        ("fsdp2_reshard", 4, 4.0),  # 16/4
        ("fsdp2_no_reshard", 1, 16.0),
        ("megabuf_distopt_sync", 4, 10.0),  # 4 + 4 + 8/4
        ("megabuf_distopt_overlap", 1, 16.0),
    ],
)
def test_state_bytes_per_param(system: str, dp: int, want: float) -> None:
    assert state_bytes_per_param(system, dp) == want


def test_state_formula_rejects_unknown_systems_and_dp() -> None:
    with pytest.raises(ValueError, match="no memory formula"):
        state_bytes_per_param("deepspeed", 2)
    with pytest.raises(ValueError, match="dp_size"):
        state_bytes_per_param("no_comm", 0)


def _rank(system: str, rank: int, peak_mib: int) -> dict[str, object]:
    return {
        "status": "ok", "model": "gpt_small", "system": system, "rank": rank,
        "batch_per_rank": 8, "step_ms": 200.0, "peak_rss_bytes": 1, "optimizer_state_nbytes": 1,
        "check_max_abs_error": None, "peak_cuda_bytes": peak_mib * MiB, "tokens_per_sample": 128,
        "state_bytes_per_param": 10.0, "state_formula_bytes": 100 * MiB,
        "overlap": {"median_exposed_ms": 1.234} if system.startswith("megabuf") else None,
    }  # fmt: skip


def test_cuda_table_shows_tokens_peak_vs_formula_and_exposed_comm() -> None:
    rows = [
        combine_ranks([_rank("torch_ddp_gabv", r, 300 + r) for r in range(2)]),
        combine_ranks([_rank("megabuf_distopt_overlap", r, 250) for r in range(2)]),
        {"model": "gpt_small", "system": "fsdp2_reshard", "status": "failed"},
    ]
    assert rows[0]["peak_cuda_bytes"] == 301 * MiB  # the largest rank
    add_ratios(rows, world_size=2)
    # 8 samples per rank * 2 ranks / 0.2 s = 80 samples/s, * 128 tokens
    assert rows[1]["tokens_per_s"] == pytest.approx(10240.0)
    lines = cuda_table(rows).splitlines()
    assert len(lines) == 4  # header, rule, two ok rows (the failed one is left out)
    cells = {c[1]: c for c in ([x.strip() for x in line.split("|")[1:-1]] for line in lines[2:])}
    assert cells["megabuf_distopt_overlap"][2:] == [
        "200.0", "1.00", "10240", "250", "100", "10", "150", "1.23",
    ]  # fmt: skip
    assert cells["torch_ddp_gabv"][4:] == ["10240", "301", "100", "10", "201", "-"]


def test_cuda_table_is_empty_for_cpu_runs() -> None:
    row = _rank("no_comm", 0, 1)
    del row["peak_cuda_bytes"]
    assert cuda_table([combine_ranks([row])]) == ""
