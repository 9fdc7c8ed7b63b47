"""ZeRO-3 (data_parallel_sharding_strategy = "optim_grads_params"): real gloo ranks at dp 1/2/4
against a single-process torch AdamW on the global batch; bitwise equal to "optim" and across
reshard_after_forward / prefetch_units at dp=2; full params released where promised; reads of
released params; eval under no_grad; state_dict / load_state_dict; named errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
from dist_pool import case_result, run_each
from pipeline_cases import pipeline_case
from zero3_cases import (
    checkpoint_case,
    error_case,
    load_case,
    optim_case,
    read_case,
    release_case,
    states_case,
    stray_read_case,
    train_case,
)

ATOL = 1e-5  # fp32, 3 AdamW steps (lr 1e-2): megabuf's dp reduction vs one global backward
NO_RESHARD = {"reshard_after_forward": False}
TRAIN: dict[str, dict[str, Any]] = {
    "mlp": {"model": "mlp"},
    "gpt_tied": {"model": "gpt"},
    "module_used_twice": {"model": "twice"},
    "activation_checkpointing": {"model": "ckpt"},
    "frozen_params": {"model": "frozen"},
    "forward_order_not_registration_order": {"model": "permuted"},
    "forward_order_changes": {"model": "blocks", "reorder_at": 2, "steps": 4},
    "gpt_tied_no_reshard": {"model": "gpt", "ddp": NO_RESHARD},
    "two_microbatches_no_sync": {"model": "gpt", "micro": 2},
    "expert_parallel_params": {"model": "mlp", "expert": True},
    # NCCL's realisation on gloo (native all-gather and reduce-scatter collectives, matched by
    # issue order): every rank must issue the gathers and reductions in the same order
    "native_collectives_gpt": {"model": "gpt", "native": True},
    "native_collectives_ckpt_prefetch2": {
        "model": "ckpt",
        "native": True,
        "ddp": {"prefetch_units": 2},
    },
    "parent_reads_child_it_encloses": {
        "model": "parent_reads",
        "ddp": {"shard_units": ["first", "out"]},
    },
    "ckpt_no_reshard_prefetch2": {"model": "ckpt", "ddp": {**NO_RESHARD, "prefetch_units": 2}},
}
DP1_DP4 = [
    "mlp", "gpt_tied", "activation_checkpointing", "module_used_twice", "native_collectives_gpt"
]  # fmt: skip
# bitwise against one another at dp=2 (and "optim", ZeRO-1, at M=1)
SWEEP: dict[str, dict[str, Any]] = {
    "sweep_reshard_pf1": {"model": "permuted"},
    "sweep_reshard_pf0": {"model": "permuted", "ddp": {"prefetch_units": 0}},
    "sweep_reshard_pf2": {"model": "permuted", "ddp": {"prefetch_units": 2}},
    "sweep_noreshard_pf0": {"model": "permuted", "ddp": {**NO_RESHARD, "prefetch_units": 0}},
    "sweep_noreshard_pf1": {"model": "permuted", "ddp": NO_RESHARD},
}
OPTIM = {"sweep_optim": {"model": "permuted", "ddp": {"data_parallel_sharding_strategy": "optim"}}}
# bf16 params, fp32 grads and fp32 main params: ZeRO-3 vs ZeRO-1, bitwise at dp=2
BF16 = {"grad_reduce_in_fp32": True}
OPTIM["bf16_optim"] = {
    "model": "gpt",
    "bf16": True,
    "ddp": {**BF16, "use_distributed_optimizer": True},
}
# a comm hook (Compress to bf16, fp32 accumulation) under ZeRO-3 vs the same hook under ZeRO-1
COMPRESS = {"comm_hook": {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"}}
OPTIM["compress_optim"] = {"model": "mlp", "ddp": {**COMPRESS, "use_distributed_optimizer": True}}
OPTIM["compress_zero3"] = {
    "model": "mlp", "ddp": {**COMPRESS, "data_parallel_sharding_strategy": "optim_grads_params"},
}  # fmt: skip
OPTIM["bf16_zero3"] = {
    "model": "gpt", "bf16": True,
    "ddp": {**BF16, "data_parallel_sharding_strategy": "optim_grads_params"},
}  # fmt: skip


PIPELINE_ZERO3 = {"data_parallel_sharding_strategy": "optim_grads_params", "bucket_size": 200}
PIPELINE: dict[str, dict[str, Any]] = {  # 4 ranks: pp=2 x dp=2 (tests/pipeline_cases.py)
    "pipeline_1f1b": {"pp": 2, "config": PIPELINE_ZERO3},
    "pipeline_interleaved": {"pp": 2, "chunks": 2, "config": PIPELINE_ZERO3},
}


def cases(dp: int) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    if dp == 4:
        out.update({name: (pipeline_case, case) for name, case in PIPELINE.items()})
    names = TRAIN if dp == 2 else {k: TRAIN[k] for k in DP1_DP4}
    out.update({name: (train_case, case) for name, case in names.items()})
    if dp != 2:
        return out
    out.update({name: (train_case, case) for name, case in SWEEP.items()})
    out.update({name: (optim_case, case) for name, case in OPTIM.items()})
    out["release_mlp"] = (release_case, {"model": "mlp"})
    out["release_mlp_no_reshard"] = (release_case, {"model": "mlp", "ddp": NO_RESHARD})
    out["release_ckpt"] = (release_case, {"model": "ckpt"})
    out["read_released"] = (read_case, {"model": "permuted"})
    out["read_verify_mode"] = (
        read_case,
        {"model": "permuted", "ddp": {"verify_param_access": True}},
    )
    out["errors"] = (error_case, {"model": "mlp"})
    out["stray_read"] = (stray_read_case, {"model": "parent_reads"})
    out["load_state_dict"] = (load_case, {"model": "gpt"})
    out["eval_states"] = (states_case, {"model": "gpt"})
    return out


CHECKPOINT = {
    "name": "zero3_to_optim",
    "model": "gpt",
    "resume_ddp": {"data_parallel_sharding_strategy": "optim"},
}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"dp{n}")
def results(request: Any, pools: Any, tmp_path_factory: Any) -> tuple[int, list[dict[str, Any]]]:
    todo = cases(request.param)
    if request.param == 2:
        root = str(tmp_path_factory.mktemp("zero3_checkpoints"))
        todo["checkpoint"] = (checkpoint_case, root, CHECKPOINT)
    return request.param, pools(request.param).run(run_each, todo)


def _only(dp: int, world: int) -> None:
    if world != dp:
        pytest.skip(f"runs at dp={dp} only")


@pytest.mark.parametrize("name", TRAIN)
def test_adamw_steps_match_single_process_reference(results: Any, name: str) -> None:
    """Params (read through state_dict, gathered unit by unit) after N AdamW steps equal torch's
    on the global batch; state_dict keys and order are the module's; eval under no_grad gives
    the reference's output; afterwards no unit holds full params and the ledger agrees."""
    world, per_rank = results
    if world != 2 and name not in DP1_DP4:
        pytest.skip("dp=2 only")
    for rank, res in enumerate(case_result(per_rank, name)):
        where = f"dp={world} rank {rank} {name}"
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= ATOL, f"{where}: {worst}"
        assert res["keys"], where
        assert res["eval_err"] <= ATOL, f"{where}: eval output off by {res['eval_err']}"
        assert res["released"] and res["ledger_now"] == 0, where
        assert res["gathers"] > 0, where
        if TRAIN[name].get("native"):
            assert res["strategy"].all_gather == "native", where
        if name == "expert_parallel_params":
            assert res["expert_groups"] > 0, where
        if name == "frozen_params":
            assert res["frozen_whole"] and all(res["frozen_whole"]), where


