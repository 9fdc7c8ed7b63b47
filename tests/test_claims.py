"""README claims that had no test of their own (see docs/CLAIMS.md), on 2 gloo ranks, each
against a single-process reference or across ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from claims_cases import LOSS_SCALE, OTHER_OPTIMIZERS, all_cases
from dist_pool import case_result, run_each

import megabuf

FP32_ATOL = 1e-5  # dp sums in another order than the global batch's, a few steps


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, all_cases())


def test_state_dict_has_module_keys_and_publishes_params(results: Any) -> None:
    """`model.state_dict()` keys are the wrapped module's; with overlap_param_gather step()
    leaves every gather in flight and state_dict() waits for them (all groups VALID after it)
    and returns the gathered params; a fresh model loads it back under the same keys."""
    for rank, res in enumerate(case_result(results, "state_dict")):
        assert res["keys"] == res["plain_keys"], rank
        got, published = res["got"], res["published"]
        assert res["states"] == (["DISPATCHED"], ["VALID"]), res["states"]
        for key in got:
            assert torch.equal(got[key], published[key]), (rank, key)
            assert torch.equal(res["loaded"][key], got[key]), (rank, key)


def test_construction_broadcasts_rank0_params_and_buffers(results: Any) -> None:
    per_rank = case_result(results, "broadcast")
    before0 = per_rank[0]["before"]
    for key in ("0.weight", "1.running_mean", "1.running_var"):
        assert not torch.equal(per_rank[1]["before"][key], before0[key]), key  # differed
    for rank, res in enumerate(per_rank):
        assert set(res["after"]) == set(before0)
        for key, value in res["after"].items():
            assert torch.equal(value, before0[key]), (rank, key)


@pytest.mark.parametrize("name", ["loss_scale_fp32", "loss_scale_distopt"])
def test_constant_loss_scale_scales_the_loss_and_unscales_the_grads(
    results: Any, name: str
) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["scale"] == LOSS_SCALE, (rank, res["kind"])
        if name == "loss_scale_fp32":  # reduced grad / scale == the global batch's grad
            assert res["kind"] == "FP32Optimizer"
            assert max(res["grad_ratio"].values()) <= 1e-6, res["grad_ratio"]
        else:
            assert res["kind"] == "DistributedOptimizer"
        for got, want in res["norms"]:  # the unscaled norm
            assert got == pytest.approx(want, rel=1e-5), (rank, res["norms"])
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP32_ATOL, (rank, name, worst)


@pytest.mark.parametrize("name", OTHER_OPTIMIZERS)
def test_other_pointwise_torch_optimizer_through_distributed_optimizer(
    results: Any, name: str
) -> None:
    for rank, res in enumerate(case_result(results, f"optimizer_{name}")):
        assert res["kind"] == "DistributedOptimizer"
        assert res["inner"] == [OTHER_OPTIMIZERS[name][0].__name__]
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP32_ATOL * max(1.0, res["scale"]), (rank, name, worst)


def test_finalize_checks_the_gradient_scaling_invariant(results: Any) -> None:
    for rank, msg in enumerate(case_result(results, "scaling_invariant")):
        assert "scales grads by [0.5, 1.0]" in msg and f"rank {rank}" in msg, msg
        assert "[Note: gradient scaling]" in msg, msg


def test_fp32_optimizer_steps_the_model_params_themselves(results: Any) -> None:
    for res in case_result(results, "fp32_in_place"):
        assert res["kind"] == "FP32Optimizer", res
        assert res["copies"] == 0 and res["same_memory"], res
        assert res["main_param_nbytes"] == 0, res


def test_build_optimizer_picks_the_class_from_config_and_dtypes(results: Any) -> None:
    for picks in case_result(results, "builder_choice"):
        assert picks == {
            "fp32": "FP32Optimizer",
            "bf16": "MixedPrecisionOptimizer",
            "bf16_distopt": "DistributedOptimizer",
        }, picks


def test_init_distributed_without_torchrun_env_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not dist.is_initialized()  # the test process itself never joins a group
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"torchrun's environment; missing \['RANK'"):
        megabuf.init_distributed()


def test_model_chunks_need_pipeline_parallelism() -> None:
    with pytest.raises(ValueError, match="chunks > 1 need pipeline parallelism"):
        megabuf.get_forward_backward_func(1, 2)
    assert megabuf.get_forward_backward_func(2, 2).__name__.endswith("with_interleaving")
    assert megabuf.get_forward_backward_func(2, 1).__name__.endswith("without_interleaving")
    assert megabuf.get_forward_backward_func(1, 1).__name__.endswith("no_pipelining")
