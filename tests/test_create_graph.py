"""Second-order autograd with megabuf (tests/create_graph_cases.py) on 2 gloo ranks: a gradient
penalty (torch.autograd.grad of the inputs with create_graph=True inside the loss) trains like
the single-process reference under "no_shard", "optim" and "optim_grads", and raises by name
under "optim_grads_params" (its graph reads released unit params);
backward(create_graph=True), whose grads megabuf could not keep differentiable, raises by name;
after either error the model trains on after reset_iter_state()."""

from __future__ import annotations

from typing import Any

import pytest
from create_graph_cases import (
    create_graph_refused_case,
    gradient_penalty_case,
    no_param_backward_case,
    zero3_penalty_refused_case,
)
from dist_pool import case_result, run_each

STRATEGIES = ("no_shard", "optim", "optim_grads")


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {s: (gradient_penalty_case, s) for s in STRATEGIES}
    cases["refused"] = (create_graph_refused_case,)
    cases["zero3_refused"] = (zero3_penalty_refused_case,)
    cases["no_param"] = (no_param_backward_case,)
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_gradient_penalty_trains_like_the_reference(results: Any, strategy: str) -> None:
    for rank, res in enumerate(case_result(results, strategy)):
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["error"] <= 1e-6, (rank, strategy, res)


def test_backward_with_create_graph_is_refused_by_name_and_training_goes_on(results: Any) -> None:
    for rank, res in enumerate(case_result(results, "refused")):
        assert "create_graph=True" in res["error"] and f"(rank {rank})" in res["error"], res
        assert "torch.autograd.grad" in res["error"], res
        assert any(
            f"{i}.{k} got a grad" in res["error"] for i in (0, 2) for k in ("weight", "bias")
        )
        assert res["after"] <= 1e-6, (rank, res)


def test_a_gradient_penalty_under_zero3_is_refused_by_name_and_training_goes_on(
    results: Any,
) -> None:
    for rank, res in enumerate(case_result(results, "zero3_refused")):
        assert "create_graph=True" in res["error"] and "optim_grads_params" in res["error"], res
        assert '"optim_grads"' in res["error"] and "reset_iter_state" in res["error"], res
        assert res["after"] <= 1e-6, (rank, res)


def test_a_backward_reaching_no_param_leaves_the_sync_to_finish_grad_sync(results: Any) -> None:
    per_rank = case_result(results, "no_param")
    assert [r["synced_at_backward_end"] for r in per_rank] == [False, True], per_rank
    for rank, res in enumerate(per_rank):
        assert res["error"] <= 1e-6, (rank, res)
