"""Pickling and copying a wrapped model (issue 40): `pickle`, `torch.save` + `torch.load(
weights_only=False)` and `copy.deepcopy` give a model that trains in the same job, its grads
reduced, bit for bit like stock torch DDP ([Note: pickling a wrapped model] in
megabuf/core/pickling.py)."""

from __future__ import annotations

from typing import Any

import pickling_cases as pc
import pytest
from dist_pool import case_result, run_each

HOW = ("pickle", "torch_save", "deepcopy")


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {h: (pc.round_trip_trains_like_torch, h) for h in HOW}
    cases |= {
        "sparse": (pc.sparse_model_round_trip,),
        "distributed_optimizer": (pc.distributed_optimizer_round_trip,),
        "rank_local": (pc.rank_local_unpickle,),
        "hook_dropped": (pc.registered_hook_dropped,),
        "refused-optim_grads_params": (pc.refused, "optim_grads_params"),
        "refused-groups": (pc.refused, "groups"),
    }
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", HOW)
def test_a_copied_model_trains_bitwise_like_torch_ddp(results: Any, how: str) -> None:
    """The copy (new buffers and hooks, values as pickled) and the original, each trained
    after the copy, equal torch DDP from the copied values on every rank; the payload holds
    the values once (no buffers besides the params)."""
    for res in case_result(results, how):
        assert all(res["equal"]), res
        assert all(res["original_equal"]), res
        assert not res["shares_storage"] and res["main_grad"], res
        assert res["payload_ratio"] < 1.5, res


def test_a_copied_model_with_sparse_grads_trains_like_torch_ddp(results: Any) -> None:
    for res in case_result(results, "sparse"):
        assert all(res["equal"]), res


def test_a_copy_under_the_distributed_optimizer_trains_like_the_original(results: Any) -> None:
    """optim + overlap_param_gather: the engine's forward pre-hooks are not copied (the copy
    installs its own, one per module reading a param), and megabuf's optimizer steps the copy
    exactly as the original."""
    for res in case_result(results, "distributed_optimizer"):
        assert all(res["equal"]), res
        assert res["pre_hooks"] <= 3, res


def test_rank_local_unpickle_and_deepcopy_run_no_collective(results: Any) -> None:
    """Only rank 0 unpickles and deep-copies, also with no process group built yet (a fresh
    job): nothing hangs, the copies evaluate like the original, and no group is made under a
    name the other ranks would not give it."""
    rank0, rank1 = case_result(results, "rank_local")
    assert rank0 == {
        "pickle": True,
        "deepcopy": True,
        "fresh_groups": True,
        "group_count_kept": True,
    }, rank0
    assert rank1 == {}, rank1


def test_registered_comm_hooks_are_not_copied(results: Any) -> None:
    for res in case_result(results, "hook_dropped"):
        assert res["original"] == ["dense"] and res["copy"] == [], res


def test_optim_grads_params_refuses_pickling_by_name(results: Any) -> None:
    for message in case_result(results, "refused-optim_grads_params"):
        assert "'optim_grads_params'" in message and "state_dict()" in message, message


def test_non_default_process_groups_refuse_pickling_by_name(results: Any) -> None:
    for message in case_result(results, "refused-groups"):
        assert "default process groups" in message and "ep_size 2" in message, message
