"""The combination matrix's cells (docs/CLAIMS.md, "Combination matrix") on 4 gloo ranks: the NaN
check, clipping, loss scaling and the Reduce comm hook under every sharding strategy at dp 4,
at ep 2 (dp 4, expert dp 2: a wrong group or a wrong rank within a group changes the result),
at pp 2 and at pp 2 x ep 2 (expert dp 1 != dp 2), each against the whole model stepped in one
process (tests/matrix_cases.py). One pool call runs every case (~20 s on 2 cores)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result
from matrix_cases import (
    BAD_RANK,
    NAN_CASES,
    SCALE,
    STRATEGIES,
    _bad_param,
    nan_case_name,
    run_ep,
)

OPTIMIZER = {"no_shard": "FP32Optimizer"}  # every sharded strategy: the distributed optimizer


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_ep)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("strategy", "ep", "hook"), NAN_CASES)
def test_nan_in_one_micro_batch_of_one_rank_raises_on_every_rank_naming_it(
    results: Any, strategy: str, ep: int, hook: bool
) -> None:
    """Claim: check_for_nan_in_grad sees a NaN that only rank 1 made, only in micro-batch 1 of 3
    (under no_sync, so later micro-batches add clean grads on top or, with
    reduce_each_microbatch, reduce it before the last one), at ep 2 in one expert only (an
    expert bucket reduced over expert dp {1,3}, which ranks 0 and 2 never see): every rank
    raises, naming global rank 1 and the bucket holding the param; only rank 1 names the param
    as its own. An agreement over expert dp, or flags kept from the last micro-batch only,
    leaves some rank (or every rank) without the error."""
    bad = _bad_param(ep)
    for rank, res in enumerate(case_result(results, nan_case_name(strategy, ep, hook))):
        assert res["fired"] == (rank == BAD_RANK), (rank, res["fired"])
        msg = res["raised"]
        assert msg is not None, f"{strategy} ep{ep}: rank {rank} did not raise"
        assert "NaN or Inf in gradients" in msg and f"on rank(s) [{BAD_RANK}]" in msg, msg
        assert bad in msg.split("This rank")[0], msg  # the bucket line names the param
        own = msg.split("has non-finite grads in: ")[1]
        assert own == (bad if rank == BAD_RANK else "none"), (rank, msg)


@pytest.mark.parametrize(("strategy", "ep", "hook"), NAN_CASES)
def test_after_the_nan_clipped_steps_match_the_whole_model(
    results: Any, strategy: str, ep: int, hook: bool
) -> None:
    """Claim: after the NaN iteration was refused, two clean iterations of 3 micro-batches and a
    clipped SGD step give the grad norm of torch's clip_grad_norm_ over the whole model (the
    expert part summed over ep, each shard counted once over expert dp) and the whole model's
    params, dense and expert, under every strategy (ZeRO-3: expert shards cut by the expert-dp
    rank). With the Reduce() comm hook on every buffer the same."""
    per_rank = case_result(results, nan_case_name(strategy, ep, hook))
    for rank, res in enumerate(per_rank):
        assert res["optimizer"] == OPTIMIZER.get(strategy, "DistributedOptimizer"), res
        for step, norm in enumerate(res["norms"]):
            assert norm["ok"] and norm["want"] > 10 * 0.05, (rank, step, norm)
            assert abs(norm["got"] - norm["want"]) <= 1e-5 * norm["want"], (rank, step, norm)
            assert norm["got"] == per_rank[0]["norms"][step]["got"], (rank, step)
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (strategy, ep, rank, worst)
    covered = set().union(*(res["errors"] for res in per_rank))
    assert len(covered) == 5 + 4 * 4, sorted(covered)  # embed, head, router + 4 experts x 4


def test_periodic_averager_averages_experts_over_expert_dp_only(results: Any) -> None:
    """Claim: LocalSGD's PeriodicAverager averages each param over its bucket's group: dense
    main params over dp (4 ranks), expert main params over expert dp ({0,2} and {1,3}, the
    replicas of the same experts), bitwise the rank-order mean of the stepped replicas. Over dp
    it would mix different experts (ep ranks hold different ones)."""
    for rank, res in enumerate(case_result(results, "averager_ep2")):
        assert res["n_expert_mains"] == 2 * 4, res  # 2 local experts x 4 tensors
        averaged = [e for e in res["log"] if e["averaged"]]
        assert [e["step"] for e in averaged] == [2], res["log"]  # start_step 1, period 2
        for entry in averaged:
            assert entry["experts_differ_across_ep"], entry  # mixing them would show
            assert entry["errors"] == {"dense": 0, "expert": 0}, (rank, entry)


def test_finish_grad_sync_agrees_even_when_backward_finished_every_group(results: Any) -> None:
    """Claim: finish_grad_sync() runs the NaN agreement once per iteration on every rank, even
    when every bucket group is already SYNCED (optim_grads: backward finishes the groups whose
    reduction landed, a timing race). It used to return early then, on the ranks the race hit
    only, leaving the others waiting in the agreement (bug found by the sweep above)."""
    for rank, res in enumerate(case_result(results, "groups_finished_in_backward")):
        assert res["all_synced"] and res["fired"] == (rank == BAD_RANK), (rank, res)
        assert res["raised"] is not None and f"on rank(s) [{BAD_RANK}]" in res["raised"], res


@pytest.mark.parametrize("hook", [False, True])
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_pipeline_with_experts_clipped_steps_match_the_whole_model(
    results: Any, strategy: str, ep: int, hook: bool
) -> None:
    """Claim: pp 2 on 4 ranks (dp 2 per stage; experts on stage 0, at ep 2 over expert dp 1 !=
    dp): 1F1B with 3 micro-batches and overlap, then a clipped SGD step, gives on every rank
    the grad norm of the whole model (both stages, the expert part over ep) and the whole
    model's params on both stages, under every strategy; also with the Reduce() comm hook on
    every buffer."""
    per_rank = case_result(results, f"{strategy}_pp2_ep{ep}{'_reduce_hook' if hook else ''}")
    for rank, res in enumerate(per_rank):
        assert (res["dp_size"], res["expt_dp_size"]) == (2, 2 // ep), res
        for step, norm in enumerate(res["norms"]):
            assert norm["ok"] and norm["want"] > 10 * 0.05, (rank, step, norm)
            assert abs(norm["got"] - norm["want"]) <= 1e-5 * norm["want"], (rank, step, norm)
            assert norm["got"] == per_rank[0]["norms"][step]["got"], (rank, step)
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (strategy, rank, worst)
    assert [r["pp_rank"] for r in per_rank] == [0, 0, 1, 1]
    covered = set().union(*(res["errors"] for res in per_rank))
    assert len(covered) == 5 + 4 * 4, sorted(covered)


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_inf_in_one_expert_on_one_rank_skips_the_scaled_step_everywhere(
    results: Any, strategy: str, ep: int
) -> None:
    """Claim: with a DynamicGradScaler at ep 2, an inf that only rank 1 made, in one expert and
    one micro-batch (so after the expert-dp reduction only ranks 1 and 3 hold it), skips the
    step on every rank and halves the scale; the clean steps then unscale, clip by the whole
    model's norm and grow the scale back, and the params equal the whole model stepped on the
    clean steps only. At ep 1 the inf is in a dense param (dp 4)."""
    per_rank = case_result(results, f"scaler_{strategy}_ep{ep}")
    for rank, res in enumerate(per_rank):
        assert res["fired"] == (rank == BAD_RANK), (rank, res["fired"])
        _skipped_then_clean(res["steps"], res["errors"], f"{strategy} rank {rank}")


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_inf_on_one_pipeline_stage_skips_the_step_on_both(
    results: Any, strategy: str, ep: int
) -> None:
    """Claim: pp 2 (x ep 2) with a DynamicGradScaler: an inf in the head's grad on rank 2 only
    (stage 1, micro-batch 1 of 3) skips the step on every rank of both stages (the found-inf
    flag is reduced over dp and pp) and halves the scale there too; the clean steps then match
    the whole model's."""
    per_rank = case_result(results, f"scaler_{strategy}_pp2_ep{ep}")
    for rank, res in enumerate(per_rank):
        assert res["fired"] == (rank == 2), (rank, res["fired"])
        _skipped_then_clean(res["norms"], res["errors"], f"{strategy} rank {rank}")


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_nan_on_one_pipeline_stage_raises_on_every_stage(
    results: Any, strategy: str, ep: int
) -> None:
    """Claim: pp 2 (x ep 2) with check_for_nan_in_grad: an inf in the head's grad on rank 2
    only (stage 1, micro-batch 1 of 3) raises on every rank of both stages (never a hang: the
    flags are agreed over dp, then over pp); stage 1 names the param and rank 2, stage 0 names
    stage 1; after zero_grad the clean steps match the whole model's."""
    per_rank = case_result(results, f"nan_{strategy}_pp2_ep{ep}")
    for rank, res in enumerate(per_rank):
        message = res["raised"]
        assert message is not None and "NaN or Inf in gradients" in message, (rank, message)
        if res["pp_rank"] == 1:
            assert "head.weight" in message and "[2]" in message, (rank, message)
        else:
            assert "on pipeline stage(s) [1]" in message, (rank, message)
        for s in res["norms"]:
            assert s["ok"] and abs(s["got"] - s["want"]) <= 1e-5 * s["want"], (rank, s)
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (strategy, rank, worst)


def _skipped_then_clean(steps: list[Any], errors: dict[str, float], where: str) -> None:
    """The first (poisoned) step skipped with the scale halved; the clean ones grow it back,
    clip by the whole model's norm, and the params equal the whole model's."""
    first, *clean = steps
    assert not first["ok"] and first["scale"] == SCALE / 2, (where, first)
    assert [s["scale"] for s in clean] == [SCALE / 2, SCALE], (where, clean)
    for s in clean:
        assert s["ok"] and abs(s["got"] - s["want"]) <= 1e-5 * s["want"], (where, s)
    worst = max(errors.items(), key=lambda kv: kv[1])
    assert worst[1] <= 1e-6, (where, worst)
