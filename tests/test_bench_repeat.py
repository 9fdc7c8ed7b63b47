"""The GPU benchmark's run plan (issue 24), on CPU: repeated passes alternate the order of the
systems and ratios to torch DDP are taken pass by pass (median, with the half range); each
system runs in fresh processes unless --no-isolate, where rows that start with memory left by an
earlier system are flagged; megatron-core's peers are skipped with a printed reason when
megatron.core does not import or the run is not on CUDA."""

from __future__ import annotations

import builtins
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from megabuf.bench import main as bench_main
from megabuf.bench import mcore
from megabuf.bench.options import parse_options
from megabuf.bench.report import Progress, add_ratios, inherited_memory_note
from megabuf.bench.systems import NotAvailable
from megabuf.transport.process_groups import ProcessGroups

SYSTEMS = "no_comm,torch_ddp_gabv,megabuf_ar_overlap"


def test_pass_order_alternates() -> None:
    assert [bench_main.pass_order(3, r) for r in range(4)] == [[0, 1, 2], [2, 1, 0]] * 2


def _fake_spawn(launches: list[list[str]], slow_pass: int) -> Any:
    """Stands in for `megabuf.testing.spawn(run_jobs, world, jobs)`: records each launch's
    systems; step times: DDP 10 ms, megabuf 9 ms, the floor 8 ms, all 3x in pass `slow_pass`."""
    base = {"no_comm": 8.0, "torch_ddp_gabv": 10.0, "megabuf_ar_overlap": 9.0}

    def spawn(fn: Any, world: int, jobs: list[Any]) -> list[list[dict[str, Any]]]:
        launches.append([j.system for j in jobs])
        slow = 3.0 if sum(len(x) for x in launches[:-1]) // 3 == slow_pass else 1.0
        rows = [
            {"model": j.model, "system": j.system, "status": "ok", "rank": 0,
             "batch_per_rank": j.batch_per_rank, "step_ms": base[j.system] * slow,
             "phase_ms": {}, "cpu_s": 0.0, "wall_s": 1.0, "peak_rss_bytes": 1,
             "optimizer_state_nbytes": 1, "check_max_abs_error": 0.0}
            for j in jobs
        ]  # fmt: skip
        return [rows for _ in range(world)]

    return spawn


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "one_launch_per_pass"])
def test_passes_alternate_and_ratios_are_per_pass(
    monkeypatch: pytest.MonkeyPatch, isolate: bool
) -> None:
    argv = ["--models", "gpt_tiny:2", "--systems", SYSTEMS, "--repeat", "3", "--hooks", "none"]
    opts = parse_options(argv + ([] if isolate else ["--no-isolate"]))
    launches: list[list[str]] = []
    monkeypatch.setattr(bench_main, "spawn", _fake_spawn(launches, slow_pass=1))
    refs: dict[str, Any] = {"gpt_tiny": None}  # the fake ranks check nothing
    jobs = bench_main.make_jobs(opts, refs, Progress(3, stream=io.StringIO()))
    rows = bench_main.run_all(opts, jobs, Progress(3, stream=io.StringIO()))
    order = [s for launch in launches for s in launch]
    names = SYSTEMS.split(",")
    assert order == names + names[::-1] + names
    assert len(launches) == (9 if isolate else 3)
    add_ratios(rows, opts.world_size)
    by = {r["system"]: r for r in rows}
    # the slow pass slowed every system alike: every per-pass ratio is the same
    assert by["megabuf_ar_overlap"]["ratio_to_ddp_runs"] == pytest.approx([0.9] * 3)
    assert by["megabuf_ar_overlap"]["ratio_to_ddp"] == pytest.approx(0.9)
    assert by["megabuf_ar_overlap"]["step_ms_runs"] == pytest.approx([9.0, 27.0, 9.0])


def test_inherited_memory_is_flagged() -> None:
    rows = [
        {"system": "megabuf_ar_overlap", "cuda_bytes_at_start": 0},
        {"system": "megabuf_zero2", "cuda_bytes_at_start": 700 * 2**20},
    ]
    note = inherited_memory_note(rows)
    assert "megabuf_zero2 700 MiB" in note and "megabuf_ar_overlap" not in note
    assert inherited_memory_note(rows[:1]) == ""


def _no_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def fake(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    monkeypatch.setattr(mcore.importlib, "import_module", lambda name: fake(name))


def test_megatron_core_peers_skip_with_a_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opts = parse_options(["--systems", "no_comm,mcore_ddp_overlap,mcore_distopt_overlap"])
    assert bench_main.available_systems(opts) == ("no_comm",)
    out = capsys.readouterr().out
    for name in mcore.MCORE_SYSTEMS:
        assert f"skipping system {name}: megatron-core peers run with --device cuda only" in out
    _no_megatron(monkeypatch)
    reason = mcore.unavailable_reason("cuda")
    assert reason is not None and "megatron.core does not import" in reason
    assert "install megatron-core" in reason
    pgs = ProcessGroups.__new__(ProcessGroups)
    with pytest.raises(NotAvailable, match="--device cuda only"):
        mcore.build_mcore("mcore_ddp_overlap", torch.nn.Linear(2, 2), pgs)


def test_repeated_run_end_to_end(tmp_path: Path) -> None:
    """Two passes in one launch each on CPU: both passes recorded, per-pass ratios reported."""
    out = tmp_path / "bench.jsonl"
    code = bench_main.main([
        "--models", "gpt_tiny:2", "--systems", SYSTEMS, "--repeat", "2", "--no-isolate",
        "--warmup", "0", "--steps", "1", "--world-size", "1", "--hooks", "none",
        "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    by = {r["system"]: r for r in rows}
    assert len(by["megabuf_ar_overlap"]["step_ms_runs"]) == 2
    assert len(by["megabuf_ar_overlap"]["ratio_to_ddp_runs"]) == 2


def _live_tensor_nbytes() -> int:
    import gc

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _one_launch_leftovers(systems: list[str]) -> dict[str, int]:
    """Rank side: bytes of live tensors after each system of one launch ran and returned."""
    import warnings

    from megabuf.bench import worker

    warnings.simplefilter("ignore")
    opts = parse_options(["--no-isolate", "--world-size", "1", "--models", "gpt_tiny:2",
                          "--warmup", "0", "--steps", "1", "--hooks", "none",
                          "--systems", ",".join(systems)])  # fmt: skip
    jobs = bench_main.make_jobs(opts, {"gpt_tiny": None}, Progress(1, stream=io.StringIO()))  # type: ignore[dict-item]
    pgs = __import__("megabuf").init_distributed(device="cpu")
    out = {"before": _live_tensor_nbytes()}
    for job in jobs:
        worker.run_job(job, pgs)
        out[job.system] = _live_tensor_nbytes()
    return out


def test_no_system_outlives_its_run_in_one_launch() -> None:
    """What [Note: peak CUDA memory per system] says about --no-isolate, measured on CPU: no
    system leaves anything allocated after its run (megabuf systems did, until [Note: hooks hold
    the engine weakly])."""
    from megabuf.testing import spawn

    systems = ["torch_ddp_gabv", "fsdp2_reshard", "megabuf_ar_overlap", "megabuf_distopt_overlap"]
    (got,) = spawn(_one_launch_leftovers, 1, systems, timeout_s=300)
    assert abs(got["torch_ddp_gabv"] - got["before"]) < 1024, got
    assert abs(got["fsdp2_reshard"] - got["before"]) < 1024, got
    assert abs(got["megabuf_ar_overlap"] - got["before"]) < 1024, got
    assert abs(got["megabuf_distopt_overlap"] - got["before"]) < 1024, got