def test_forward_order_change_warns_and_stays_correct(results: Any) -> None:
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "forward_order_changes"):
        assert any("different order" in w for w in res["warnings"]), res["warnings"]
    for res in case_result(per_rank, "forward_order_not_registration_order"):
        assert not any("different order" in w for w in res["warnings"]), res["warnings"]


def test_bitwise_equal_to_optim_and_across_reshard_and_prefetch(results: Any) -> None:
    """At dp=2 and one micro-batch, ZeRO-3 under every reshard_after_forward / prefetch_units
    setting gives bitwise the params of ZeRO-1 ("optim")."""
    world, per_rank = results
    _only(2, world)
    for rank in range(world):
        want = case_result(per_rank, "sweep_optim")[rank]["final"]
        for name in SWEEP:
            got = case_result(per_rank, name)[rank]["final"]
            assert list(got) == list(want), name
            for key in want:
                assert got[key].equal(want[key]), f"rank {rank} {name}: {key} differs"


def _later_units_released(res: dict[str, Any]) -> None:
    order = [n for n in res["order"] if n and n in res["in_backward"]]
    for i, name in enumerate(order):
        holds = res["in_backward"][name]
        for later in order[i + 1 :]:
            assert not holds[later], f"{later} holds params at {name}'s backward: {holds}"


