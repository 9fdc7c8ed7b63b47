"""GPU tier of the rank-side cases (`make test-gpu`): the suite's grad, optimizer, pipeline and
expert cases with device="cuda" (tests/gpu_cases.py), on
- NCCL at world size 1 (one GPU): DDP grads, distributed optimizer steps with overlapped param
  gathers, bf16 params with fp32 main grads, the pipeline with one stage, the per-token loss;
- gloo ranks sharing cuda:0 (2 and 4 of them): the all-reduce path only (gloo runs neither
  all-to-all nor point-to-point on CUDA tensors);
- NCCL at world size 2 (two GPUs): the distributed optimizer, pipelines (pp=2) and experts (ep=2);
plus race windows (`torch.cuda._sleep` before finish_grad_sync() and before the step with
overlap_param_gather) compared bitwise with CUDA_LAUNCH_BLOCKING=1 runs, and checkpoints saved on
GPU and loaded into CPU models. Skipped without CUDA; ran once on one H100 (2026-11-26, torch
2.11.0+cu130: 38 of 39 world-1 cases passed; see [Note: fused CUDA Adam bound]). The same code
runs with device="cpu" in tests/test_device_cases.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from gpu_cases import (
    check_sweep,
    checkpoint_crosses_devices,
    env_probe,
    race_windows_match_launch_blocking,
    rank_cases,
    sweep,
)
from inbound_scale_cases import check_large_grads_scaled, check_unscaled_paths
from inbound_scale_cases import run_cases as inbound_cases
from small_grad_cases import check_all as check_small_grads
from small_grad_cases import run_cases as small_grad_cases

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device (none on this machine)"),
]
needs_2_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 CUDA devices for NCCL ({GPUS} on this machine)"
)


def test_nccl_world_size_1_runs_every_case_on_cuda(pools: Any) -> None:
    pool = pools(1, "nccl")
    probe = pool.run(env_probe, [])
    assert probe[0]["backend"] == "cuda:nccl" and probe[0]["cuda_device"] == 0, probe
    cases = rank_cases("cuda", 1, allreduce_only=False)
    check_sweep(cases, pool.run(run_each, sweep(cases)), "nccl x1", "native")


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda ws: f"gloo{ws}")
def test_gloo_ranks_sharing_one_gpu_all_reduce(pools: Any, world_size: int) -> None:
    """Several gloo ranks on cuda:0: grads and MixedPrecisionOptimizer steps (all-reduce)."""
    pool = pools(world_size, "gloo")
    assert {p["cuda_device"] for p in pool.run(env_probe, [])} == {0}
    cases = rank_cases("cuda", world_size, allreduce_only=True)
    check_sweep(cases, pool.run(run_each, sweep(cases)), f"gloo-cuda x{world_size}", "native")


def test_gloo_ranks_sharing_one_gpu_scale_inbound_and_accumulate_small_grads_in_place(
    pools: Any,
) -> None:
    """[Note: scale on the way in] and [Note: small grads accumulate in place] with CUDA grads
    (torch.mul(out=), add_(alpha=), foreach zeroing on the device): the CPU tests' cases and
    assertions (tests/test_inbound_scale.py, tests/test_small_grads.py) on 2 gloo ranks."""
    per_rank = pools(2, "gloo").run(
        run_each, {"inbound": (inbound_cases, "cuda"), "small": (small_grad_cases, "cuda")}
    )
    inbound = case_result(per_rank, "inbound")
    check_large_grads_scaled(inbound)
    check_unscaled_paths(inbound)
    check_small_grads(case_result(per_rank, "small"))


@needs_2_gpus
def test_nccl_two_gpus_pipeline_experts_distributed_optimizer(pools: Any) -> None:
    pool = pools(2, "nccl")
    assert [p["cuda_device"] for p in pool.run(env_probe, [])] == [0, 1]
    cases = rank_cases("cuda", 2, allreduce_only=False)
    check_sweep(cases, pool.run(run_each, sweep(cases)), "nccl x2", "native")


@pytest.mark.parametrize(
    ("backend", "world_size"),
    [
        ("nccl", 1),
        ("gloo", 2),
        pytest.param("nccl", 2, marks=needs_2_gpus),
    ],
)
def test_race_windows_match_launch_blocking(pools: Any, backend: str, world_size: int) -> None:
    race_windows_match_launch_blocking(
        pools, world_size, backend, "cuda", allreduce_only=backend == "gloo"
    )


@pytest.mark.parametrize(
    "world_size", [1, pytest.param(2, marks=needs_2_gpus)], ids=lambda ws: f"ws{ws}"
)
def test_checkpoint_saved_on_gpu_loads_on_cpu(pools: Any, world_size: int, tmp_path: Path) -> None:
    checkpoint_crosses_devices(
        pools(world_size, "nccl"), "cuda", pools(world_size, "gloo"), "cpu", str(tmp_path)
    )
