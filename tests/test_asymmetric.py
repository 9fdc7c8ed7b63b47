"""Asymmetric multi-rank scenarios: ranks that disagree on readiness order, token counts, owned
experts and micro-batch contents, each against a single-process reference that replays every
rank's work (tests/asymmetric_cases.py). A symmetric test passes whatever a rank-local shortcut
does; each test here names the cross-rank claim it pins and failed with the bug it was written
against planted in a copy of megabuf."""

from __future__ import annotations

from typing import Any

import pytest
from asymmetric_cases import MOE_OPTIMIZERS, PER_TOKEN, TOKENS, run_dense, run_moe
from dist_pool import case_result

WORLD_SIZES = [2, 4]
TOLERANCE = {2: 0.0, 4: 1e-6}  # dp=2: bitwise; dp=4: gloo's summation order


def assert_grads_match(per_rank: list[dict[str, Any]], steps: int, num_params: int) -> None:
    """`errors[step][param]` (per rank) within the world size's tolerance, and together the
    ranks checked every param at every step (with the distributed optimizer a rank checks only
    the params in its shards, possibly none)."""
    tolerance = TOLERANCE[len(per_rank)]
    for rank, res in enumerate(per_rank):
        assert len(res["errors"]) == steps, (rank, res)
        worst = max((e for step in res["errors"] for e in step.values()), default=0.0)
        assert worst <= tolerance, (rank, res["errors"])
    for step in range(steps):
        checked = set().union(*(res["errors"][step] for res in per_rank))
        assert len(checked) == num_params, (step, sorted(checked))


@pytest.fixture(scope="module")
def dense(pools: Any) -> dict[int, list[dict[str, Any]]]:
    return {ws: pools(ws).run(run_dense) for ws in WORLD_SIZES}


@pytest.fixture(scope="module")
def moe(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_moe)  # type: ignore[no-any-return]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_groups_ready_in_different_orders_on_different_ranks_dispatch_in_chain_order(
    dense: dict[int, list[dict[str, Any]]], world_size: int
) -> None:
    """Claim: bucket groups are dispatched in the fixed DispatchChain order on every rank, not
    in the order autograd makes them ready ([Note: dispatch order]). Rank 0 applies the layers
    a, b, c and rank 1 c, b, a, so backward makes their groups ready in opposite orders;
    dispatching in readiness order would pair rank 0's `c` bucket with rank 1's `a` bucket."""
    per_rank = case_result(dense[world_size], "dispatch_order")
    for rank, res in enumerate(per_rank):
        assert res["groups"] == 3, res
        # the learning iteration dispatches nothing during backward; later ones all of it
        assert res["early"] == [0, 3, 3], (rank, res)
    assert_grads_match(per_rank, steps=3, num_params=3)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_per_token_loss_with_different_token_counts_per_rank(
    dense: dict[int, list[dict[str, Any]]], name: str, world_size: int
) -> None:
    """Claim: with a summed per-token loss, finalize_model_grads(num_tokens=...) divides by the
    token count summed over dp: ranks holding 3, 5 (and at world size 4 also 2, 6) tokens train
    exactly as one process on all of them (sum of every token's loss / total tokens). A count
    taken as local count x dp would scale each rank by a different factor."""
    per_rank = case_result(dense[world_size], name)
    for res in per_rank:
        assert res["total"] == sum(TOKENS[:world_size]), res  # 8 or 16: exact scaling
    assert_grads_match(per_rank, steps=2, num_params=4)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["micro_batch", "micro_batch_strict"])
def test_micro_batches_that_use_a_param_differently_on_each_rank(
    dense: dict[int, list[dict[str, Any]]], name: str, world_size: int
) -> None:
    """Claim: under no_sync accumulation with overlap_grad_reduce, a param's grad is everything
    it received since zero_grad_buffer(), in whichever micro-batch: rank 0 uses `extra` only in
    the first micro-batch (so it gets no grad in the last, reducing one), rank 1 only in the
    last. That is legal, strict mode (error_on_unused_params) included: the param is used, and
    its grad equals the reference's, not a zero fill."""
    per_rank = case_result(dense[world_size], name)
    for rank, res in enumerate(per_rank):
        assert res["raised"] is None, (name, rank, res["raised"])
        assert bool(res["extra_grad"].abs().sum() > 0), (name, rank)  # not a zero fill
    assert_grads_match(per_rank, steps=3, num_params=6)


@pytest.mark.parametrize("kind", MOE_OPTIMIZERS)
def test_expert_grad_norm_through_the_optimizer_clips_like_the_whole_model(
    moe: list[dict[str, Any]], kind: str
) -> None:
    """Claim: at ep_size 2 (4 ranks: 2 ep x 2 expt_dp), the optimizer's own global grad norm sums
    the expert part over the ep group ([Note: global grad norm]), where ep ranks own different
    experts with different grads: every rank returns the same norm, equal to torch's
    clip_grad_norm_ over all params of the whole model, and two clipped SGD steps leave every
    param (dense and expert) as the whole model's."""
    per_rank = case_result(moe, f"moe_clip_{kind}")
    expected_class = {"distributed": "DistributedOptimizer", "mixed_precision":
                      "MixedPrecisionOptimizer", "fp32_built": "FP32Optimizer"}[kind]  # fmt: skip
    for rank, res in enumerate(per_rank):
        assert res["optimizer"] == expected_class, res["optimizer"]
        for step, norm in enumerate(res["norms"]):
            assert norm["ok"], (kind, rank, step, norm)
            assert norm["want"] > 10 * 0.05, norm  # the reference clips: the norm matters
            assert abs(norm["got"] - norm["want"]) <= 1e-5 * norm["want"], (kind, rank, norm)
            # every rank computed the same norm (bitwise: one set of all-reduces)
            assert norm["got"] == per_rank[0]["norms"][step]["got"], (kind, rank, step)
        worst = max(res["param_errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (kind, rank, worst)
    covered = set().union(*(res["param_errors"] for res in per_rank))
    assert len(covered) == 5 + 4 * 4, sorted(covered)  # embed, head, router + 4 experts x 4
