"""torch DDP hooks through `from_torch`, `CompressWrapper`, and the bounded hook wait, on real gloo
ranks ([Note: torch hooks on megabuf buckets], [Note: bounded hook wait]).

Against torch DDP itself (gloo, same model, data, params and hook, a fresh hook state each side):
at dp=2 a sum of two values is order independent and torch's division by 2 exact, so grads and
SGD params are compared bitwise; dp=4 within a relative tolerance (gloo's sum order follows the
bucket layout, which differs: torch orders a bucket by the grads' arrival, megabuf by reverse
registration). PowerSGD is compared with one bucket on each side: its state is per bucket.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comm_hook_torch_cases import (
    batched_case,
    errors_case,
    is_last_case,
    multi_bucket_powersgd_case,
    timeout_case,
    vs_torch_case,
    wrapper_case,
    wrapper_config_case,
)
from dist_pool import case_result, run_each

from megabuf import DistributedDataParallelConfig
from megabuf.comm_hooks import (
    CommHookTimeoutError,
    GradBucket,
    HookWork,
    TorchGradBucket,
    from_torch,
)
from megabuf.transport.collectives import Collectives

MULTI = {"bucket_size": 64, "overlap_grad_reduce": True}
MULTI_SYNC = {"bucket_size": 64, "overlap_grad_reduce": False}
RS = {"use_distributed_optimizer": True}

CASES_DP2: dict[str, tuple[Any, ...]] = {
    "allreduce": (vs_torch_case, "allreduce", {}),
    "allreduce_world_multi": (vs_torch_case, "allreduce_world", MULTI),
    "allreduce_multi_sync": (vs_torch_case, "allreduce", MULTI_SYNC),
    "allreduce_avg": (vs_torch_case, "allreduce", {**MULTI, "average_in_collective": True}),
    "fp16": (vs_torch_case, "fp16", {}),
    "fp16_multi": (vs_torch_case, "fp16", MULTI),
    "bf16": (vs_torch_case, "bf16", {}),
    "bf16_multi": (vs_torch_case, "bf16", MULTI),
    "user": (vs_torch_case, "user", MULTI),
    "powersgd": (vs_torch_case, "powersgd", {}, 6),
    "powersgd_no_ef": (vs_torch_case, "powersgd_no_ef", {}, 6),
    "fp16_wrapper_powersgd": (vs_torch_case, "fp16_wrapper_powersgd", {}, 6),
    "multi_overlap": (multi_bucket_powersgd_case, True),
    "multi_sync": (multi_bucket_powersgd_case, False),
    "is_last_ep1": (is_last_case, 1),
    "is_last_ep2": (is_last_case, 2),
    "wrapper_ar": (wrapper_case, MULTI, torch.bfloat16),
    "wrapper_rs": (wrapper_case, {**RS, **MULTI}, torch.bfloat16),
    "wrapper_fp16_ar": (wrapper_case, {}, torch.float16),
    "wrapper_config": (wrapper_config_case, {**RS, **MULTI}),
    "batched": (batched_case,),
    "timeout": (timeout_case,),
    "errors": (errors_case,),
}
CASES_DP1: dict[str, tuple[Any, ...]] = {
    "allreduce": (vs_torch_case, "allreduce", MULTI),
    "powersgd": (vs_torch_case, "powersgd", {}, 6),
    "timeout": (timeout_case,),
}
CASES_DP4: dict[str, tuple[Any, ...]] = {
    "allreduce": (vs_torch_case, "allreduce", MULTI, 3),
    "powersgd": (vs_torch_case, "powersgd", {}, 5),
}


@pytest.fixture(scope="module")
def dp2(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES_DP2)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp1(pools: Any) -> list[dict[str, Any]]:
    return pools(1).run(run_each, CASES_DP1)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp4(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, CASES_DP4)  # type: ignore[no-any-return]


BITWISE_DP2 = [
    "allreduce", "allreduce_world_multi", "allreduce_multi_sync", "allreduce_avg", "fp16",
    "fp16_multi", "bf16", "bf16_multi", "user", "powersgd", "powersgd_no_ef",
    "fp16_wrapper_powersgd",
]  # fmt: skip


@pytest.mark.parametrize("name", BITWISE_DP2)
def test_torch_hook_matches_torch_ddp_bitwise_at_dp2(dp2: Any, name: str) -> None:
    for rank, res in enumerate(case_result(dp2, name)):
        assert all(res["grads_same"]), f"{name} rank {rank}: {res}"
        assert all(res["params_same"]), f"{name} rank {rank}: {res}"
        if "multi" in name or name == "user":
            assert res["n_buckets"] > 2, res


@pytest.mark.parametrize("name", ["allreduce", "powersgd"])
def test_torch_hook_matches_torch_ddp_at_dp1(dp1: Any, name: str) -> None:
    (res,) = case_result(dp1, name)
    assert all(res["grads_same"]) and all(res["params_same"]), res


@pytest.mark.parametrize("name", ["allreduce", "powersgd"])
def test_torch_hook_matches_torch_ddp_at_dp4(dp4: Any, name: str) -> None:
    for res in case_result(dp4, name):
        assert res["worst_rel"] <= 1e-5, res


@pytest.mark.parametrize("name", ["multi_overlap", "multi_sync"])
def test_one_torch_future_in_flight_and_is_last_once_per_step(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["n_groups"] > 2, res
        assert res["busy_at_call"] and max(res["busy_at_call"]) == 0, res
        assert len(res["last_flags"]) == 5, res
        for flags in res["last_flags"]:
            assert flags == [False] * (res["n_buckets"] - 1) + [True], res
        assert res["same_on_all_ranks"], res


def test_multi_bucket_powersgd_same_with_and_without_overlap(dp2: Any) -> None:
    on, off = case_result(dp2, "multi_overlap"), case_result(dp2, "multi_sync")
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a["grads"], b["grads"])


@pytest.mark.parametrize("name", ["is_last_ep1", "is_last_ep2"])
def test_is_last_is_the_last_bucket_of_each_step_dense_and_expert(dp2: Any, name: str) -> None:
    for res in case_result(dp2, name):
        assert res["same_as_no_hook"], res
        assert res["n_groups"] > 2, res
        kinds = ["all"] if name == "is_last_ep1" else ["dense", "expert"]
        for kind in kinds:
            flags = res[kind]
            per_step = len(flags) // 3
            assert per_step >= 1 and len(flags) == 3 * per_step, res
            assert flags == ([False] * (per_step - 1) + [True]) * 3, res


@pytest.mark.parametrize("name", ["wrapper_ar", "wrapper_rs", "wrapper_fp16_ar"])
def test_compress_wrapper_of_reduce_is_compress_wire_bitwise(dp2: Any, name: str) -> None:
    want_dtype = "torch.float16" if "fp16" in name else "torch.bfloat16"
    for res in case_result(dp2, name):
        assert res["same"] == [True, True], res
        assert res["differs_from_fp32"], res
        assert res["inner_dtypes"] == [want_dtype], res
        assert res["views_ok"] and res["shards"], res
        if name != "wrapper_fp16_ar":
            assert res["n_buckets"] > 2, res


def test_compress_wrapper_from_the_config(dp2: Any) -> None:
    for res in case_result(dp2, "wrapper_config"):
        assert res["same"], res
        assert res["names"] == ["CompressWrapper(Reduce, bfloat16)"], res


TIMEOUTS = {
    "first_return": ("NeverDone", "its first return"),
    "later_stage": ("NeverDoneLater", "stage 2"),
    "torch_future": ("from_torch(_never_done_torch)", "stage"),
}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("what", sorted(TIMEOUTS))
def test_a_hook_that_never_completes_times_out(dp1: Any, dp2: Any, world: int, what: str) -> None:
    hook, where = TIMEOUTS[what]
    for rank, res in enumerate(case_result(dp1 if world == 1 else dp2, "timeout")):
        got = res[what]
        assert got is not None and got[0] == "CommHookTimeoutError", got
        for text in (hook, "within 0.2 s", "dense bucket 0", f"rank {rank}", where,
                     "comm_hook_timeout_s"):  # fmt: skip
            assert text in got[1], (text, got)


ERRORS = {
    "rs_allreduce": ("CommHookModeError", "use megabuf.comm_hooks.Reduce() instead"),
    "rs_bf16": ("CommHookModeError", "Compress(torch.bfloat16) instead"),
    "wrong_group": ("CommHookGroupError", "reduces over its dp group, ranks [0, 1]"),
    "expert_on_world": ("CommHookGroupError", "expert-dp (expt_dp) group"),
    "two_groups": ("CommHookGroupError", "buckets of 2 process groups"),
    "scaling": ("CommHookScalingError", "allow_prescale=True"),
    "wrong_shape": ("CommHookResultError", "left a result of shape"),
    "wrap_same_dtype": ("CompressDtypeError", "to itself"),
    "wrap_fp16_on_bf16": ("CompressDtypeError", "loses range"),
    "wrap_torch": ("ValueError", "cannot wrap from_torch(allreduce_hook)"),
    "wrap_bad_dtype": ("CompressDtypeError", "must be torch.bfloat16 or torch.float16"),
}


@pytest.mark.parametrize("what", sorted(ERRORS))
def test_named_errors(dp2: Any, what: str) -> None:
    cls, text = ERRORS[what]
    for rank, res in enumerate(case_result(dp2, "errors")):
        got = res[what]
        assert got is not None, f"{what}: nothing raised on rank {rank}"
        assert got[0] == cls and text in got[1], got
        if what not in ("wrap_torch", "wrap_bad_dtype"):
            assert f"rank {rank}" in got[1], got


def test_build_makes_a_compress_wrapper_from_a_nested_table(dp2: Any) -> None:
    for res in case_result(dp2, "errors"):
        assert res["build_wrapper"] == "CompressWrapper", res


# ---- without processes ---------------------------------------------------------------------
def _bucket(numel: int = 8) -> GradBucket:
    return GradBucket(
        index=3, group_id=0, expert=False, mode="all_reduce", data=torch.arange(float(numel)),
        shard=None, params=(), param_names=(), group=None, group_size=2, group_rank=0, rank=0,
        average=False, collectives=Collectives(),
    )  # fmt: skip


def test_torch_grad_bucket_views_follow_set_buffer() -> None:
    bucket = _bucket()
    buffer = bucket.data
    view = TorchGradBucket(bucket, buffer, [], last=True)
    assert view.index() == 3 and view.is_last() and view.buffer() is buffer
    low = buffer.to(torch.float16)
    view.set_buffer(low)
    assert view.buffer() is low and view.parameters() == []


def test_bounded_wait_on_a_torch_future_and_a_c10d_style_work() -> None:
    never: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    with pytest.raises(CommHookTimeoutError, match=r"comm hook NeverDone did not complete"):
        HookWork(_Named("NeverDone", lambda b: never), _bucket(), timeout_s=0.05).wait()
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(torch.ones(8))
    bucket = _bucket()
    HookWork(_Named("Done", lambda b: done), bucket, timeout_s=0.05).wait()
    assert bucket.data.tolist() == [1.0] * 8
    # no bound (timeout None): an already complete Future is waited on as is
    HookWork(_Named("Done", lambda b: done), _bucket(), timeout_s=None).wait()


class _Named:
    def __init__(self, name: str, fn: Any) -> None:
        self.name, self.fn = name, fn

    def __call__(self, bucket: GradBucket) -> Any:
        return self.fn(bucket)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "10"])
def test_comm_hook_timeout_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match="comm_hook_timeout_s must be a positive number"):
        DistributedDataParallelConfig(comm_hook_timeout_s=bad)
    assert DistributedDataParallelConfig(comm_hook_timeout_s=None).comm_hook_timeout_s is None
    assert DistributedDataParallelConfig().comm_hook_timeout_s == 300.0
    assert DistributedDataParallelConfig(comm_hook_timeout_s=2).comm_hook_timeout_s == 2


def test_from_torch_picks_the_buffer_copy_for_batched_powersgd() -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    assert from_torch(powerSGD_hook.batched_powerSGD_hook).copy_buffer
    assert not from_torch(powerSGD_hook.powerSGD_hook).copy_buffer
    assert not from_torch(default_hooks.allreduce_hook).copy_buffer
    assert from_torch(default_hooks.allreduce_hook, copy_buffer=True).copy_buffer
    assert from_torch(default_hooks.allreduce_hook).prescaled is False


def test_a_hook_that_resizes_its_buffer_gets_a_copy(dp2: Any) -> None:
    for res in case_result(dp2, "batched"):
        assert res["n_buckets"] > 2, res
        assert res["same"] == [[True, True], [True, True]], res
