"""PowerSGD and BatchedPowerSGD on real gloo ranks ([Note: PowerSGD in megabuf]): against torch's
powerSGD_hook on torch DDP, against the exact reduction at full rank, the error-feedback
invariant, reduce-scatter mode against all-reduce mode, Q on every rank, no_sync, overlap,
expert buffers, wire bytes, a skipped inf step, state round trips. dp=2 mostly (one pool), a few
cases at dp=1 and dp=4."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from powersgd_cases import (
    batched_invariant_case,
    config_case,
    expert_case,
    fullrank_case,
    invariant_case,
    no_sync_case,
    overlap_case,
    q_identical_case,
    reduce_hook_sanity,
    roundtrip_case,
    rs_vs_ar_case,
    skip_case,
    state_errors_case,
    torch_parity_case,
    wire_case,
)

from megabuf import DistributedDataParallelConfig
from megabuf.comm_hooks import BatchedPowerSGD, PowerSGD, build
from megabuf.comm_hooks.lowrank import orthogonalize_, plan_bucket, shard_rows, should_compress

AR: dict[str, Any] = {}
RS = {"use_distributed_optimizer": True}
SMALL = {"bucket_size": 300}  # several buckets; matrices straddle RS shard boundaries
COPIES = {"batch_same_shape": True, "factor_dtype": torch.float64}  # stacked factor-dtype copies

PARITY = {
    "r1_ef_warm": (1, True, True, False),
    "r1_plain": (1, False, False, False),
    "r1_ef_cold": (1, True, False, False),
    "r1_warm_no_ef": (1, False, True, False),
    "r2_ef_warm_batched": (2, True, True, True),
}

CASES2: dict[str, tuple[Any, ...]] = {
    **{f"parity_{k}": (torch_parity_case, *v) for k, v in PARITY.items()},
    "fullrank_ar": (fullrank_case, SMALL),
    "fullrank_rs": (fullrank_case, {**RS, **SMALL}),
    "fullrank_rs_avg": (fullrank_case, {**RS, **SMALL, "average_in_collective": True}),
    "fullrank_ar_overlap": (fullrank_case, {**SMALL, "overlap_grad_reduce": True}),
    "fullrank_batched_ar": (fullrank_case, SMALL, "BatchedPowerSGD"),
    "fullrank_batched_rs": (fullrank_case, {**RS, **SMALL}, "BatchedPowerSGD"),
    "invariant_ar": (invariant_case, SMALL),
    "invariant_rs": (invariant_case, {**RS, **SMALL}),
    "invariant_ar_avg": (invariant_case, {**SMALL, "average_in_collective": True}, 2),
    "invariant_batched_ar": (batched_invariant_case, SMALL),
    "invariant_batched_rs": (batched_invariant_case, {**RS, **SMALL}),
    "rs_vs_ar": (rs_vs_ar_case, SMALL),
    "rs_vs_ar_one_bucket": (rs_vs_ar_case, {}),
    "rs_vs_ar_no_ef": (rs_vs_ar_case, SMALL, "PowerSGD", 4, {"error_feedback": False}),
    "rs_vs_ar_copies": (rs_vs_ar_case, SMALL, "PowerSGD", 4, COPIES),
    "rs_vs_ar_copies_no_ef": (
        rs_vs_ar_case,
        SMALL,
        "PowerSGD",
        4,
        {**COPIES, "error_feedback": False},
    ),
    "rs_vs_ar_batched": (rs_vs_ar_case, {"bucket_size": 600}, "BatchedPowerSGD"),
    "rs_vs_ar_batched_no_ef": (
        rs_vs_ar_case,
        {"bucket_size": 600},
        "BatchedPowerSGD",
        4,
        {"error_feedback": False},
    ),
    "q_identical": (q_identical_case, SMALL),
    "no_sync": (no_sync_case, SMALL),
    "overlap": (overlap_case, SMALL),
    "overlap_rs": (overlap_case, {**RS, **SMALL}),
    "expert_ep1": (expert_case, 1, {}),
    "expert_ep1_rs": (expert_case, 1, RS),
    "expert_ep2": (expert_case, 2, {}),
    "wire_ar": (wire_case, SMALL, "PowerSGD"),
    "wire_rs_fp64": (wire_case, {**RS, **SMALL}, "PowerSGD", "float64"),
    "wire_batched": (wire_case, SMALL, "BatchedPowerSGD"),
    "skip": (skip_case, {}),
    "roundtrip": (roundtrip_case, SMALL, 200),
    "state_errors": (state_errors_case,),
    "config": (config_case, SMALL),
    "before_start": (reduce_hook_sanity,),
}
CASES4: dict[str, tuple[Any, ...]] = {
    "fullrank_ar": (fullrank_case, SMALL),
    "fullrank_rs": (fullrank_case, {**RS, **SMALL}),
    "invariant_rs": (invariant_case, {**RS, **SMALL}),
    "rs_vs_ar": (rs_vs_ar_case, SMALL),
}
CASES1: dict[str, tuple[Any, ...]] = {
    "fullrank_ar": (fullrank_case, SMALL),
    "invariant_ar": (invariant_case, SMALL),
}


@pytest.fixture(scope="module")
def dp2(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES2)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp4(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, CASES4)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp1(pools: Any) -> list[dict[str, Any]]:
    return pools(1).run(run_each, CASES1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(PARITY))
def test_matches_torch_powersgd_hook_step_by_step(dp2: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp2, f"parity_{name}")):
        assert res["torch_order"] == res["megabuf_order"], res  # same Q draw order
        assert res["changed"], res  # compression did change the grads
        assert max(res["grad_err"]) <= 1e-6, f"rank {rank}: {res['grad_err']}"
        assert max(res["param_err"]) <= 1e-6, f"rank {rank}: {res['param_err']}"
    if "batched" in name:
        assert res["n_units"] == 3  # l2/l3 share a unit


@pytest.mark.parametrize(
    "name",
    ["fullrank_ar", "fullrank_rs", "fullrank_rs_avg", "fullrank_ar_overlap",
     "fullrank_batched_ar", "fullrank_batched_rs"],
)  # fmt: skip
def test_full_rank_equals_the_exact_reduction(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["n_buckets"] > 2, res
        assert res["calls"] == 3 * res["n_buckets"], res
        assert max(res["errs"]) <= 1e-5, res


@pytest.mark.parametrize("name", ["fullrank_ar", "fullrank_rs"])
def test_full_rank_equals_the_exact_reduction_dp4(dp4: Any, name: str) -> None:
    for res in case_result(dp4, name):
        assert max(res["errs"]) <= 1e-5, res


def test_dp1(dp1: Any) -> None:
    res = case_result(dp1, "fullrank_ar")[0]
    assert max(res["errs"]) <= 1e-5, res
    res = case_result(dp1, "invariant_ar")[0]
    assert max(res["errs"]) <= 1e-6 and all(res["nonzero"][1:]), res


@pytest.mark.parametrize(
    "name", ["invariant_ar", "invariant_rs", "invariant_ar_avg", "invariant_batched_ar",
             "invariant_batched_rs"],
)  # fmt: skip
def test_error_feedback_invariant_every_step(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert max(res["errs"]) <= 1e-6, res
        if "nonzero" in res:
            assert res["nonzero"] == [False, True, True, True], res  # step 0 is plain


def test_error_feedback_invariant_dp4(dp4: Any) -> None:
    for res in case_result(dp4, "invariant_rs"):
        assert max(res["errs"]) <= 1e-6, res


@pytest.mark.parametrize(
    "name", ["rs_vs_ar", "rs_vs_ar_one_bucket", "rs_vs_ar_no_ef", "rs_vs_ar_copies",
             "rs_vs_ar_copies_no_ef", "rs_vs_ar_batched", "rs_vs_ar_batched_no_ef"],
)  # fmt: skip
def test_reduce_scatter_shard_is_the_all_reduce_slice(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["straddles"], res
        assert max(res["errs"]) <= 1e-6, res
        if "batched" in name:  # whole-bucket matrices: both modes have the same buckets
            assert res["numels"][0] == res["numels"][1] and len(res["numels"][0]) > 1, res


def test_reduce_scatter_shard_is_the_all_reduce_slice_dp4(dp4: Any) -> None:
    for res in case_result(dp4, "rs_vs_ar"):
        assert res["straddles"], res
        assert max(res["errs"]) <= 1e-6, res


def test_q_is_identical_on_every_rank(dp2: Any) -> None:
    for res in case_result(dp2, "q_identical"):
        assert res["same"], res
        assert res["q_keys"], res


def test_no_sync_runs_the_hook_once_on_the_accumulated_buffer(dp2: Any) -> None:
    for res in case_result(dp2, "no_sync"):
        assert res["calls"] == res["n_buckets"], res
        assert res["same_input"], res
        assert res["step"] == 1, res


@pytest.mark.parametrize("name", ["overlap", "overlap_rs"])
def test_overlap_on_and_off_are_bitwise_equal(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["n_groups"] > 1, res
        assert all(res["same"]), res


@pytest.mark.parametrize("name", ["expert_ep1", "expert_ep1_rs", "expert_ep2"])
def test_dense_and_expert_buffers(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["n_expert"] >= 1 and res["groups_ok"], res
        assert res["compressed_expert"], res
        assert res["keys"] == ["dense", "expert"], res
        assert max(res["errs"]) <= 1e-5, res


@pytest.mark.parametrize("name", ["wire_ar", "wire_rs_fp64", "wire_batched"])
def test_wire_bytes_equal_the_formula(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert set(res["counted"]) == {"all_reduce"}, res
        assert res["counted"]["all_reduce"] == res["expected"], res
        assert res["expected"] < res["full_nbytes"] or name == "wire_rs_fp64", res


def test_a_skipped_inf_step_resets_the_hook(dp2: Any) -> None:
    for res in case_result(dp2, "skip"):
        assert res["oks"] == [True, True, True, False] + [True] * 6, res
        assert res["reset_ok"], res
        assert res["scale_after_skip"] == 2.0**10, res  # grew to 2^11 at step 1, backed off
        assert res["scales"][-1] > res["scale_after_skip"], res  # it grew after the skip
        assert all(res["same"]), res
        assert not any(res["broken_oks"]), res  # without the reset the NaN stays: all skipped
        assert res["growth_scales"] == 2.0**13, res
        assert res["growth_same"], res


def test_state_round_trip_into_a_new_engine(dp2: Any) -> None:
    for res in case_result(dp2, "roundtrip"):
        assert res["keys"] == ["layout", "per_rank", "replicated"], res
        assert res["n_errors"] == 4, res
        assert res["same_layout"], res
        assert res["other_layout"], res
        assert res["merged_total_err"] <= 1e-6, res
        assert res["merged_param_err"] <= 1e-4, res


STATE_ERRORS = {
    "unknown_param": "'error/nope.weight' does not name held by",
    "uncompressed_param": "'error/l1.bias' does not name a compressed matrix of",
    "wrong_rank": "has shape",
    "batched_layout": "BatchedPowerSGD state is tied to the bucket layout; saved with",
    "powersgd_from_batched": "saved by BatchedPowerSGD",
}


def test_state_that_does_not_fit_is_refused_by_name(dp2: Any) -> None:
    for res in case_result(dp2, "state_errors"):
        for key, text in STATE_ERRORS.items():
            assert res[key] is not None and text in res[key], (key, res[key])
        assert res["batched_same_layout"] is None, res


def test_comm_hook_config_builds_powersgd(dp2: Any) -> None:
    for res in case_result(dp2, "config"):
        assert all(res["same"]), res
        assert res["types"] == ["PowerSGD"], res


def test_before_start_step_it_is_reduce(dp2: Any) -> None:
    for res in case_result(dp2, "before_start"):
        assert res["same"] == [True, True, False], res


# ---- without processes ---------------------------------------------------------------------------
def test_build_and_toml(tmp_path: Any) -> None:
    hook = build({"name": "powersgd", "rank": 4, "start_step": 0, "factor_dtype": "float32"})
    assert isinstance(hook, PowerSGD) and hook.rank == 4 and hook.factor_dtype is torch.float32
    assert isinstance(build({"name": "batched_powersgd"}), BatchedPowerSGD)
    path = tmp_path / "psgd.toml"
    path.write_text('[ddp]\n\n[comm_hook]\nname = "powersgd"\nrank = 2\nstart_step = 10\n')
    cfg = DistributedDataParallelConfig.from_toml(path)
    assert cfg.comm_hook == {"name": "powersgd", "rank": 2, "start_step": 10}


@pytest.mark.parametrize(
    "options, text",
    [({"rank": 0}, "rank=0 must be an int >= 1"),
     ({"start_step": -1}, "start_step=-1 must be an int >= 0"),
     ({"min_compression_rate": -1.0}, "min_compression_rate=-1.0 must be >= 0"),
     ({"orthogonalization_epsilon": -1e-8}, "orthogonalization_epsilon=-1e-08 must be >= 0"),
     ({"factor_dtype": torch.int32}, "factor_dtype=torch.int32 must be a floating")],
)  # fmt: skip
def test_bad_options_are_named(options: dict[str, Any], text: str) -> None:
    with pytest.raises(ValueError, match="PowerSGD") as info:
        PowerSGD(**options)
    assert text in str(info.value)
    if "min_compression_rate" not in options:
        with pytest.raises(ValueError, match="BatchedPowerSGD"):
            BatchedPowerSGD(**options)


def test_compression_rule_and_plan() -> None:
    assert not should_compress((1000,), 1, 0.0)  # 1-D never
    assert should_compress((24, 16), 1, 2.0)  # (24 + 16) * 1 * 2 = 80 < 384
    assert not should_compress((4, 4), 1, 2.0)  # 16 == 16
    assert should_compress((4, 4), 1, 1.9)
    assert should_compress((6, 2, 2), 1, 2.0)  # 6 x 4: (6 + 4) * 2 = 20 < 24
    assert not should_compress((3, 2, 2), 1, 2.0)  # 3 x 4: 14 >= 12
    plan = plan_bucket([(5, 24), (24,), (24, 24), (24, 24), (24, 16)], 2, 2.0, True)
    assert [u.members for u in plan.units] == [(0,), (2, 3), (4,)]
    assert plan.uncompressed == (1,)
    assert plan.factor_numel == 2 * (5 + 24) + 2 * 2 * 48 + 2 * 40
    unbatched = plan_bucket([(5, 24), (24,), (24, 24), (24, 24), (24, 16)], 2, 2.0, False)
    assert [u.members for u in unbatched.units] == [(0,), (2,), (3,), (4,)]


def test_shard_rows_cover_straddling_matrices() -> None:
    # a 4 x 10 matrix at elements [5, 45); shard [20, 33): rows 1 (15..25) to 2 (25..35)
    assert shard_rows(5, 40, 10, 20, 33) == (1, 3)
    assert shard_rows(5, 40, 10, 45, 60) == (0, 0)
    assert shard_rows(5, 40, 10, 0, 6) == (0, 1)


def test_orthogonalize_gram_schmidt_and_zero_columns() -> None:
    x = torch.randn(3, 7, 2, dtype=torch.float64)
    orthogonalize_(x)
    eye = torch.eye(2, dtype=torch.float64).expand(3, 2, 2)
    assert torch.allclose(x.transpose(1, 2) @ x, eye, atol=1e-12)
    z = torch.zeros(1, 5, 1)
    orthogonalize_(z)
    assert torch.equal(z, torch.zeros(1, 5, 1))  # torch's hook: NaN
    y = torch.randn(2, 9, 4, dtype=torch.float64)  # r > 2: QR
    orthogonalize_(y)
    assert torch.allclose(y.transpose(1, 2) @ y, torch.eye(4, dtype=torch.float64), atol=1e-12)
