"""The memory planner on real gloo ranks (dp 2): for a set of models and budgets, the chosen
configuration's measured persistent bytes equal the prediction exactly on every rank and the
step stays within the budget; ranks whose measurements differ decide the same (planned from the
MAX); `memory_budget` plans at construction as `plan_for_budget` does; `check_peak` warns when
the prediction is off ([Note: memory planner], [Note: one plan on every rank], [Note: planner
proof after the first step])."""

from __future__ import annotations

from typing import Any

import pytest
from budget_cases import construction_case, disagree_case, exact_case, peak_warning_case
from dist_pool import case_result, run_each

MODELS = ["small", "gpt_tiny"]
TIMEOUT_S = 600.0  # each case plans ~50 candidates several times; 2 cores shared


@pytest.fixture(scope="module")
def results(pools: Any) -> dict[str, Any]:
    cases: dict[str, tuple[Any, ...]] = {m: (exact_case, m) for m in MODELS}
    cases["disagree"] = (disagree_case,)
    cases["construct_tight"] = (construction_case, 0.0)
    cases["construct_mid"] = (construction_case, 0.5)
    cases["peak_warning"] = (peak_warning_case,)
    pool = pools(2)
    pool.timeout_s = max(pool.timeout_s, TIMEOUT_S)
    out: dict[str, Any] = {}
    for name, case in cases.items():  # one run each: the pool's timeout is per run
        out[name] = pool.run(run_each, {name: case})
    return out


@pytest.mark.parametrize("model", MODELS)
def test_measured_persistent_bytes_equal_prediction_and_step_fits(results: Any, model: str) -> None:
    per_rank = case_result(results[model], model)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            where = (model, rank, row["budget"], row["candidate"])
            assert row["measured"] == row["predicted"], where
            assert row["fixed_measured"] == row["fixed_predicted"], where
            check = row["check"]
            assert check["measured_persistent_nbytes"] == check["predicted_persistent_nbytes"]
            # the engine's peak (ledger + walk) plus the measured activations fit the budget
            assert check["measured_nbytes"] + row["activations"] <= row["usable"], where
            assert check["measured_nbytes"] <= check["predicted_nbytes"], where
            assert check["within_margin"] and not row["warned"], where
    assert [r["candidate"] for r in per_rank[0]] == [r["candidate"] for r in per_rank[1]]


def test_the_budgets_chose_more_than_one_strategy(results: Any) -> None:
    """Across the models' budgets the planner chose different strategies, so the exact-bytes
    check covered more than one."""
    chosen: set[str] = set()
    for model in MODELS:
        for rows in case_result(results[model], model):
            chosen.update(row["strategy"] for row in rows)
    assert len(chosen) >= 2, chosen


def test_ranks_with_different_measurements_decide_the_same(results: Any) -> None:
    ranks = case_result(results["disagree"], "disagree")
    assert ranks[0]["local"] != ranks[1]["local"]  # alone, each rank would decide differently
    assert ranks[0]["agreed"] == ranks[1]["agreed"] is not None
    assert all(r["agreed_activations"] == max(x["mine"] for x in ranks) for r in ranks)
    assert ranks[0]["agreed"] == ranks[1]["local"]  # the most pessimistic rank's decision


@pytest.mark.parametrize("name", ["construct_tight", "construct_mid"])
def test_memory_budget_plans_at_construction(results: Any, name: str) -> None:
    ranks = case_result(results[name], name)
    for r in ranks:
        assert r["built"] == r["offline"], r
        assert r["persistent"] <= r["budget"]
    assert ranks[0]["built"] == ranks[1]["built"]
    if name == "construct_tight":
        assert ranks[0]["built"]["data_parallel_sharding_strategy"] != "no_shard"


def test_check_peak_warns_when_the_prediction_is_off(results: Any) -> None:
    for r in case_result(results["peak_warning"], "peak_warning"):
        assert not r["within"]
        assert len(r["warned"]) == 1 and "beyond the 10% margin" in r["warned"][0]
