"""After finish_grad_sync(), every rank's grads equal a single-process reference on the global
batch (gloo ranks, world sizes 1, 2 and 4), on gloo's own collective path (all-to-all + p2p) and,
for the `native_*` cases, on the path NCCL takes (native reduce-scatter, emulated AVG)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from grad_cases import grad_case

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

# The same cases with gloo forced onto NCCL's strategy, against the same references.
NATIVE_OF = [
    "sync_one_bucket",
    "distopt_reduce_scatter",
    "distopt_overlap",
    "average_in_collective",
    "distopt_avg",
    "mixed_fp32_bf16_fp32_grads",
    "mixed_distopt",
]
BASE_CASES = {**CASES, **BF16_CASES}
NATIVE_CASES = {f"native_{name}": {**BASE_CASES[name], "native": True} for name in NATIVE_OF}
ALL_CASES = {**BASE_CASES, **NATIVE_CASES}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda ws: f"dp{ws}")
def results(request: Any, pools: Any) -> list[dict[str, Any]]:
    cases = {name: (grad_case, case) for name, case in ALL_CASES.items()}
    return pools(request.param).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", ALL_CASES)
def test_grads_match_single_process_reference(results: Any, name: str) -> None:
    """Every element within its own bound: FP32_ATOL for fp32 grads, the bf16 rounding of the
    local and global grads for bf16 ones ([Note: bf16 grad bound] in grad_cases.py)."""
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        worst = max(res["ratios"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        err = res["errors"].get(worst[0], 0.0)
        assert worst[1] <= 1.0, (
            f"{name} rank {rank}: {worst[0]} off by {err:.3g}, {worst[1]:.3g}x its bound"
        )
        assert res["linked"], f"{name}: param.grad is not main_grad (None with distopt)"
        want = "native" if name.startswith("native_") else "all_to_all"
        assert res["reduce_scatter"] == want, f"{name} ran the {res['reduce_scatter']} strategy"
    # the shards of all ranks cover every param
    checked = set().union(*(res["errors"] for res in per_rank))
    assert checked == set(per_rank[0]["all_params"]), name


@pytest.mark.parametrize("name", ["frozen"])
def test_frozen_params_get_no_buffer_and_no_grad(results: Any, name: str) -> None:
    per_rank = case_result(results, name)
    assert "frozen.weight" not in per_rank[0]["all_params"], per_rank[0]["all_params"]
    for rank, res in enumerate(per_rank):
        assert res["frozen_ok"], f"rank {rank}: frozen params got a buffer or a grad"


@pytest.mark.parametrize(
    "name", ["mixed_fp32_bf16_fp32_grads", "native_mixed_fp32_bf16_fp32_grads"]
)
def test_bf16_params_get_their_grad_copy(results: Any, name: str) -> None:
    """[Note: grad contract]: a bf16 param with an fp32 main_grad has `.grad` equal to
    main_grad.to(bf16) after finish_grad_sync() on every rank (not only main_grad)."""
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        copies = res["grad_copies"]
        assert set(copies) == {"tail.weight", "tail.bias"}, copies
        bad = [n for n, ok in copies.items() if not ok]
        assert not bad, f"{name} rank {rank}: .grad is not main_grad.to(bf16) for {bad}"


def test_mixed_dtypes_get_two_buffers(results: Any) -> None:
    mixed = case_result(results, "mixed_fp32_bf16_fp32_grads")[0]
    assert mixed["n_buffers"] == 2  # (fp32, fp32) and (bf16, fp32)


def test_one_param_per_bucket_gives_many_bucket_groups(results: Any) -> None:
    assert case_result(results, "overlap_param_per_bucket")[0]["n_groups"] > 5


def test_disable_bucketing_gives_one_bucket_group(results: Any) -> None:
    assert case_result(results, "disable_bucketing")[0]["n_groups"] == 1
