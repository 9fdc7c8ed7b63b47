"""After finish_grad_sync(), every rank's grads equal a single-process reference on the global
batch (gloo ranks, world sizes 1, 2 and 4)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from grad_cases import grad_case

FP32_ATOL = 1e-6
BF16_RTOL = 2e-2  # bf16 params, fp32 grad reduction: local bf16 backward rounding dominates

CASES: dict[str, dict[str, Any]] = {
    "sync_one_bucket": {},
    "overlap_param_per_bucket": {"config": {"overlap_grad_reduce": True, "bucket_size": 1}},
    "overlap_mid_buckets": {"config": {"overlap_grad_reduce": True, "bucket_size": 150}},
    "overlap_default_buckets": {"config": {"overlap_grad_reduce": True}},
    "overlap_one_bucket": {"config": {"overlap_grad_reduce": True, "bucket_size": 10**9}},
    "sync_param_per_bucket": {"config": {"bucket_size": 1}},
    "disable_bucketing": {"config": {"overlap_grad_reduce": True}, "disable_bucketing": True},
    "frozen": {"config": {"overlap_grad_reduce": True, "bucket_size": 100}, "frozen": True},
    "no_sync_4_micro": {
        "config": {"overlap_grad_reduce": True, "bucket_size": 100},
        "micro_batches": 4,
    },
    "no_sync_4_micro_sync": {"micro_batches": 4},
    "accumulate_two_backwards": {"config": {"overlap_grad_reduce": True}, "backwards": 2},
    "average_in_collective": {
        "config": {"overlap_grad_reduce": True, "average_in_collective": True}
    },
    "distopt_reduce_scatter": {"config": {"use_distributed_optimizer": True, "bucket_size": 200}},
    "distopt_overlap": {
        "config": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 1}
    },
    "distopt_avg": {
        "config": {
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "average_in_collective": True,
        }
    },
}
BF16_CASES: dict[str, dict[str, Any]] = {
    "mixed_fp32_bf16_fp32_grads": {
        "bf16": True,
        "config": {"overlap_grad_reduce": True, "grad_reduce_in_fp32": True, "bucket_size": 100},
    },
    "mixed_distopt": {
        "bf16": True,
        "config": {
            "use_distributed_optimizer": True,
            "overlap_grad_reduce": True,
            "grad_reduce_in_fp32": True,
        },
    },
}


ALL_CASES = {**CASES, **BF16_CASES}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda ws: f"dp{ws}")
def results(request: Any, pools: Any) -> list[dict[str, Any]]:
    cases = {name: (grad_case, case) for name, case in ALL_CASES.items()}
    return pools(request.param).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ALL_CASES)
def test_grads_match_single_process_reference(results: Any, name: str) -> None:
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        tol = BF16_RTOL * res["scale"] if name in BF16_CASES else FP32_ATOL
        worst = max(res["errors"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        assert worst[1] <= tol, f"{name} rank {rank}: {worst[0]} off by {worst[1]:.3g}"
        assert res["linked"], f"{name}: param.grad is not the main_grad view"
        assert res["frozen_ok"], f"{name}: frozen params got a buffer or a grad"
    # the shards of all ranks cover every param
    checked = set().union(*(res["errors"] for res in per_rank))
    assert checked == set(per_rank[0]["all_params"]), name


def test_mixed_dtypes_get_two_buffers(results: Any) -> None:
    mixed = case_result(results, "mixed_fp32_bf16_fp32_grads")[0]
    assert mixed["n_buffers"] == 2  # (fp32, fp32) and (bf16, fp32)


def test_one_param_per_bucket_gives_many_bucket_groups(results: Any) -> None:
    assert case_result(results, "overlap_param_per_bucket")[0]["n_groups"] > 5


def test_disable_bucketing_gives_one_bucket_group(results: Any) -> None:
    assert case_result(results, "disable_bucketing")[0]["n_groups"] == 1
