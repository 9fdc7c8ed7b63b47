"""Comm hooks and deterministic_reduction under hybrid sharding (issue 26; [Note: comm hooks
under hybrid], [Note: deterministic reduction under hybrid]) on 4 gloo ranks as 2 replicas x
2-way shard, against single-process references (hybrid_hook_cases.py). One pool run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from hybrid_hook_cases import hooked_case, refusals

from megabuf.comm_hooks import (
    CommHookHybridError,
    CommHookModeError,
    Compress,
    GradBucket,
    PowerSGD,
    Reduce,
)
from megabuf.sharding.replica_hooks import check_two_level

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
FP32_BOUND = 1e-6  # as test_hybrid: 3 AdamW steps at lr 1e-2; a replica missing the other's
# grads is off by ~1e-3
# Compress(bf16) / Quantize round each level's sums (bf16: 2**-9 relative, twice), and Adam
# turns a grad near 0 into a step of up to lr whose sign that rounding may flip: observed 5e-3
# (Compress, 1 or 2 micro-batches per rank) and 1e-2 (Quantize) against the global batch after
# 3 steps at lr 1e-2; the exact checks are the bitwise emulations and the replicas' digests
BF16_BOUND = 2e-2


def _cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {}
    for strategy in STRATEGIES:
        for hook in ("compress", "deterministic"):
            cases[f"{strategy}-{hook}"] = (
                hooked_case, {"strategy": strategy, "hook": hook, "micro": 2},
            )  # fmt: skip
    for strategy in ("optim", "optim_grads"):
        cases[f"{strategy}-deterministic-4x1"] = (
            hooked_case, {"strategy": strategy, "hook": "deterministic", "split": "4x1"},
        )  # fmt: skip
    cases["optim_grads-deterministic-expert"] = (  # ep 1: expert buffers split as the dense
        hooked_case,
        {"strategy": "optim_grads", "hook": "deterministic", "micro": 2, "expert": True},
    )  # fmt: skip
    cases["optim-compress_fp32-4x1"] = (
        hooked_case, {"strategy": "optim", "hook": "compress_fp32", "split": "4x1"},
    )  # fmt: skip
    cases["optim_grads-deterministic-4x1-average"] = (
        hooked_case,
        {"strategy": "optim_grads", "hook": "deterministic", "split": "4x1", "micro": 2,
         "ddp": {"average_in_collective": True}},
    )  # fmt: skip
    cases["optim_grads-compress-dense-only"] = (  # hooked and plain groups in one chain
        hooked_case,
        {"strategy": "optim_grads", "hook": "compress_dense", "micro": 2, "expert": True},
    )  # fmt: skip
    cases["optim-none-4x1"] = (hooked_case, {"strategy": "optim", "hook": "none", "split": "4x1"})
    cases["optim-deterministic-repeat"] = (  # another bucket size, no overlap: same bits
        hooked_case,
        {"strategy": "optim", "hook": "deterministic", "micro": 2,
         "ddp": {"bucket_size": 1000, "overlap_grad_reduce": False}},
    )  # fmt: skip
    cases["optim_grads-deterministic-asymmetric"] = (
        hooked_case,
        {"strategy": "optim_grads", "hook": "deterministic", "micro_by_rank": [1, 1, 2, 2],
         "accumulation": "reduce_each_microbatch"},
    )  # fmt: skip
    cases["optim_grads-compress-asymmetric"] = (
        hooked_case,
        {"strategy": "optim_grads", "hook": "compress", "micro_by_rank": [1, 1, 2, 2],
         "accumulation": "reduce_each_microbatch"},
    )  # fmt: skip
    cases["optim-reduce"] = (hooked_case, {"strategy": "optim", "hook": "reduce", "micro": 2})
    cases["optim-none"] = (hooked_case, {"strategy": "optim", "hook": "none", "micro": 2})
    cases["optim-quantize"] = (hooked_case, {"strategy": "optim", "hook": "quantize"})
    cases["refusals"] = (refusals,)
    return cases


@pytest.fixture(scope="module")
def sweep(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, _cases())  # type: ignore[no-any-return]


def _check_replicas_and_levels(ranks: list[dict[str, Any]], second: dict[str, int]) -> None:
    """Replicas (ranks k and k + 2) bitwise equal after every step; per step, on the replicate
    group, exactly `second` collectives per bucket (micro-batches or not) and nothing else."""
    for k in range(2):
        assert ranks[k]["digests"] == ranks[k + 2]["digests"], f"replicas of rank {k} differ"
    for r in ranks:
        want = {op: n * r["buckets"] for op, n in second.items()}
        assert [c.get("dp_replicate", {}) for c in r["calls"]] == [want] * len(r["calls"])
        assert r["replica_views"] == r["buckets"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_compress_runs_on_both_levels(sweep: list[dict[str, Any]], strategy: str) -> None:
    ranks = case_result(sweep, f"{strategy}-compress")
    _check_replicas_and_levels(ranks, {"all_reduce": 1})
    assert all(r["hooks"] == ["Compress"] for r in ranks)
    # each level sums 2 terms, which bf16 rounds the same in any order: the reduced shards are
    # bitwise the emulation's (each level's sum in bf16, back to fp32), and so are the params
    assert all(r["grads_bitwise"] == [True, True, True] for r in ranks)
    assert max(r["hier_error"] for r in ranks) == 0.0
    assert max(r["error"] for r in ranks) < BF16_BOUND
    _check_hook_report(ranks[0])


def _check_hook_report(res: dict[str, Any]) -> None:
    """comm_hook_report: per bucket a first-level row (reduce-scatter over the shard group) and
    a second-level row (all-reduce over the replicate group), each dispatched once per step,
    with the bytes wire_formula gives for its view."""
    levels = [(level, mode, size) for level, mode, size, *_ in res["wire"]]
    assert levels == [(1, "reduce_scatter", 2), (2, "all_reduce", 2)] * res["buckets"]
    for _, _, _, dispatches, ring_nbytes, formula in res["wire"]:
        assert dispatches == 3 and ring_nbytes == formula > 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_deterministic_sum_is_the_hierarchical_fixed_order_sum(
    sweep: list[dict[str, Any]], strategy: str
) -> None:
    """Every step's reduced shard is bitwise the hierarchical fp32 sum computed in one process
    ([Note: deterministic reduction under hybrid]); the second level is an all-to-all and an
    all-gather per bucket per step on the replicate group, even with 2 micro-batches."""
    ranks = case_result(sweep, f"{strategy}-deterministic")
    _check_replicas_and_levels(ranks, {"all_to_all": 1, "all_gather": 1})
    assert all(r["hooks"] == ["Deterministic"] for r in ranks)
    assert all(r["grads_bitwise"] == [True, True, True] for r in ranks)
    assert max(r["hier_error"] for r in ranks) == 0.0  # its AdamW steps too, bitwise
    assert max(r["error"] for r in ranks) < FP32_BOUND


def test_deterministic_with_expert_buffers(sweep: list[dict[str, Any]]) -> None:
    """ep_size 1: the mode's hook on the expert buffers' groups too, on both levels."""
    ranks = case_result(sweep, "optim_grads-deterministic-expert")
    _check_replicas_and_levels(ranks, {"all_to_all": 1, "all_gather": 1})
    assert all(r["grads_bitwise"] == [True, True, True] for r in ranks)
    assert max(r["hier_error"] for r in ranks) == 0.0


def test_deterministic_second_level_sums_replicas_in_rank_order(
    sweep: list[dict[str, Any]],
) -> None:
    """4 x 1: the second level sums four replicas, where the order shows: bitwise the fp32 sum
    (((x_0 + x_1) + x_2) + x_3), and its AdamW steps bitwise too (also with
    average_in_collective: no pre-scale, the sum / 4 once); so is Compress(bf16, "fp32")
    standing in for the mode's hook (bf16 terms, that fp32 sum, rounded to bf16 once). The
    engine's own all-reduce (gloo's ring) sums in another order: its grads are not that sum on
    some step."""
    for name in (
        "optim-deterministic-4x1",
        "optim_grads-deterministic-4x1",
        "optim_grads-deterministic-4x1-average",
    ):
        ranks = case_result(sweep, name)
        assert all(r["grads_bitwise"] == [True, True, True] for r in ranks), name
        assert max(r["hier_error"] for r in ranks) == 0.0
        assert len({r["digests"][-1] for r in ranks}) == 1  # four replicas, one model
        assert max(r["error"] for r in ranks) < FP32_BOUND
    fp32_sum = case_result(sweep, "optim-compress_fp32-4x1")  # the mode with Compress(bf16, fp32)
    assert all(r["hooks"] == ["Compress"] for r in fp32_sum)
    _check_replicas_and_levels(fp32_sum, {"all_to_all": 1, "all_gather": 1})
    assert all(r["grads_bitwise"] == [True, True, True] for r in fp32_sum)
    assert max(r["hier_error"] for r in fp32_sum) == 0.0
    plain = case_result(sweep, "optim-none-4x1")
    assert not all(r["grads_bitwise"] == [True, True, True] for r in plain)


def test_deterministic_is_reproducible_across_bucket_sizes_and_overlap(
    sweep: list[dict[str, Any]],
) -> None:
    base = case_result(sweep, "optim-deterministic")
    other = case_result(sweep, "optim-deterministic-repeat")
    assert all(r["grads_bitwise"] == [True, True, True] for r in other)
    assert [r["params"] for r in base] == [r["params"] for r in other]
    assert [r["digests"] for r in base] == [r["digests"] for r in other]


def test_asymmetric_micro_batches_per_shard_group(sweep: list[dict[str, Any]]) -> None:
    """Shard group [0, 1] runs 1 micro-batch per step, [2, 3] runs 2 (reduce_each_microbatch:
    the first level per micro-batch, added into the grad shard): the second level still runs
    once per bucket per step, and the deterministic sum is the reference's, bitwise."""
    det = case_result(sweep, "optim_grads-deterministic-asymmetric")
    _check_replicas_and_levels(det, {"all_to_all": 1, "all_gather": 1})
    assert all(r["grads_bitwise"] == [True, True, True] for r in det)
    assert max(r["error"] for r in det) < FP32_BOUND
    compress = case_result(sweep, "optim_grads-compress-asymmetric")
    _check_replicas_and_levels(compress, {"all_reduce": 1})
    assert all(r["grads_bitwise"] == [True, True, True] for r in compress)
    assert max(r["error"] for r in compress) < BF16_BOUND