def test_released_after_post_forward_post_backward_and_step(results: Any) -> None:
    """reshard_after_forward: every non-root unit is released at its post-forward; a unit's
    params are released once its backward is done (seen from the previous unit's backward);
    nothing is held after backward or after the step; the unsharded peak is within
    (1 + prefetch_units) units plus the root."""
    world, per_rank = results
    _only(2, world)
    for name in ("release_mlp", "release_ckpt"):
        for res in case_result(per_rank, name):
            assert res["strategy"] == "OptimGradsParams"
            assert res["phases"] == ["FORWARD_DONE", "IDLE"]  # [Note: who gathers when]
            assert res["post_forward"] and not any(res["post_forward"].values()), res
            _later_units_released(res)
            assert not any(res["after_backward"].values()), res["after_backward"]
            assert not any(res["after_step"].values()), res["after_step"]
            assert res["ledger_now"] == 0
            sizes = res["unit_nbytes"]
            root = sizes.get("<root>", 0)
            biggest = max(v for k, v in sizes.items() if k != "<root>") if len(sizes) > 1 else 0
            assert res["ledger_peak"] <= root + 2 * biggest, (res["ledger_peak"], sizes)
            # state_dict() gathers one unit's group at a time
            assert res["state_dict_peak"] == max(sizes.values()), res["state_dict_peak"]


def test_no_reshard_keeps_units_until_backward(results: Any) -> None:
    """reshard_after_forward=False is the strategy `OptimGradsParamsNoReshard`: every unit
    stays gathered from its forward to its backward (bitwise equal to "optim_grads_params":
    the sweep_noreshard_* cases of the test above)."""
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "release_mlp_no_reshard"):
        assert res["strategy"] == "OptimGradsParamsNoReshard"
        assert res["phases"] == ["FORWARD_DONE", "IDLE"]
        assert all(res["post_forward"].values()), res["post_forward"]
        assert all(res["after_forward"].values()), res["after_forward"]
        _later_units_released(res)
        assert not any(res["after_backward"].values()), res["after_backward"]


def test_read_of_released_param_raises(results: Any) -> None:
    """Outside forward a released param has no storage: a read raises instead of returning
    stale values; summon_full_params() makes it readable and releases it again."""
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "read_released"):
        assert "value" not in res and res.get("error"), res
        assert res["summoned"] and res["summoned_holds"] and res["released_after"], res


def test_verify_param_access_reads_nan(results: Any) -> None:
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "read_verify_mode"):
        assert "value" in res and math.isnan(res["value"]), res
        assert res["summoned"], res


