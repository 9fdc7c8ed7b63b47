"""The grad contract ([Note: grad contract] in megabuf/sync/grads.py) on real gloo ranks, each case
against a single-process reference: params unused on some ranks, strict mode, reentrant
checkpointing with overlap, params changed after wrapping, recovery after an exception, fp16
reduce-scatter overflow, one dispatch chain for a shared group, accumulation over bf16 copies."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from contract_cases import DIVERGENT, SINGLE, run_divergent, run_single
from dist_pool import case_result
from torch import nn

from megabuf.planning.replicas import ParamStructure

WORLD_SIZES = [2, 4]


@pytest.fixture(scope="module")
def divergent(pools: Any) -> dict[int, list[dict[str, Any]]]:
    return {ws: pools(ws).run(run_divergent) for ws in WORLD_SIZES}


@pytest.fixture(scope="module")
def single(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_single)


def _ok(results: list[dict[str, Any]], name: str) -> list[Any]:
    return case_result(results, name)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", list(DIVERGENT))
def test_params_unused_on_some_ranks_train_identically_to_reference(
    divergent: dict[int, list[dict[str, Any]]], world_size: int, name: str
) -> None:
    results = _ok(divergent[world_size], name)
    ref = results[0]["ref"]
    for rank, res in enumerate(results):
        for pname, value in res["params"].items():
            # replicas are bitwise equal to each other, whatever the rank used
            assert torch.equal(value, results[0]["params"][pname]), (rank, pname)
            # dp=2 sums are order-independent: bitwise; dp=4: gloo's summation order
            err = (value.float() - ref[pname].float()).abs().max().item()
            assert err <= (0.0 if world_size == 2 else 1e-6), (rank, pname, err)
        if not DIVERGENT[name]["ddp"].get("use_distributed_optimizer"):
            assert res["grads_none"] == [[]] * 3, (rank, res["grads_none"])


def test_strict_mode_raises_on_every_rank_naming_params_and_ranks(
    single: list[dict[str, Any]],
) -> None:
    for rank, msg in enumerate(_ok(single, "strict_unused")):
        assert "error_on_unused_params" in msg and f"seen on rank {rank}" in msg, msg
        assert "head_b.weight (ranks [1])" in msg and "head_b.bias (ranks [1])" in msg, msg
        assert "head_a" not in msg and "body" not in msg, msg


def test_strict_mode_costs_one_small_all_reduce(single: list[dict[str, Any]]) -> None:
    dp = len(single)
    for res in _ok(single, "strict_mode_cost"):
        assert res["calls_True"] == res["calls_False"] + 1, res
        flags_nbytes = 4 * dp * res["n_trainable"]  # fp32 flag per (dp rank, trainable param)
        assert res["bytes_True"] == res["bytes_False"] + flags_nbytes, res


def test_reentrant_checkpointing_with_overlap_matches_reference(
    single: list[dict[str, Any]],
) -> None:
    for res in _ok(single, "reentrant_checkpointing"):
        assert max(res["errors"]) <= 1e-6, res["errors"]
        # the first iteration learns arrival counts; later ones dispatch while backward runs
        assert res["early_dispatches"][0] == 0, res
        assert all(n > 0 for n in res["early_dispatches"][1:]), res


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ("replace", "'head_a.weight' was replaced"),
        ("freeze", "'head_a.bias' was frozen"),
        ("unfreeze", "'never.weight' was unfrozen"),
        ("add_param", "'head_a.extra' was added"),
        ("add_module", "'head_c.weight' was added"),
        ("remove", "'head_a.bias' was removed"),
    ],
)
def test_params_changed_after_wrapping_raise_naming_the_param(
    single: list[dict[str, Any]], change: str, words: str
) -> None:
    for rank, msg in enumerate(_ok(single, change)):
        assert words in msg and f"rank {rank}" in msg and "wrap" in msg, msg


@pytest.mark.parametrize(
    ("change", "words"),
    [("del_submodule", "'0.weight' was removed"), ("new_submodule", "'2.weight' was added")],
)
def test_param_structure_names_params_of_submodules_added_or_removed(
    change: str, words: str
) -> None:  # pure: the check itself, no process group
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    structure = ParamStructure(model)
    if change == "del_submodule":
        del model[0]
    else:
        model.append(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=words):
        structure.check(rank=0)
    harmless = nn.Sequential(nn.Linear(2, 2))
    structure = ParamStructure(harmless)
    harmless.append(nn.ReLU())
    structure.check(rank=0)  # a module without params changes nothing megabuf is bound to
    structure.check(rank=0)


def test_a_module_without_params_added_after_wrapping_is_harmless(
    single: list[dict[str, Any]],
) -> None:
    for msg in _ok(single, "add_parameterless_module"):
        assert msg == "no error", msg


def test_reset_iter_state_after_exception_in_backward(single: list[dict[str, Any]]) -> None:
    for res in _ok(single, "reset_after_exception"):
        assert "planted failure" in res["raised"], res
        assert "DISPATCHED" in res["states_after_exception"], res  # failed mid-iteration
        assert res["error"] <= 1e-6, res


def test_fp16_reduce_scatter_does_not_overflow_where_the_mean_fits(
    single: list[dict[str, Any]],
) -> None:
    shard = _ok(single, "fp16_reduce_scatter")[0]  # rank 0's shard holds the weight
    assert shard["max"] == shard["min"] == 40000.0, shard


def test_dense_and_expert_share_one_chain_on_a_shared_group(
    single: list[dict[str, Any]],
) -> None:
    for res in _ok(single, "one_chain"):
        assert res["expert_groups"] == 2 and res["chains"] == 1, res
        assert max(res["errors"]) <= 1e-6, res


def test_backward_after_sync_accumulates_on_reduced_grad_not_bf16_copy(
    single: list[dict[str, Any]],
) -> None:
    for res in _ok(single, "bf16_accumulate_after_sync"):
        assert res["error"] <= 1e-6 and res["copy_matches_main_grad"] == 1.0, res


@pytest.mark.parametrize("name", ["step_without_backward_fp32", "step_without_backward_bf16"])
def test_torch_optimizer_step_without_backward_leaves_params_alone(
    single: list[dict[str, Any]], name: str
) -> None:
    assert all(_ok(single, name)), name


@pytest.mark.parametrize("name", ["broadcast_then_step_mixed", "broadcast_then_step_distopt"])
def test_optimizer_follows_params_changed_by_broadcast_params(
    single: list[dict[str, Any]], name: str
) -> None:
    for res in _ok(single, name):
        assert res == {"ok": True, "all_half": True}, res


def test_every_single_case_has_a_test() -> None:
    covered = {"strict_unused", "reentrant_checkpointing", "replace", "freeze", "unfreeze",
               "reset_after_exception", "fp16_reduce_scatter", "one_chain",
               "add_param", "add_module", "remove", "add_parameterless_module",
               "bf16_accumulate_after_sync", "step_without_backward_fp32",
               "step_without_backward_bf16", "broadcast_then_step_mixed",
               "broadcast_then_step_distopt", "strict_mode_cost"}  # fmt: skip
    assert covered == set(SINGLE)