def test_reduce_hook_on_both_levels_is_the_engine_bitwise(sweep: list[dict[str, Any]]) -> None:
    """`Reduce` as a hook (the engine's reduction written as one) gives the engine's own hybrid
    result bit for bit: the second level's view carries no second pre-scale."""
    hooked, plain = case_result(sweep, "optim-reduce"), case_result(sweep, "optim-none")
    _check_replicas_and_levels(hooked, {"all_reduce": 1})
    _check_hook_report(hooked[0])
    assert [r["params"] for r in hooked] == [r["params"] for r in plain]
    assert max(r["error"] for r in hooked) < FP32_BOUND


def test_hooked_and_plain_groups_in_one_chain(sweep: list[dict[str, Any]]) -> None:
    """Compress on the dense buffers only, the expert buffers (ep 1: over dp, so in the same
    dispatch chain) reduced by the engine: both kinds' second levels share the replicate group
    in chain order, with no hang and replicas equal after every step."""
    ranks = case_result(sweep, "optim_grads-compress-dense-only")
    assert all(r["hooks"] == ["Compress", "NoneType"] and r["chains"] == 1 for r in ranks)
    for k in range(2):
        assert ranks[k]["digests"] == ranks[k + 2]["digests"], f"replicas of rank {k} differ"
    for r in ranks:
        assert [c["dp_replicate"] for c in r["calls"]] == [{"all_reduce": r["buckets"]}] * 3
    assert max(r["error"] for r in ranks) < BF16_BOUND


