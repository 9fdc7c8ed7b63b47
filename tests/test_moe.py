"""Expert parallelism on 4 gloo ranks (ep 2 x expt_dp 2, and ep 4): grads after
finalize_model_grads equal the whole MoE model's on the global batch; expert grads are reduced over
expt_dp and dense grads over dp; the global grad norm with experts equals the reference's."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from moe_cases import grads_case, norm_case, rank_value_case

from megabuf.transport.process_groups import rank_layout

ATOL = 2e-6
OVERLAP = {"overlap_grad_reduce": True, "bucket_size": 64}
DISTOPT = {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 200}
GRAD_CASES: dict[str, dict[str, Any]] = {
    "ep2_sync": {"ep": 2},
    "ep2_overlap": {"ep": 2, "config": OVERLAP},
    "ep2_avg_in_collective": {"ep": 2, "config": {**OVERLAP, "average_in_collective": True}},
    "ep2_distopt": {"ep": 2, "config": DISTOPT},
    "ep2_per_token_loss": {"ep": 2, "config": OVERLAP, "per_token": True},
    "ep2_distopt_per_token_avg": {
        "ep": 2,
        "config": {**DISTOPT, "average_in_collective": True},
        "per_token": True,
    },
    "ep4_sync": {"ep": 4},
    "ep4_distopt": {"ep": 4, "config": DISTOPT},
    "ep1_overlap": {"ep": 1, "config": OVERLAP},
}
RANK_VALUE_CASES: dict[str, dict[str, Any]] = {
    "rv_ep2_sync": {"ep": 2},
    "rv_ep2_distopt": {"ep": 2, "config": DISTOPT | {"overlap_grad_reduce": False}},
    "rv_ep2_avg": {"ep": 2, "config": {"average_in_collective": True}},
}
NORM_CASES: dict[str, dict[str, Any]] = {
    "norm_ep2": {"ep": 2, "config": OVERLAP},
    "norm_ep4": {"ep": 4},
    "norm_ep2_distopt": {"ep": 2, "config": DISTOPT},
}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases = {n: (grads_case, c) for n, c in GRAD_CASES.items()}
    cases |= {n: (rank_value_case, c) for n, c in RANK_VALUE_CASES.items()}
    cases |= {n: (norm_case, c) for n, c in NORM_CASES.items()}
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", GRAD_CASES)
def test_grads_match_whole_model_reference(results: Any, name: str) -> None:
    case = GRAD_CASES[name]
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= ATOL, f"{name} rank {rank}: {worst[0]} off by {worst[1]:.3g}"
        n_local = 4 // case["ep"]
        assert res["n_expert_params"] == 4 * n_local, name  # 4 params per expert
        assert res["expert_groups_reduce_over_expt_dp"], name
        assert (res["all_to_all_bytes"] > 0) == (case["ep"] > 1), name
    # the shards of all ranks together cover every param
    covered = set().union(*(res["errors"] for res in per_rank))
    assert len(covered) == 5 + 4 * 4, (name, sorted(covered))  # embed, head, router + 4 experts


@pytest.mark.parametrize("name", RANK_VALUE_CASES)
def test_dense_grads_reduce_over_dp_and_expert_grads_over_expt_dp(results: Any, name: str) -> None:
    layout = rank_layout(4, ep_size=RANK_VALUE_CASES[name]["ep"])
    for rank, seen in enumerate(case_result(results, name)):
        dp = next(g for g in layout["dp"] if rank in g)
        expt_dp = next(g for g in layout["expt_dp"] if rank in g)
        assert seen["dense"] == [round(sum(r + 1 for r in dp) / 4, 6)], (name, rank, seen)
        assert seen["expert"] == [round(sum(r + 1 for r in expt_dp) / 4, 6)], (name, rank)


@pytest.mark.parametrize("name", NORM_CASES)
def test_global_grad_norm_with_experts_matches_reference(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert abs(res["got"] - res["want"]) <= 1e-5 * res["want"], (name, rank, res)
        assert abs(res["optimizer"] - res["want"]) <= 1e-5 * res["want"], (name, rank, res)
