"""The GPU tier's device-parametrised sweeps (tests/gpu_cases.py), run here with device="cpu" on
gloo: the rank-side cases with a "device" key, the race windows with and without
CUDA_LAUNCH_BLOCKING in the ranks' environment, and a checkpoint saved by one set of processes
and loaded by another at another world size. The same code runs with device="cuda" in
tests/test_gpu_tier.py; passing here shows the plumbing, not CUDA's behaviour."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from case_devices import case_device, race_window
from dist_pool import run_each
from gpu_cases import (
    check,
    check_sweep,
    checkpoint_crosses_devices,
    race_windows_match_launch_blocking,
    rank_cases,
    sweep,
)


@pytest.mark.parametrize("world_size", [1, 2], ids=lambda ws: f"ws{ws}")
def test_device_sweep_on_cpu(pools: Any, world_size: int) -> None:
    """Every case the GPU tier runs at this world size, on CPU tensors over gloo."""
    cases = rank_cases("cpu", world_size, allreduce_only=False)
    kinds = {kind for kind, _ in cases.values()}
    assert kinds == {"grad", "equal", "overlap", "pipeline", "moe"}, kinds
    results = pools(world_size).run(run_each, sweep(cases))
    check_sweep(cases, results, f"cpu gloo x{world_size}", "all_to_all")


def test_allreduce_only_sweep_has_no_all_to_all_or_p2p_cases() -> None:
    """Gloo on CUDA runs all-reduce and broadcast only: no distributed optimizer, pipeline or
    expert case may reach the sweep the ranks sharing one GPU run."""
    cases = rank_cases("cuda", 2, allreduce_only=True)
    assert {kind for kind, _ in cases.values()} == {"grad", "equal"}, cases.keys()
    for name, (_, case) in cases.items():
        ddp = case.get("config", case.get("ddp", {}))
        assert not ddp.get("use_distributed_optimizer"), name
        assert case["device"] == "cuda", name
    full = rank_cases("cuda", 2, allreduce_only=False)
    assert any(name.startswith("pipeline:1f1b") for name in full), full.keys()
    assert any(name.startswith("moe:ep2") for name in full), full.keys()


def test_race_windows_match_launch_blocking_on_cpu(pools: Any) -> None:
    race_windows_match_launch_blocking(pools, 2, "gloo", "cpu", allreduce_only=False)


def test_checkpoint_saved_by_one_world_loads_in_another_on_cpu(pools: Any, tmp_path: Path) -> None:
    checkpoint_crosses_devices(pools(1), "cpu", pools(2), "cpu", str(tmp_path))


def test_case_device_and_race_window_on_cpu() -> None:
    assert case_device({}) == torch.device("cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
        case_device({"device": "tpu"})
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            case_device({"device": "cuda"})
    assert not race_window({}, "step")
    assert race_window({"sleep_cycles": {"step": 1000}}, "step")
    assert not race_window({"sleep_cycles": {"step": 1000}}, "finish_grad_sync")


def test_checks_fail_on_a_wrong_param_or_strategy() -> None:
    """The GPU tier's checks can fail: a param off by 1e-3 or the wrong collective strategy."""
    res = {"strategy": ("native", "native"), "errors": {"w": 1e-3}, "norms": [], "zeros": []}
    with pytest.raises(AssertionError, match="w"):
        check("equal", {}, [res], "case", "native")
    with pytest.raises(AssertionError, match="strategy"):
        check("equal", {}, [{**res, "errors": {"w": 0.0}}], "case", "all_to_all")
    check("equal", {}, [{**res, "errors": {"w": 0.0}}], "case", "native")