def test_quantize_runs_on_both_levels(sweep: list[dict[str, Any]]) -> None:
    """Quantize (int8, block 16) on both levels: two all-to-alls and two all-gathers per bucket
    on the replicate group; replicas agree; params near the reference (each level adds its
    int8 rounding, ~1/254 of a block's largest grad)."""
    ranks = case_result(sweep, "optim-quantize")
    _check_replicas_and_levels(ranks, {"all_to_all": 2, "all_gather": 2})
    assert max(r["error"] for r in ranks) < BF16_BOUND


def test_stateful_hook_is_refused_by_name(sweep: list[dict[str, Any]]) -> None:
    errors = case_result(sweep, "refusals")[0]
    assert "comm hook PowerSGD" in errors["powersgd"]
    assert "cannot run under hybrid sharding" in errors["powersgd"]
    assert "error feedback" in errors["powersgd"]  # why
    assert "PowerSGD" not in errors["registered"]  # nothing attached


def test_two_level_declarations() -> None:
    """Pure: which hooks may run on the second level, and the named refusals."""
    for hook in (Reduce(), Compress(torch.bfloat16)):
        check_two_level(hook, group_id=0, rank=0)
    with pytest.raises(CommHookHybridError, match=r"PowerSGD.*does not declare `two_level"):
        check_two_level(PowerSGD(rank=1), group_id=3, rank=1)

    class AllReduceLess:
        name = "ScatterOnly"
        modes = frozenset({"reduce_scatter"})
        two_level = True

        def __call__(self, bucket: GradBucket) -> None: ...

    with pytest.raises(CommHookModeError, match="second level of a hybrid reduction"):
        check_two_level(AllReduceLess(), group_id=0, rank=2)
