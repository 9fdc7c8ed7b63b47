"""torch LR schedulers drive megabuf optimizers (both domains) exactly as they drive torch's;
torch.amp.GradScaler is refused by name rather than stepping on scaled grads."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from scheduler_cases import amp_grad_scaler, scheduled_lrs

KINDS = ["lambda", "cosine", "one_cycle", "sequential"]
CASES = {
    f"{k}-{d}": (scheduled_lrs, k, d == "distopt") for k in KINDS for d in ("mixed", "distopt")
}
AMP = {"amp_fp32": (amp_grad_scaler, False), "amp_bf16": (amp_grad_scaler, True)}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(1).run(run_each, {**CASES, **AMP})


@pytest.mark.parametrize("name", list(CASES))
def test_torch_scheduler_drives_dense_and_expert_groups_like_torch(
    results: list[dict[str, Any]], name: str
) -> None:
    res = case_result(results, name)[0]
    assert res["groups"] == 2  # one dense, one expert inner group: one scheduler drives both
    assert res["lrs"] == res["ref_lrs"], (res["lrs"], res["ref_lrs"])
    assert len({tuple(step) for step in res["lrs"]}) > 1  # the schedule actually moved the lr


@pytest.mark.parametrize("name", list(CASES))
def test_scheduler_state_dict_round_trip(results: list[dict[str, Any]], name: str) -> None:
    res = case_result(results, name)[0]
    assert res["resumed_last_lr"] == res["last_lr"], res


@pytest.mark.parametrize("name", list(AMP))
def test_torch_amp_grad_scaler_is_refused_by_name(results: list[dict[str, Any]], name: str) -> None:
    res = case_result(results, name)[0]
    assert "OptimizerConfig(fp16=True)" in res["message"], res
    assert res["unchanged"], res