def test_named_errors(results: Any) -> None:
    world, per_rank = results
    _only(2, world)
    for rank, res in enumerate(case_result(per_rank, "errors")):
        for label in ("finish_unstarted", "release_released"):
            msg = res[label]
            assert msg.startswith("RuntimeError: megabuf: bucket group"), msg
            assert "SHARDED" in msg and f"rank {rank}" in msg and "shard unit" in msg, msg
        assert res["keep_vars"].startswith("ValueError: megabuf: state_dict(keep_vars=True)")
        assert res["positional"].startswith("ValueError: megabuf: state_dict() under optim_gr")
        assert res["state"] == "SHARDED"


def test_load_state_dict_writes_the_shards(results: Any) -> None:
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "load_state_dict"):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= ATOL, worst


def test_eval_forward_releases_every_unit(results: Any) -> None:
    world, per_rank = results
    _only(2, world)
    for states in case_result(per_rank, "eval_states"):
        assert states and set(states) == {"SHARDED"}, states


def test_stray_read_in_first_forward_names_param_and_units(results: Any) -> None:
    """Default units make the children of ParentReads units, yet the parent reads `inner`'s
    weight: the first forward raises on every rank naming the param, its unit and the unit
    running, instead of reading a released (0-byte) storage."""
    world, per_rank = results
    _only(2, world)
    for rank, msg in enumerate(case_result(per_rank, "stray_read")):
        assert msg.startswith("megabuf: inner.weight (shard unit inner) is read while"), msg
        assert f"forward of unit <root> (rank {rank})" in msg and "shard_units" in msg, msg


def test_bf16_params_with_fp32_main_params_bitwise_equal_to_optim(results: Any) -> None:
    """bf16 GPT (tied embeddings), fp32 grads and fp32 main params: ZeRO-3 writes the updated
    main shard into the bf16 param shard; the params equal ZeRO-1's bit for bit at dp=2."""
    world, per_rank = results
    _only(2, world)
    for rank in range(world):
        want = case_result(per_rank, "bf16_optim")[rank]["final"]
        got = case_result(per_rank, "bf16_zero3")[rank]["final"]
        assert list(got) == list(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].equal(want[key]), key


def test_checkpoint_saved_under_zero3_resumes_under_zero1_and_zero3(results: Any) -> None:
    """save_checkpoint under ZeRO-3 (model space: the params gathered unit by unit), then
    load_checkpoint under ZeRO-1 and under ZeRO-3 at dp=2: the 2 steps after resuming give
    bitwise the params of the uninterrupted run."""
    world, per_rank = results
    _only(2, world)
    for res in case_result(per_rank, "checkpoint"):
        want = res["uninterrupted"]
        for label in ("zero3", "other"):
            for key in want:
                assert res[label][key].equal(want[key]), f"{label}: {key}"


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_schedules_under_zero3(results: Any, name: str) -> None:
    """1F1B and interleaved 1F1B (pp=2 x dp=2, tied embeddings on the first and last stage)
    under optim_grads_params: the params after 3 SGD steps equal one process's on the global
    batch (the schedules' param_sync hooks are no-ops: units gather in forward)."""
    world, per_rank = results
    _only(4, world)
    for rank, res in enumerate(case_result(per_rank, name)):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= ATOL, f"{name} rank {rank}: {worst}"


def test_compress_hook_under_zero3_bitwise_equal_to_zero1(results: Any) -> None:
    """Compress(bf16, fp32 accumulation) reduces the same grads under ZeRO-3 as under ZeRO-1:
    the params after 3 steps are bitwise equal at dp=2."""
    world, per_rank = results
    _only(2, world)
    for rank in range(world):
        want = case_result(per_rank, "compress_optim")[rank]["final"]
        got = case_result(per_rank, "compress_zero3")[rank]["final"]
        assert all(got[k].equal(want[k]) for k in want), rank
