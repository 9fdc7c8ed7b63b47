"""The weight lifecycle (megabuf/weights/): offload / restore ([Note: what offload releases],
[Note: release in place], [Note: offloaded engine]), on real gloo ranks (weights_cases.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from weights_cases import STRATEGIES, continue_case, refusal_case

CONTINUE = {
    f"{s}-{dtype}-{'keep' if keep else 'drop'}": (continue_case, s, dtype, keep, s != "no_shard")
    for s in STRATEGIES
    for dtype, keep in (("float32", True), ("bfloat16", False))
}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, {**CONTINUE, "refusal": (refusal_case,)})


@pytest.mark.parametrize("name", list(CONTINUE))
def test_offload_restore_continue_training_is_bitwise(results: Any, name: str) -> None:
    """Offloaded after every step (with keep_grads also between micro-batches and between a
    forward and its backward), restored, trained on: bitwise the never-offloaded twin."""
    for out in case_result(results, name):
        if name.startswith(("optim-", "optim_grads-")):  # offload waited for these
            assert "DISPATCHED" in out["in_flight"]
        assert out["got"].keys() == out["ref"].keys()
        for key, ref in out["ref"].items():
            assert torch.equal(out["got"][key], ref), key


@pytest.mark.parametrize("name", list(CONTINUE))
def test_released_bytes_equal_the_formula(results: Any, name: str) -> None:
    for out in case_result(results, name):
        for released, expected, (before, after) in zip(
            out["released"], out["formula"], out["walk"]
        ):
            assert released == expected
            assert after == 0 and before == sum(released.values())


@pytest.mark.parametrize("name", list(CONTINUE))
def test_every_entry_point_raises_while_offloaded(results: Any, name: str) -> None:
    for out in case_result(results, name):
        assert set(out["entry"]) >= {"forward", "optimizer step()", "state_dict()"}
        for entry, message in out["entry"].items():
            assert "restore(model) first" in message, (entry, message)
        if "keep" in name:
            assert "backward on rank" in out["backward"]
        ledger = out["ledger_offloaded"]
        assert all(ledger.get(c, 0) == 0 for c in ("param_shard", "grad_shard"))


def test_offload_refuses_a_grad_reduction_in_flight_and_dropped_grads_need_a_backward(
    results: Any,
) -> None:
    for out in case_result(results, "refusal"):
        assert "has a grad reduction in flight" in out["refused"]
        assert "finish_grad_sync()" in out["refused"]
        assert "not SYNCED" in out["step_after_dropped_grads"]  # dropped grads: a new backward
        assert "backward (a param's grad hook) on rank" in out["grad_hook"]
