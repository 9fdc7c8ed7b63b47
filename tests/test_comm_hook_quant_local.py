"""`Quantize` ([Note: int8 wire, fp32 sum]) and `LocalSGD` + `PeriodicAverager` ([Note: local
SGD]) on real gloo ranks at dp=1, 2 and 4, against single-process emulations (bitwise: the int8
rounding and the rank-order fp32 sum are reproduced exactly; a subgroup of 2 sums two values)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from quant_local_cases import (
    averager_case,
    checkpoint_case,
    local_sgd_case,
    local_sgd_errors_case,
    quantize_case,
    quantize_dp1_case,
    quantize_expert_case,
    quantize_no_sync_case,
)

from megabuf.comm_hooks import LocalSGD, LocalSGDError, Quantize, QuantizeError, build
from megabuf.comm_hooks.quantize import QuantGeometry, dequantize_row, quantize_rows

AR: dict[str, Any] = {"bucket_size": 64, "overlap_grad_reduce": True}
RS = {**AR, "use_distributed_optimizer": True}

CASES_DP2: dict[str, tuple[Any, ...]] = {
    "quant_ar": (quantize_case, AR),
    "quant_rs": (quantize_case, RS),
    "quant_ar_avg": (quantize_case, {**AR, "average_in_collective": True}),
    "quant_rs_avg": (quantize_case, {**RS, "average_in_collective": True}),
    "quant_ar_bf16": (quantize_case, AR, True),
    "quant_rs_bf16": (quantize_case, RS, True),
    "quant_no_sync_ar": (quantize_no_sync_case, AR),
    "quant_no_sync_rs": (quantize_no_sync_case, RS),
    "quant_expert_ep1": (quantize_expert_case, 1, {}),
    "quant_expert_ep1_rs": (quantize_expert_case, 1, {"use_distributed_optimizer": True}),
}
CASES_DP4: dict[str, tuple[Any, ...]] = {
    "quant_ar": (quantize_case, AR),
    "quant_rs": (quantize_case, RS),
    "quant_expert_ep2": (quantize_expert_case, 2, {}),
    "lsgd_sub2": (local_sgd_case, 2, True),
    "lsgd_no_reduce": (local_sgd_case, 2, False),
    "lsgd_moe_ep1": (local_sgd_case, 2, True, 1),
    "lsgd_avg": (local_sgd_case, 2, True, 0, True),
    "averager": (averager_case,),
    "checkpoint": (checkpoint_case,),
    "errors": (local_sgd_errors_case,),
}


@pytest.fixture(scope="module")
def dp2(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES_DP2)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp4(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, CASES_DP4)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp1(pools: Any) -> list[dict[str, Any]]:
    return pools(1).run(run_each, {"quant": (quantize_dp1_case,)})  # type: ignore[no-any-return]


# ---- Quantize ------------------------------------------------------------------------------
def _check_quant(res: dict[str, Any], name: str, rank: int) -> None:
    assert res["bitwise"], f"{name} rank {rank}: differs from the emulated int8 rounding"
    assert res["bound_ratio"] <= 1.0, f"{name} rank {rank}: {res['bound_ratio']}"


def _formula(res: dict[str, Any], name: str) -> int:
    """(d-1)·(c + 4·nb) per bucket for the reduce-scatter, twice that for the all-reduce:
    c = ceil(numel / d) one-byte codes and nb = ceil(c / 16) fp32 scales per destination."""
    d, total = res["group_size"], 0
    for numel in res["bucket_numels"]:
        chunk = -(-numel // d)
        total += (d - 1) * (chunk + 4 * -(-chunk // 16))
    return total if "rs" in name else 2 * total


@pytest.mark.parametrize(
    "name",
    ["quant_ar", "quant_rs", "quant_ar_avg", "quant_rs_avg", "quant_ar_bf16", "quant_rs_bf16"],
)
def test_quantize_dp2_is_its_emulation_within_the_bound_and_wire_bytes(dp2: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp2, name)):
        _check_quant(res, name, rank)
        assert res["hook_calls"] == res["n_buckets"] > 2, res
        assert res["differs_from_fp32"], res  # the rounding happened
        assert res["ring_nbytes"] == res["wire_nbytes"] == _formula(res, name) > 0, res
        assert res["same_workspaces"], res  # the second step reuses every workspace
        ops = {"all_to_all": 2 * res["n_buckets"]}
        if "ar" in name:
            ops["all_gather"] = 2 * res["n_buckets"]
        assert res["calls"] == ops, res
        assert res["modes"] == (["reduce_scatter"] if "rs" in name else ["all_reduce"])
        if "bf16" in name:  # bitwise also where the fp32 sum is rounded into bf16 grads
            assert res["grad_dtypes"] == ["torch.bfloat16", "torch.float32"], res


@pytest.mark.parametrize("name", ["quant_ar", "quant_rs"])
def test_quantize_dp4_is_its_emulation_and_wire_is_d_minus_1_over_d(dp4: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp4, name)):
        _check_quant(res, name, rank)
        assert res["ring_nbytes"] == res["wire_nbytes"] == _formula(res, name), res
        # about (d-1)/d = 3/4 byte per element, not torch's all-gather-based (d-1) = 3
        if name == "quant_rs":
            assert res["ring_nbytes"] < 3 * sum(res["bucket_numels"]) / 2, res


def test_quantize_dp1_sends_nothing_and_is_the_round_trip(dp1: Any) -> None:
    (res,) = case_result(dp1, "quant")
    _check_quant(res, "quant dp1", 0)
    assert res["ring_nbytes"] == res["wire_nbytes"] == 0, res


@pytest.mark.parametrize("name", ["quant_no_sync_ar", "quant_no_sync_rs"])
def test_quantize_after_no_sync_runs_once_on_the_summed_buffer(dp2: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp2, name)):
        assert res["hook_calls"] == res["n_buckets"], res  # once, not per micro-batch
        assert res["same_input"], res
        _check_quant(res, name, rank)


@pytest.mark.parametrize("name", ["quant_expert_ep1", "quant_expert_ep1_rs"])
def test_quantize_on_expert_buffers_dp2(dp2: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp2, name)):
        _check_quant(res, name, rank)
        assert res["n_expert_buckets"] >= 1 and res["expert_groups_ok"], res


def test_quantize_on_expert_buffers_over_expert_dp_dp4(dp4: Any) -> None:
    for rank, res in enumerate(case_result(dp4, "quant_expert_ep2")):
        _check_quant(res, "quant_expert_ep2", rank)
        assert res["n_expert_buckets"] >= 1 and res["expert_groups_ok"], res
        assert res["expert_group_size"] == 2, res


def test_quantize_rows_bound_zero_blocks_and_non_finite() -> None:
    gen = torch.Generator().manual_seed(0)
    block, nb = 8, 4
    x = torch.randn(2, nb * block, generator=gen) * torch.tensor([[1.0], [1e-30]])
    x[0, 8:16] = 0.0  # an all-zero block
    x[1, 16] = float("inf")  # a non-finite block
    stage, scales = x.clone().view(2, nb, block), torch.empty(2, nb)
    codes = torch.empty(2, nb * block - 3, dtype=torch.int8)  # a chunk ending inside a block
    quantize_rows(stage, scales, codes)
    out = torch.empty(nb * block)
    row0 = dequantize_row(codes[0], scales[0], out).clone()
    err = (row0 - x[0, : codes.shape[1]]).abs()
    bound = (x[0].view(nb, block).abs().amax(1) / 254).repeat_interleave(block)
    assert bool((err <= bound[: codes.shape[1]] * (1 + 1e-6)).all())
    assert bool((row0[8:16] == 0).all())  # zero block: exact zeros, no NaN
    assert codes.abs().max().item() == 127
    row1 = dequantize_row(codes[1], scales[1], out)
    assert not bool(row1[16:24].isfinite().any())  # the inf's block is non-finite
    assert bool(row1[:16].isfinite().all()) and bool(row1[24:].isfinite().all())


def test_quant_geometry_and_wire_formula() -> None:
    geo = QuantGeometry.of(numel=1000, group_size=4, block=64)
    assert (geo.chunk, geo.blocks) == (250, 4)
    assert geo.reduce_scatter_nbytes == 3 * (250 + 4 * 4)


def test_quantize_refuses_other_bits_and_bad_blocks() -> None:
    with pytest.raises(QuantizeError, match=r"bits=8 .* only, got bits=4"):
        Quantize(bits=4)
    with pytest.raises(QuantizeError, match="block must be a positive int"):
        Quantize(block=0)


def test_build_quantize_and_local_sgd_from_a_config_table() -> None:
    hook = build({"name": "quantize", "bits": 8, "block": 128})
    assert isinstance(hook, Quantize) and hook.block == 128
    lsgd = build({"name": "local_sgd", "start_step": 10, "period": 4, "subgroup_size": 2})
    assert isinstance(lsgd, LocalSGD) and (lsgd.start_step, lsgd.period) == (10, 4)
    with pytest.raises(QuantizeError):
        build({"name": "quantize", "bits": 4})


def test_local_sgd_option_errors() -> None:
    with pytest.raises(LocalSGDError, match="exactly one of subgroup_size"):
        LocalSGD(0, 1)
    with pytest.raises(LocalSGDError, match="exactly one of subgroup_size"):
        LocalSGD(0, 1, subgroup_size=2, subgroups=[[0, 1]])
    with pytest.raises(LocalSGDError, match="period must be an int >= 1"):
        LocalSGD(0, 0, subgroup_size=2)
    with pytest.raises(LocalSGDError, match="start_step must be an int >= 0"):
        LocalSGD(-1, 1, subgroup_size=2)


# ---- LocalSGD ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lsgd_sub2", "lsgd_moe_ep1", "lsgd_avg"])
def test_local_sgd_reduces_globally_then_in_subgroups(dp4: Any, name: str) -> None:
    results = case_result(dp4, name)
    for rank, res in enumerate(results):
        assert res["before_equal"] == [True, True], f"rank {rank}: not Reduce before start"
        assert res["after_equal"] and all(res["after_equal"]), f"rank {rank}: {res}"
        # subgroups {0,1} and {2,3}: the same grads inside, different across
        assert res["same_as_rank"] == [rank in (0, 1)] * 2 + [rank in (2, 3)] * 2, res
        if name != "lsgd_moe_ep1":  # one subgroup all-reduce per bucket (MoE: + all-to-alls)
            assert res["collectives_after"] == [{"all_reduce": res["n_buckets"]}] * 2, res
        assert res["step"] == 7, res
        assert len(res["warnings"]) == 1 and "Call PeriodicAverager" in res["warnings"][0]
    if name == "lsgd_moe_ep1":
        assert results[0]["n_expert_buckets"] >= 1, results[0]


def test_local_sgd_without_subgroup_reduction_keeps_local_grads(dp4: Any) -> None:
    for rank, res in enumerate(case_result(dp4, "lsgd_no_reduce")):
        assert res["before_equal"] == [True, True], res
        assert all(res["after_equal"]), res  # each rank's own mean grad
        assert res["same_as_rank"] == [r == rank for r in range(4)], res
        assert res["collectives_after"] == [{}, {}], res  # nothing at all after start


def test_periodic_averager_averages_main_and_model_params(dp4: Any) -> None:
    for rank, res in enumerate(case_result(dp4, "averager")):
        log = res["log"]
        assert [e["averaged"] for e in log] == [False, False, True, False, True, False], log
        assert [e["replicas_differ"] for e in log] == [False] + [True] * 5, log
        for entry in log:
            if entry["averaged"]:
                assert entry["mean_bitwise"], f"rank {rank}: {entry}"
                assert entry["identical"], f"rank {rank}: {entry}"
                assert entry["model_is_rounded_main"] and entry["n_copies"] >= 1, entry
                assert entry["moments_differ"], entry  # optimizer state is not averaged
        assert res["again"] is False, res
        assert res["warnings"] == [], res  # averaged on time: no "never averaged" warning
        # saved one local step after the averaging at 5, the replicas differ: refused
        assert "at step 6, between parameter averagings (the last at step 5)" in res["state"]


def test_local_sgd_state_round_trips_into_a_new_model(dp4: Any) -> None:
    for res in case_result(dp4, "checkpoint"):
        assert res["state"] == {"replicated": {"step": 2}, "per_rank": {}, "layout": {}}, res
        assert res["loaded_step"] == 2, res
        assert res["same"] and res["fresh_differs"], res
        assert res["bad_key"][0] == "ValueError" and "'x'" in res["bad_key"][1], res


LOCAL_SGD_ERRORS = {
    "not_dividing": ("LocalSGDError", "subgroup_size=3 does not divide the bucket's group size 4"),
    "not_partition": ("LocalSGDError", "must partition the group's ranks 0..3"),
    "rs_mode": ("CommHookModeError", "optimizer state is sharded over the whole dp group"),
    "averager_without_hook": ("LocalSGDError", "found 0 LocalSGD hooks"),
    "averager_other_model": ("LocalSGDError", "is not registered on this optimizer's model"),
    "distributed_optimizer": ("LocalSGDError", "needs a non-distributed optimizer"),
}


@pytest.mark.parametrize("what", sorted(LOCAL_SGD_ERRORS))
def test_local_sgd_named_errors(dp4: Any, what: str) -> None:
    cls, text = LOCAL_SGD_ERRORS[what]
    for rank, res in enumerate(case_result(dp4, "errors")):
        got = res[what]
        assert got is not None, f"{what}: nothing raised on rank {rank}"
        assert got[0] == cls and text in got[1], got
        if what in ("not_dividing", "not_partition", "rs_mode"):
            assert f"rank {rank}" in got[1], got


def test_local_sgd_explicit_subgroups(dp4: Any) -> None:
    for res in case_result(dp4, "errors"):
        assert res["explicit_subgroups"] is True, res
