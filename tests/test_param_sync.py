"""Megatron's idioms for reading params outside a hooked forward after an overlapped step
(issue 23): `start_param_sync(force_sync=True)`, `disable_forward_pre_hook()` then evaluation or
a hand-rolled checkpoint then `enable_forward_pre_hook()`, and `param_sync=False` followed by a
forward. At dp 2 and 4, the last rank slowed before its step, every rank's read equals the
single-process reference ([Note: who waits for param gathers] in ddp.py)."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from param_sync_cases import IDIOMS, STEPS, idiom_case

ATOL = 1e-6  # fp32 AdamW vs the global-batch reference, as test_optimizer_distributed


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"dp{ws}")
def results(request: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    cases = {idiom: (idiom_case, idiom) for idiom in IDIOMS}
    return request.param, pools(request.param).run(run_each, cases)


@pytest.mark.parametrize("idiom", IDIOMS)
def test_reads_after_an_overlapped_step_equal_the_reference(results: Any, idiom: str) -> None:
    world_size, per_rank = results
    fast_ranks_in_flight = 0
    for rank, steps in enumerate(case_result(per_rank, idiom)):
        assert len(steps) == STEPS
        for step, res in enumerate(steps):
            where = f"dp={world_size} rank {rank} step {step} {idiom}"
            worst = max(res["errors"].items(), key=lambda kv: kv[1])
            assert worst[1] <= ATOL, f"{where}: read {worst[0]} off by {worst[1]:.3g}"
            if idiom != "disable_without_param_sync_eval":
                assert res["states_after"] == ["valid"], f"{where}: {res['states_after']}"
            fast_ranks_in_flight += res["in_flight"] and rank < world_size - 1
    # the slowed rank makes the others' gathers wait for it: the race window really opened
    assert fast_ranks_in_flight == (world_size - 1) * STEPS
