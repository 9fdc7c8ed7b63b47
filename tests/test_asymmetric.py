"""Asymmetric multi-rank scenarios: ranks that disagree on readiness order, token counts, owned
experts and micro-batch contents, each against a single-process reference that replays every
rank's work (tests/asymmetric_cases.py). A symmetric test passes whatever a rank-local shortcut
does; each test here names the cross-rank claim it pins and failed with the bug it was written
against planted in a copy of megabuf."""

from __future__ import annotations

from typing import Any

import pytest
from asymmetric_cases import MOE_OPTIMIZERS, PER_TOKEN, run_moe, run_world2
from dist_pool import case_result


@pytest.fixture(scope="module")
def world2(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_world2)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def moe(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_moe)  # type: ignore[no-any-return]


def test_groups_ready_in_different_orders_on_different_ranks_dispatch_in_chain_order(
    world2: list[dict[str, Any]],
) -> None:
    """Claim: bucket groups are dispatched in the fixed DispatchChain order on every rank, not
    in the order autograd makes them ready ([Note: dispatch order]). Rank 0 applies the layers
    a, b, c and rank 1 c, b, a, so backward makes their groups ready in opposite orders;
    dispatching in readiness order would pair rank 0's `c` bucket with rank 1's `a` bucket."""
    for rank, res in enumerate(case_result(world2, "dispatch_order")):
        assert res["groups"] == 3, res
        # the learning iteration dispatches nothing during backward; later ones all of it
        assert res["early"] == [0, 3, 3], (rank, res)
        assert res["errors"] == [0.0, 0.0, 0.0], (rank, res)  # dp=2: bitwise


@pytest.mark.parametrize("name", list(PER_TOKEN))
def test_per_token_loss_with_different_token_counts_per_rank(
    world2: list[dict[str, Any]], name: str
) -> None:
    """Claim: with a summed per-token loss, finalize_model_grads(num_tokens=...) divides by the
    token count summed over dp, so rank 0 with 3 tokens and rank 1 with 5 train exactly as one
    process on all 8 tokens (sum of every token's loss / 8). A count taken as local count x dp
    would scale each rank by a different factor."""
    for rank, res in enumerate(case_result(world2, name)):
        assert res["total"] == 8, res
        assert res["errors"] == [0.0, 0.0], (name, rank, res)  # powers of two: bitwise


@pytest.mark.parametrize("name", ["micro_batch", "micro_batch_strict"])
def test_micro_batches_that_use_a_param_differently_on_each_rank(
    world2: list[dict[str, Any]], name: str
) -> None:
    """Claim: under no_sync accumulation with overlap_grad_reduce, a param's grad is everything
    it received since zero_grad_buffer(), in whichever micro-batch: rank 0 uses `extra` only in
    the first micro-batch (so it gets no grad in the last, reducing one), rank 1 only in the
    last. That is legal, strict mode (error_on_unused_params) included: the param is used, and
    its grad equals the reference's, not a zero fill."""
    per_rank = case_result(world2, name)
    for rank, res in enumerate(per_rank):
        assert res["raised"] is None, (name, rank, res["raised"])
        assert res["errors"] == [0.0, 0.0, 0.0], (name, rank, res)  # dp=2: bitwise
        assert bool(res["extra_grad"].abs().sum() > 0), (name, rank)  # not a zero fill


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
