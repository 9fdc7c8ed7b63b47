"""Sparse grads (issue 40): nn.Embedding / nn.EmbeddingBag(sparse=True) weights live outside the
buffers and are all-reduced and averaged as torch DDP does ([Note: sparse grads outside the
buffer] in megabuf/sync/sparse_grads.py). Reference: stock torch DDP in the same gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import sparse_cases as sc
from dist_pool import case_result, run_each

import megabuf
from megabuf.inspect import inspect_model
from megabuf.planning.model_plan import plan_model

SHARDED = ("optim", "optim_grads", "optim_grads_params")
VS_TORCH = {
    "plain-sgd": ("plain", "sgd", {}),
    "no_sync-sgd": ("no_sync", "sgd", {}),
    "zero_grad_buffer-adagrad": ("zero_grad_buffer", "adagrad", {}),
    "plain-sparse_adam-overlap": (
        "plain", "sparse_adam", {"overlap_grad_reduce": True, "bucket_size": 40}
    ),
    "no_sync-adagrad-overlap": ("no_sync", "adagrad", {"overlap_grad_reduce": True}),
}  # fmt: skip


@pytest.fixture(scope="module")
def results(pools: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("sparse_ckpt"))
    cases: dict[str, tuple[Any, ...]] = {
        name: (sc.sparse_vs_torch, *args) for name, args in VS_TORCH.items()
    }
    cases |= {f"refused-{s}": (sc.refused_when_sharded, s) for s in SHARDED}
    cases |= {
        "comm_hook": (sc.with_comm_hook,),
        "build_optimizer": (sc.refused_by_build_optimizer,),
        "only_sparse": (sc.only_sparse_params,),
        "scaled_and_cleared": (sc.scaled_and_cleared,),
        "checkpoint": (sc.checkpoint_round_trip, root),
        "dense_param_sparse_grad": (sc.sparse_grad_on_dense_param,),  # last: leaves a broken model
    }
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", list(VS_TORCH))
def test_sparse_grads_train_bitwise_like_torch_ddp(results: Any, name: str) -> None:
    """Asymmetric ranks (different rows; an empty batch on rank 1): after every backward each
    `.grad` (the embedding's a sparse tensor) and, after the steps, every param equal stock
    torch DDP's bit for bit; with no_sync accumulation, zero_grad_buffer, overlap_grad_reduce,
    SGD, Adagrad and SparseAdam."""
    for res in case_result(results, name):
        assert all(res["params_equal"]), (res["params_equal"], res["max_diff"])
        assert all(res["grads_equal"]), res["grads_equal"]
        assert all(res["sparse"]) and res["sparse"] == res["ref_sparse"], res


@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_strategies_refuse_sparse_modules_by_name(results: Any, strategy: str) -> None:
    for message in case_result(results, f"refused-{strategy}"):
        assert "module 'emb' (Embedding(sparse=True))" in message, message
        assert 'data_parallel_sharding_strategy="no_shard"' in message, message


def test_sparse_grads_are_reduced_beside_a_comm_hook(results: Any) -> None:
    """A registered hook reduces the dense buckets, and the sparse grads still reach the
    torch DDP result."""
    for res in case_result(results, "comm_hook"):
        assert all(res["params_equal"]), res


def test_build_optimizer_refuses_a_model_with_sparse_grads(results: Any) -> None:
    for message in case_result(results, "build_optimizer"):
        assert "'emb.weight'" in message and "'bag.weight'" in message, message
        assert "SparseAdam" in message, message


def test_a_model_of_only_sparse_params_syncs_at_backward_end(results: Any) -> None:
    for res in case_result(results, "only_sparse"):
        assert res["equal"] and res["sparse"], res


def test_scale_gradients_and_zero_grad_buffer_reach_sparse_grads(results: Any) -> None:
    for res in case_result(results, "scaled_and_cleared"):
        assert res["scaled"] and res["cleared"], res


def test_checkpoint_saves_and_loads_the_sparse_param_and_its_torch_optimizer_state(
    results: Any,
) -> None:
    for res in case_result(results, "checkpoint"):
        assert all(res["params_equal"]) and res["state_equal"], res


def test_sparse_grad_on_a_param_planned_dense_raises_naming_it(results: Any) -> None:
    for message in case_result(results, "dense_param_sparse_grad"):
        assert "param 'table'" in message and "dense grad buffer" in message, message


def test_plan_keeps_sparse_params_out_of_the_buffers() -> None:
    """Pure: the planner (shared with `megabuf inspect`) leaves the sparse-grad weights out and
    the sharded strategies refuse them naming the module; inspect works on such a model."""
    model = sc.SparseNet()
    cfg = megabuf.DistributedDataParallelConfig()
    planned = plan_model(model, cfg, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True)
    assert [n for n, _ in planned.sparse] == ["emb.weight", "bag.weight"]
    dense = ["lin.weight", "lin.bias", "head.weight", "head.bias"]
    assert [n for n, _ in planned.trainable] == dense
    assert sum(len(b.param_ids) for b in planned.plan.buffers) == 4
    dense_bag = plan_model(
        sc.SparseNet(sparse_bag=False), cfg, dp_size=2, expt_dp_size=2,
        expert_shares_dp_group=True,
    )  # fmt: skip
    assert [n for n, _ in dense_bag.sparse] == ["emb.weight"]
    for strategy in SHARDED:
        sharded = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        with pytest.raises(ValueError, match=r"module 'emb' \(Embedding\(sparse=True\)\)"):
            plan_model(model, sharded, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True)
    report = inspect_model(model, cfg, 2)
    assert report.buffers
