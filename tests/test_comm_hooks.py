"""Communication hooks on real gloo ranks at dp=2 ([Note: comm hook contract]): Reduce is the
engine's reduction bitwise in both modes, Compress(bf16) is bitwise its single-process emulation
and within the bf16 bound of the fp32 reduction, Noop warns, stage one of a hook is issued
during backward, and every named error. At dp=2 a sum of two values is order independent and a
1/2 pre-scale is exact, so "bitwise" is the right bar ([Note: low-precision wire, fp32 sum])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comm_hook_cases import (
    compress_case,
    config_case,
    errors_case,
    expert_case,
    noop_case,
    overlap_case,
    reduce_case,
)
from dist_pool import case_result, run_each

from megabuf import DistributedDataParallelConfig
from megabuf.comm_hooks import (
    CommHookResultError,
    Compress,
    CompressDtypeError,
    GradBucket,
    HookWork,
    Noop,
    Reduce,
    build,
)
from megabuf.transport.collectives import Collectives

AR: dict[str, Any] = {}
RS = {"use_distributed_optimizer": True}
MULTI = {"bucket_size": 64, "overlap_grad_reduce": True}

CASES: dict[str, tuple[Any, ...]] = {
    "reduce_ar": (reduce_case, AR),
    "reduce_rs": (reduce_case, RS),
    "reduce_ar_multi": (reduce_case, MULTI),
    "reduce_rs_multi": (reduce_case, {**RS, **MULTI}),
    "reduce_rs_avg": (reduce_case, {**RS, **MULTI, "average_in_collective": True}),
    "compress_wire_ar": (compress_case, MULTI, "wire"),
    "compress_wire_rs": (compress_case, {**RS, **MULTI}, "wire"),
    "compress_fp32_ar": (compress_case, MULTI, "fp32"),
    "compress_fp32_rs": (compress_case, {**RS, **MULTI}, "fp32"),
    "noop": (noop_case,),
    "overlap_ar": (overlap_case, {"bucket_size": 64}),
    "overlap_rs": (overlap_case, {"bucket_size": 64, **RS}),
    "errors": (errors_case,),
    "expert_ep1": (expert_case, 1, {}),
    "expert_ep1_rs": (expert_case, 1, RS),
    "expert_ep2": (expert_case, 2, {}),
    "expert_ep2_rs": (expert_case, 2, RS),
    "config_ar": (config_case, MULTI),
    "config_rs": (config_case, {**RS, **MULTI}),
}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "name", ["reduce_ar", "reduce_rs", "reduce_ar_multi", "reduce_rs_multi", "reduce_rs_avg"]
)
def test_reduce_hook_is_bitwise_the_engines_reduction(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["hooked"], res
        assert res["same"] == [True, True, True], f"{name} rank {rank}: {res}"
        if "multi" in name:
            assert res["n_buckets"] > 2, res


@pytest.mark.parametrize("name", ["compress_wire_ar", "compress_wire_rs", "compress_fp32_ar",
                                  "compress_fp32_rs"])  # fmt: skip
def test_compress_bf16_matches_its_emulation_and_the_bf16_bound(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["calls"] == res["n_buckets"] > 2, res
        assert res["bitwise"], f"{name} rank {rank}: differs from the emulated rounding"
        assert res["bound_ratio"] <= 1.0, f"{name} rank {rank}: {res}"
        assert res["differs_from_fp32"], res  # the rounding happened: not the fp32 path


def test_noop_warns_once_and_leaves_local_grads(results: Any) -> None:
    for res in case_result(results, "noop"):
        assert res["warnings"] == 1 and res["category"] == "RuntimeWarning", res
        assert res["local"], res
        assert not any(op in res["calls"] for op in ("all_reduce", "reduce_scatter")), res


@pytest.mark.parametrize("name", ["overlap_ar", "overlap_rs"])
def test_hook_stage_one_is_issued_during_backward(results: Any, name: str) -> None:
    for res in case_result(results, name):
        early, late = res["at_backward_end"], res["after_finish"]
        assert res["n_groups"] > 1, res
        # every group but the last can only be dispatched by backward's grad hooks
        assert early["dispatched"] >= 1 and early["hook_calls"] >= 1, res
        assert early["all_to_all"] == early["hook_calls"], res
        assert early["all_gather"] == 0, res  # stage two waits for finish_grad_sync
        assert late["hook_calls"] == late["all_to_all"] == res["n_buckets"], res
        want_gathers = res["n_buckets"] if name == "overlap_ar" else 0
        assert late.get("all_gather", 0) == want_gathers, res


ERRORS = {
    "twice": ("CommHookRegistrationError", "already registered for the dense buffers"),
    "after_backward": ("CommHookRegistrationError", "after a backward"),
    "mode": ("CommHookModeError", "supports ['all_reduce'], but this model"),
    "no_modes": ("CommHookModeError", "must declare `modes`"),
    "bad_buffers": ("ValueError", "buffers must be one of"),
    "no_expert_buffers": ("ValueError", "this model has no expert buffers"),
    "wrong_shape": ("CommHookResultError", "left a result of shape"),
    "yields_junk": ("CommHookResultError", "yielded a int"),
    "bf16_to_bf16": ("CompressDtypeError", "to itself"),
    "fp16_on_bf16": ("CompressDtypeError", "loses range"),
    "bad_dtype": ("CompressDtypeError", "must be torch.bfloat16 or torch.float16"),
}


@pytest.mark.parametrize("what", sorted(ERRORS))
def test_named_errors(results: Any, what: str) -> None:
    cls, text = ERRORS[what]
    for rank, res in enumerate(case_result(results, "errors")):
        got = res[what]
        assert got is not None, f"{what}: nothing raised on rank {rank}"
        assert got[0] == cls and text in got[1], got
        if what not in ("bad_buffers", "bad_dtype"):
            assert f"rank {rank}" in got[1], got


def test_compress_to_bf16_of_bf16_params_with_fp32_grads_is_allowed(results: Any) -> None:
    for res in case_result(results, "errors"):
        assert res["bf16_fp32_grads"] is None, res


def test_build_from_a_config_table() -> None:
    hook = build({"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"})
    assert isinstance(hook, Compress) and hook.dtype is torch.bfloat16
    assert hook.accumulate == "fp32"
    assert isinstance(build({"name": "Reduce"}), Reduce)
    assert isinstance(build({"name": "noop"}), Noop)
    with pytest.raises(ValueError, match="unknown comm_hook name 'nosuchhook'"):
        build({"name": "nosuchhook"})
    with pytest.raises(ValueError, match="bad options for comm_hook 'compress'"):
        build({"name": "compress", "rank": 2})
    with pytest.raises(CompressDtypeError):
        build({"name": "compress", "dtype": "float32"})


@pytest.mark.parametrize("name", ["expert_ep1", "expert_ep1_rs", "expert_ep2", "expert_ep2_rs"])
def test_expert_buffers_get_their_own_hook_and_group(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["reduce_same"], f"{name} rank {rank}: Reduce differs from no hook"
        assert res["dense_same"], f"{name} rank {rank}: an expert-only hook changed dense grads"
        assert not any(res["dense_hooked"]), res
        assert res["n_expert_buckets"] >= 1 and all(res["expert_views"]), res
        assert res["groups_ok"], res
        assert res["two_kinds"] == ["Compress", "Reduce"], res  # one hook per kind
        if not name.startswith(
            "expert_ep2"
        ):  # ep=2 at dp=2: expt_dp has one rank, nothing to round
            assert res["expert_changed"] and res["expert_close"], res


@pytest.mark.parametrize("name", ["config_ar", "config_rs"])
def test_comm_hook_from_the_config_is_the_registered_hook(results: Any, name: str) -> None:
    for res in case_result(results, name):
        assert res["hooks"] == ["Compress(bfloat16, fp32)"], res
        assert res["same"], res


def test_config_reads_a_comm_hook_table(tmp_path: Any) -> None:
    path = tmp_path / "hook.toml"
    path.write_text(
        '[ddp]\nuse_distributed_optimizer = true\n\n[comm_hook]\nname = "compress"\n'
        'dtype = "bfloat16"\naccumulate = "fp32"\n'
    )
    cfg = DistributedDataParallelConfig.from_toml(path)
    assert cfg.use_distributed_optimizer
    assert cfg.comm_hook == {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"}
    nested = tmp_path / "nested.toml"
    nested.write_text('[ddp]\n[ddp.comm_hook]\nname = "noop"\n')
    assert DistributedDataParallelConfig.from_toml(nested).comm_hook == {"name": "noop"}
    both = tmp_path / "both.toml"
    both.write_text('[ddp.comm_hook]\nname = "noop"\n[comm_hook]\nname = "reduce"\n')
    with pytest.raises(ValueError, match=r"both \[comm_hook\] and \[ddp.comm_hook\]"):
        DistributedDataParallelConfig.from_toml(both)
    with pytest.raises(ValueError, match="comm_hook must be a table with a string `name`"):
        DistributedDataParallelConfig(comm_hook={"dtype": "bfloat16"})


# ---- the contract's driver, without processes ([Note: comm hook contract]) ---------------------
def _bucket(shard: bool = False) -> GradBucket:
    data = torch.arange(8.0)
    return GradBucket(
        index=0, group_id=0, expert=False, mode="reduce_scatter" if shard else "all_reduce",
        data=data, shard=data[4:8] if shard else None, params=(), param_names=(), group=None,
        group_size=2, group_rank=1, rank=1, average=False, collectives=Collectives(),
    )  # fmt: skip


class _Done:
    """A waitable that records when it is waited on and returns `value`."""

    def __init__(self, log: list[str], name: str, value: Any = None) -> None:
        self.log, self.name, self.value = log, name, value

    def wait(self) -> Any:
        self.log.append(f"wait {self.name}")
        return self.value


def test_generator_stage_one_runs_at_dispatch_and_the_rest_at_wait() -> None:
    log: list[str] = []

    def hook(bucket: GradBucket) -> Any:
        log.append("stage 1")
        got = yield _Done(log, "a", value=torch.full((8,), 3.0))
        log.append(f"stage 2 got {got[0].item()}")
        yield _Done(log, "b")
        return got * 2

    bucket = _bucket()
    work = HookWork(hook, bucket)
    assert log == ["stage 1"]  # dispatch runs only up to the first yield
    work.wait()
    assert log == ["stage 1", "wait a", "stage 2 got 3.0", "wait b"]
    assert torch.equal(bucket.data, torch.full((8,), 6.0))  # the returned tensor is copied in
    work.wait()  # waiting again does nothing
    assert len(log) == 4


def test_a_torch_future_or_a_tensor_result_lands_in_the_target() -> None:
    bucket = _bucket(shard=True)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(torch.ones(4))
    HookWork(lambda b: future, bucket).wait()
    assert bucket.data.tolist() == [0, 1, 2, 3, 1, 1, 1, 1]  # only the shard is written
    HookWork(lambda b: torch.full((4,), 5.0), bucket).wait()
    assert bucket.shard is not None and bucket.shard.tolist() == [5, 5, 5, 5]
    with pytest.raises(CommHookResultError, match=r"shape \(8,\), expected \(4,\)"):
        HookWork(lambda b: torch.zeros(8), bucket).wait()
    with pytest.raises(CommHookResultError, match="returned a str"):
        HookWork(lambda b: "done", bucket)
