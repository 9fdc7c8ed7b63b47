"""Hybrid sharding (issue 26): the replicate x shard split of dp ([Note: hybrid rank order]) and
the two-level reduction ([Note: two-level reduction]), on real gloo ranks against the
single-process reference on the global batch (hybrid_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from hybrid_cases import (
    checkpoint_case,
    hybrid_case,
    lifecycle_case,
    mismatched_micro_batches,
    misuse_errors,
)

from megabuf.pure.hybrid import HybridSplit, hybrid_layout, node_shard_size, place, split_for

FP32_BOUND = 1e-6  # 3 AdamW steps at lr 1e-2 on fp32: observed <= 6e-8; a replica that misses
# the other replica's grads is off by ~1e-3 (half the batch)
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


# ---- pure: the rank layout --------------------------------------------------------------------
def test_layout_shard_groups_are_consecutive_dp_ranks_and_replicas_stride_the_shard() -> None:
    layout = hybrid_layout([[0, 1, 2, 3]], HybridSplit(replicate_size=2, shard_size=2))
    assert layout == {"dp_shard": [[0, 1], [2, 3]], "dp_replicate": [[0, 2], [1, 3]]}
    eight = hybrid_layout([list(range(8))], split_for(8, shard_size=4))
    assert eight["dp_shard"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eight["dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # two pipeline stages: each stage's dp group splits on its own
    pp = hybrid_layout([[0, 1, 2, 3], [4, 5, 6, 7]], split_for(4, replicas=2))
    assert pp["dp_shard"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pp["dp_replicate"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [place(r, HybridSplit(2, 2)) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_split_from_megatron_instances_and_degenerate_splits() -> None:
    assert split_for(8, replicas=2) == HybridSplit(replicate_size=2, shard_size=4)
    assert split_for(4, shard_size=4).is_flat
    assert split_for(4, shard_size=1) == HybridSplit(replicate_size=4, shard_size=1)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"shard_size": 3}, "dp_shard_size=3 does not divide the data-parallel size 4"),
        ({"replicas": 0, "what": "R"}, "R=0 must be an int >= 1"),
        ({"shard_size": 2, "replicas": 2}, "exactly one of"),
    ],
)
def test_impossible_splits_raise_by_name(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        split_for(4, **kwargs)


def test_node_shard_size_reads_local_world_size_or_raises_by_name() -> None:
    assert node_shard_size({"LOCAL_WORLD_SIZE": "8"}) == 8
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        node_shard_size({})


EACH = {"strategy": "optim_grads", "accumulation": "reduce_each_microbatch"}
MISMATCH: dict[str, dict[str, Any]] = {  # [Note: micro-batch agreement]
    "each-2x2-both-groups": {"split": "2x2", **EACH, "micro_by_rank": [1, 2, 1, 2]},
    "each-2x2-one-group": {"split": "2x2", **EACH, "micro_by_rank": [2, 2, 2, 1]},
    "zero3-2x2-explicit": {"split": "2x2", "strategy": "optim_grads_params",
                           "micro_by_rank": [1, 2, 2, 2], "explicit": True},
    "each-flat": {"split": "flat", **EACH, "micro_by_rank": [1, 1, 2, 1]},
}  # fmt: skip


# ---- gloo ranks: the sweep, one pool run -------------------------------------------------------
def _cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {}
    for strategy in STRATEGIES:
        cases[f"{strategy}-flat"] = (hybrid_case, {"split": "flat", "strategy": strategy})
        cases[f"{strategy}-2x2-micro2"] = (
            hybrid_case, {"split": "2x2", "strategy": strategy, "micro": 2},
        )  # fmt: skip
    cases["optim-4x1"] = (hybrid_case, {"split": "4x1", "strategy": "optim"})
    cases["optim-1x4"] = (hybrid_case, {"split": "1x4", "strategy": "optim"})
    cases["optim_grads-2x2-each"] = (
        hybrid_case,
        {"split": "2x2", "strategy": "optim_grads", "micro": 2,
         "accumulation": "reduce_each_microbatch"},
    )  # fmt: skip
    cases["optim-config2-frozen"] = (
        hybrid_case, {"split": "config:2", "strategy": "optim", "frozen": True},
    )  # fmt: skip
    cases["optim_grads-mesh"] = (hybrid_case, {"split": "mesh:2x2", "strategy": "optim_grads"})
    cases["optim-2x2-bf16"] = (hybrid_case, {"split": "2x2", "strategy": "optim", "bf16": True})
    cases["optim-flat-bf16"] = (hybrid_case, {"split": "flat", "strategy": "optim", "bf16": True})
    cases["optim_grads-2x2-asymmetric"] = (
        hybrid_case,
        {"split": "2x2", "strategy": "optim_grads", "micro_by_rank": [1, 1, 2, 2],
         "accumulation": "reduce_each_microbatch"},
    )  # fmt: skip
    cases["optim_grads-2x2-expert"] = (
        hybrid_case, {"split": "2x2", "strategy": "optim_grads", "expert": True, "micro": 2},
    )  # fmt: skip
    cases["optim-2x2-no-overlap"] = (
        hybrid_case, {"split": "2x2", "strategy": "optim", "micro": 2,
                      "ddp": {"overlap_grad_reduce": False}},
    )  # fmt: skip
    cases["optim_grads-2x2-param-overlap"] = (
        hybrid_case, {"split": "2x2", "strategy": "optim_grads",
                      "ddp": {"overlap_param_gather": True}},
    )  # fmt: skip
    cases["misuse"] = (misuse_errors,)
    cases |= {
        f"mismatch-{name}": (mismatched_micro_batches, case) for name, case in MISMATCH.items()
    }
    for strategy in STRATEGIES:
        cases[f"lifecycle-{strategy}"] = (lifecycle_case, {"split": "2x2", "strategy": strategy})
    cases["optim_grads-2x2-unsharded-asymmetric"] = (
        hybrid_case, {"split": "2x2", "strategy": "optim_grads", "micro_by_rank": [1, 2, 2, 1]},
    )  # fmt: skip
    return cases


@pytest.fixture(scope="module")
def sweep(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, _cases())  # type: ignore[no-any-return]


def _result(sweep: list[dict[str, Any]], name: str) -> list[Any]:
    return case_result(sweep, name)  # type: ignore[no-any-return]


def _check_trained(ranks: list[dict[str, Any]], split: tuple[int, int], micro: int = 1) -> None:
    first = ranks[0]
    assert first["split"] == split
    assert all(r["params"] == first["params"] for r in ranks), "replicas differ"
    assert max(r["error"] for r in ranks) < FP32_BOUND
    if split[0] > 1:  # one replicate all-reduce per bucket per step, whatever the micro-batches
        assert all(r["replicate_calls"] == [r["buckets"]] * 3 for r in ranks)
    # the timeline marks each group's second level once per step (none when flat)
    want = 3 * first["groups"] if split[0] > 1 else 0
    assert all(r["replicate_events"] == want for r in ranks)
    del micro


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_2x2_matches_the_reference_with_micro_batches(
    sweep: list[dict[str, Any]], strategy: str
) -> None:
    _check_trained(_result(sweep, f"{strategy}-2x2-micro2"), (2, 2), micro=2)
    _check_trained(_result(sweep, f"{strategy}-flat"), (1, 4))


def test_degenerate_splits(sweep: list[dict[str, Any]]) -> None:
    flat = _result(sweep, "optim-flat")
    one_by_four = _result(sweep, "optim-1x4")
    _check_trained(one_by_four, (1, 4))
    assert one_by_four[0]["params"] == flat[0]["params"]  # R = 1 is the flat strategy, bitwise
    _check_trained(_result(sweep, "optim-4x1"), (4, 1))


def test_reduce_each_microbatch_crosses_replicas_once_per_step(sweep: list[dict[str, Any]]) -> None:
    _check_trained(_result(sweep, "optim_grads-2x2-each"), (2, 2), micro=2)


def test_megatron_instances_and_device_mesh_give_the_same_split(
    sweep: list[dict[str, Any]],
) -> None:
    _check_trained(_result(sweep, "optim-config2-frozen"), (2, 2))
    _check_trained(_result(sweep, "optim_grads-mesh"), (2, 2))


def test_bf16_params_with_fp32_main_params(sweep: list[dict[str, Any]]) -> None:
    hybrid, flat = _result(sweep, "optim-2x2-bf16"), _result(sweep, "optim-flat-bf16")
    assert all(r["params"] == hybrid[0]["params"] for r in hybrid), "replicas differ"
    # hybrid sums the four ranks' fp32 grads as (g0 + g1) + (g2 + g3), flat in rank order: the
    # fp32 masters differ by a few fp32 roundings, which may move a bf16 param by an ulp, and
    # an Adam step on a grad near 0 by more ([Note: bf16 optimizer bound] in
    # optimizer_cases.py): bounded by 2 ulps + lr / 10 (a dropped or doubled step moves ~lr)
    for name, got in hybrid[0]["params"].items():
        a = torch.frombuffer(bytearray(got), dtype=torch.float32)
        b = torch.frombuffer(bytearray(flat[0]["params"][name]), dtype=torch.float32)
        assert ((a - b).abs() <= b.abs() * 2.0**-6 + 1e-3).all(), name


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_wire_bytes_per_group_equal_the_formula(sweep: list[dict[str, Any]], strategy: str) -> None:
    """Ring bytes per rank per step, n * g = the padded grad bytes of the buckets (fp32 params
    and grads here, so a gather after the step moves n * g too; docs/sharding.md "Hybrid
    sharding"): shard group (S-1)/S n g reduce-scatter (+ the same gathered), replicate group
    2(R-1)/R (n/S) g all-reduce and nothing else, whatever the micro-batches; flat
    (D-1)/D n g."""
    r = s = 2
    hybrid = _result(sweep, f"{strategy}-2x2-micro2")[0]
    flat = _result(sweep, f"{strategy}-flat")[0]
    n, steps = hybrid["bucket_nbytes"], 3
    got = hybrid["group_bytes"]
    assert got["dp_replicate"] == {"all_reduce": steps * 2 * (r - 1) * n // (r * s)}
    assert got["dp_shard"]["reduce_scatter"] == steps * (s - 1) * n // s
    d, nf = r * s, flat["bucket_nbytes"]
    assert flat["group_bytes"]["dp"]["reduce_scatter"] == steps * (d - 1) * nf // d
    if strategy != "optim_grads_params":  # ZeRO-3 gathers unit by unit, per micro-batch
        assert got["dp_shard"]["all_gather"] == steps * (s - 1) * n // s


def test_named_errors(sweep: list[dict[str, Any]]) -> None:
    errors = _result(sweep, "misuse")[0]
    assert "dp_shard_size=3 does not divide the data-parallel size 4" in errors["not_divisible"]
    assert "needs a strategy that shards the optimizer" in errors["no_shard"]
    assert "comm hook PowerSGD cannot run under hybrid sharding" in errors["hook"]
    assert (
        "num_distributed_optimizer_instances=3 does not divide" in errors["config_r_not_dividing"]
    )
    assert "expert parallelism (ep_size 2) is not supported" in errors["expert"]
    assert "dims named ('replicate', 'shard')" in errors["unnamed_mesh"]


@pytest.mark.parametrize(
    ("save", "load"),
    [
        ({"split": "2x2", "strategy": "optim"}, {"split": "flat", "strategy": "optim"}),
        ({"split": "flat", "strategy": "optim_grads"}, {"split": "2x2", "strategy": "optim_grads"}),
        ({"split": "2x2", "strategy": "optim_grads_params"}, {"split": "4x1", "strategy": "optim"}),
    ],
    ids=["hybrid-to-flat", "flat-to-hybrid", "hybrid-zero3-to-4x1"],
)
def test_checkpoint_moves_between_splits(
    pools: Any, tmp_path: Any, save: dict[str, Any], load: dict[str, Any]
) -> None:
    ranks = pools(4).run(checkpoint_case, save, load, str(tmp_path / "ckpt"))
    assert all(r["params"] == ranks[0]["params"] for r in ranks), "replicas differ"
    assert max(r["error"] for r in ranks) < FP32_BOUND


def test_inspect_shows_both_groups_and_lays_out_at_the_shard_size() -> None:
    from torch import nn

    from megabuf import DistributedDataParallelConfig
    from megabuf.inspect import format_inspection, inspect_model, inspection_to_dict

    model = nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 3))
    cfg = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads", num_distributed_optimizer_instances=2
    )
    info = inspect_model(model, cfg, 8)
    flat_at_shard = inspect_model(model, DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads"), 4)  # fmt: skip
    assert [b.layout for b in info.buffers] == [b.layout for b in flat_at_shard.buffers]
    assert info.memory == flat_at_shard.memory  # per rank: the flat strategy at dp = S
    as_dict = inspection_to_dict(info)
    assert (as_dict["dp_size"], as_dict["dp_replicate_size"], as_dict["dp_shard_size"]) == (8, 2, 4)
    text = format_inspection(info)
    assert "2 replicas x 4-way shard" in text and "dp_replicate groups of 2 ranks" in text
    with pytest.raises(ValueError, match="dp_shard_size=3 does not divide"):
        inspect_model(model, cfg, 8, dp_shard_size=3)


def test_config_instances_field_is_validated_by_name() -> None:
    from megabuf import DistributedDataParallelConfig

    field = "num_distributed_optimizer_instances"
    with pytest.raises(ValueError, match=f"{field} must be an int >= 1"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=0)
    with pytest.raises(ValueError, match=f"{field}=2 needs a strategy that shards the optimizer"):
        DistributedDataParallelConfig(num_distributed_optimizer_instances=2)
    cfg = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim", num_distributed_optimizer_instances=2
    )
    assert cfg.num_distributed_optimizer_instances == 2


def test_shard_groups_with_different_micro_batch_counts(sweep: list[dict[str, Any]]) -> None:
    """Shard group [0, 1] runs 1 micro-batch per step, [2, 3] runs 2 (reduce_each_microbatch:
    a reduce-scatter per micro-batch inside each shard group): nothing crosses the replicate
    group before each group's last micro-batch, so the counts need not agree across shard
    groups; no hang, one all-reduce per bucket per step, the reference's result (each rank's
    loss is divided by its own count: its grad is its slice's mean either way)."""
    _check_trained(_result(sweep, "optim_grads-2x2-asymmetric"), (2, 2))


def test_expert_buffers_follow_the_same_split(sweep: list[dict[str, Any]]) -> None:
    """ep_size 1: the expert buffers reduce over expt_dp == dp, so they split as the dense ones
    (their own bucket groups, one replicate all-reduce per bucket per step); ep_size > 1 is
    refused by name (test_named_errors)."""
    _check_trained(_result(sweep, "optim_grads-2x2-expert"), (2, 2))


def test_overlap_flags_under_hybrid(sweep: list[dict[str, Any]]) -> None:
    """Without overlap_grad_reduce both levels run at the end of backward; with
    overlap_param_gather the shard-group gathers after the step overlap the next forward."""
    _check_trained(_result(sweep, "optim-2x2-no-overlap"), (2, 2))
    _check_trained(_result(sweep, "optim_grads-2x2-param-overlap"), (2, 2))


def test_pipeline_with_a_hybrid_split_per_stage(pools: Any) -> None:
    """pp 2 x dp 2 on 4 ranks, each stage's dp split as 2 replicas x 1 (the only split dp 2 has
    besides flat: the reduce-scatter over one rank, the all-reduce over the stage's two): 1F1B
    with the distributed optimizer against the single-process GPT (test_pipeline's harness)."""
    from pipeline_cases import pipeline_case

    _check_pipeline(pools(4).run(pipeline_case, {"pp": 2, "config": PIPELINE_CONFIG}))


def _check_pipeline(ranks: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(ranks):
        worst = max(res["errors"].values())
        assert worst <= 1e-6, (rank, res["errors"])
    assert all(
        abs(a - b) <= 1e-5 * abs(b) for r in ranks for a, b in zip(r["norms"], r["ref_norms"])
    )


def test_pipeline_with_a_two_by_two_split_per_stage(eight: list[dict[str, Any]]) -> None:
    """pp 2 x dp 4 on 8 ranks, each stage's dp split as 2 replicas x a 2-way shard (a real
    reduce-scatter inside the shard group, then the all-reduce across replicas): 1F1B with the
    distributed optimizer against the single-process GPT (in the 8-rank sweep)."""
    ranks = _result(eight, "pipeline-pp2-2x2")
    assert len(ranks) == 8
    _check_pipeline(ranks)


PIPELINE_CONFIG = {"use_distributed_optimizer": True, "bucket_size": 200,
                   "overlap_grad_reduce": True, "overlap_param_gather": True,
                   "num_distributed_optimizer_instances": 2}  # fmt: skip


def _eight_cases() -> dict[str, tuple[Any, ...]]:
    from pipeline_cases import pipeline_case
    from publish_cases import hybrid_publish_case

    cases: dict[str, tuple[Any, ...]] = {
        strategy: (
            hybrid_case,
            {"split": "2x4", "strategy": strategy, "micro": 2, "every_step": True},
        )
        for strategy in STRATEGIES
    }
    cases["pipeline-pp2-2x2"] = (pipeline_case, {"pp": 2, "config": PIPELINE_CONFIG})
    cases["publish-2x2"] = (hybrid_publish_case, 2)
    return cases


@pytest.fixture(scope="module")
def eight(pools: Any) -> list[dict[str, Any]]:
    """2 replicas x 4-way shard on 8 ranks, every strategy, in one pool run."""
    return pools(8).run(run_each, _eight_cases())  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_2x4_matches_the_reference_and_replicas_agree_after_every_step(
    eight: list[dict[str, Any]], strategy: str
) -> None:
    """R 2 x S 4 (shard groups [0..3] [4..7], replicate groups [i, i+4]): 3 AdamW steps of 2
    micro-batches within the bound of the single-process reference on the global batch, one
    replicate all-reduce per bucket per step, and every rank's whole params bitwise equal after
    every step (a digest per step)."""
    ranks = _result(eight, strategy)
    _check_trained(ranks, (2, 4), micro=2)
    assert len(ranks[0]["digests"]) == 3
    assert all(r["digests"] == ranks[0]["digests"] for r in ranks), "replicas differ"


def _errors(sweep: list[dict[str, Any]], name: str) -> list[str]:
    return [r["error"] for r in _result(sweep, f"mismatch-{name}")]


def test_ranks_of_one_shard_group_with_different_micro_batch_counts_raise_on_every_rank(
    sweep: list[dict[str, Any]],
) -> None:
    """[Note: micro-batch agreement]: where every micro-batch communicates inside the shard
    group (reduce_each_microbatch, optim_grads_params), its ranks running 1 and 2 micro-batches
    hung before (one rank's last reduce-scatter paired with the other's first); now every rank
    raises naming the group, each rank's micro-batch and what to do, and the ranks of the other
    shard group (which agreed) raise too, naming the ranks that did not (no rank is left
    waiting for a replicate all-reduce). A fresh model then trains on the same groups."""
    both = _errors(sweep, "each-2x2-both-groups")
    for rank, error in enumerate(both):
        group = [0, 1] if rank < 2 else [2, 3]
        assert f"the ranks of shard group {group} ran different numbers of micro-batches" in error
        assert f"rank {group[0]} runs micro-batch 1 as the step's last (outside no_sync())" in error
        assert f"rank {group[1]} runs micro-batch 1 inside no_sync()" in error
        assert "sharded_grad_accumulation='reduce_each_microbatch'" in error
        assert "accumulate_unsharded" in error and f"this is rank {rank}" in error
    one = _errors(sweep, "each-2x2-one-group")
    for rank in (0, 1):
        assert "rank(s) [2, 3] of another shard group" in one[rank], one[rank]
        assert f"this is rank {rank}, whose shard group agreed" in one[rank]
    for rank in (2, 3):
        assert (
            "rank 2 runs micro-batch 1 inside no_sync(); rank 3 runs micro-batch 1 as" in one[rank]
        )


def test_micro_batch_mismatch_at_the_grad_sync_and_when_flat(sweep: list[dict[str, Any]]) -> None:
    """The Megatron loop (every micro-batch in no_sync(), then finish_grad_sync()): the rank
    with fewer micro-batches is at the sync while its peer starts its next micro-batch; and the
    flat dp group under reduce_each_microbatch, which hung the same way."""
    zero3 = _errors(sweep, "zero3-2x2-explicit")
    for rank in (0, 1):
        assert "rank 0 ends the step (grad sync) after 1 micro-batch(es)" in zero3[rank]
        assert "rank 1 runs micro-batch 2 inside no_sync()" in zero3[rank]
        assert "data_parallel_sharding_strategy='optim_grads_params'" in zero3[rank]
    assert all("rank(s) [0, 1] of another shard group" in e for e in zero3[2:])
    flat = _errors(sweep, "each-flat")
    for error in flat:
        assert "the ranks of dp group [0, 1, 2, 3] ran different numbers" in error, error
        assert "rank 2 runs micro-batch 1 inside no_sync()" in error
        assert "rank 3 runs micro-batch 1 as the step's last" in error


def test_micro_batch_counts_may_differ_where_nothing_pairs_them(
    sweep: list[dict[str, Any]],
) -> None:
    """accumulate_unsharded with optim_grads: no_sync micro-batches issue no collective, so
    ranks of one shard group may run 1 and 2 micro-batches (each scales its own loss): the
    reference's result, one replicate all-reduce per bucket per step."""
    _check_trained(_result(sweep, "optim_grads-2x2-unsharded-asymmetric"), (2, 2))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offload_restore_and_export_under_a_2x2_split(
    sweep: list[dict[str, Any]], strategy: str
) -> None:
    """The RL weight lifecycle (megabuf.weights) at 2 replicas x 2 shards: offload() and
    restore() of model and optimizer between steps are bitwise (the params, and after one
    more step the params of a twin that never offloaded: the optimizer state came back), and
    export_weights() streams the whole params (ZeRO-3: gathered in the shard group), bitwise
    the model's, within the bound of the single-process reference, at version 3."""
    for out in _result(sweep, f"lifecycle-{strategy}"):
        assert out["offloaded"] and out["restored_bitwise"] and out["matches_twin"], out
        assert out["export_is_state"] and out["versions"] == [3]
        assert set(out["ref_names"]) <= set(out["names"]) and out["error"] < FP32_BOUND


def test_publisher_sends_from_replica_zero_under_a_2x2_split(eight: list[dict[str, Any]]) -> None:
    """[Note: publishing from replicas]: ranks 0-3 train as 2 replicas x 2 shards, ranks 0 and 1
    (replicate rank 0's shard group) publish to rank 4: it receives every weight bitwise as
    every trainer holds it, each sender sent its half of every bucket (together the model
    once, not once per replica), and ranks 2 and 3 are refused a Publisher by name."""
    ranks = _result(eight, "publish-2x2")
    trainers, consumer = ranks[:4], ranks[4]
    assert all(t["split"] == (2, 2) for t in trainers)
    params = trainers[0]["params"]
    assert all(torch.equal(t["params"][k], v) for t in trainers for k, v in params.items())
    assert consumer["got"].keys() == params.keys()
    assert all(torch.equal(consumer["got"][k], v) for k, v in params.items())
    assert trainers[0]["sent"] == tuple(range(len(trainers[0]["sent"]))) != ()
    sent = trainers[0]["sent_nbytes"] + trainers[1]["sent_nbytes"]
    assert sent == trainers[0]["model_nbytes"]  # one consumer, one copy of every bucket
    for rank in (2, 3):
        refused = trainers[rank]["refused"]
        assert "this rank is in replica 1" in refused and "replicate rank 0's shard" in refused
