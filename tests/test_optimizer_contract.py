"""The optimizer's step contract ([Note: optimizer step]) at dp=2 against single-process torch:
`StepResult`, skipping steps whose global grad norm is not finite, refusing grads that are not
this iteration's reduced grads, and fp32 main params that follow edits of the model params.
One pool run computes every case (optimizer_contract_cases.py); each case is its own test."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
from dist_pool import case_result
from optimizer_contract_cases import EDITS, NONFINITE, PRECISION, ROUNDTRIP, UNSYNCED, all_cases
from optimizer_contract_cases import run_contract_cases as _run

from megabuf.optimizer import StepResult

FP32_ATOL = 1e-6
# bf16 edit cases: two bf16 ulps (2 * 2**-8 relative) at the largest param. The reference does
# one bf16 backward on the global batch, megabuf averages per-rank bf16 grads: each rounds once,
# so after a step they may differ by about an ulp. What these cases must catch is a missed reload:
# the edit halves every param (or loads other weights), a change of ~50 %, over 60x the bound.
BF16_ULPS = 2 * 2.0**-8
# fp32 main params vs the reference's fp32 masters after sub-ulp SGD steps: the grads differ in
# bf16 rounding only (~1% of an update); losing the fp32 part would cost a whole update or more.
PRECISION_RTOL = 0.05
OPTIMIZER_DIR = Path(__file__).resolve().parent.parent / "megabuf" / "optimizer"


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(_run, all_cases())


def _per_rank(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return case_result(results, name)


def _tolerance(case: dict[str, Any], res: dict[str, Any]) -> float:
    return BF16_ULPS * res["scale"] if case.get("bf16") else FP32_ATOL


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda kv: kv[1])


# ---- pure ---------------------------------------------------------------------------------------
def test_step_result_is_a_named_tuple_that_still_unpacks() -> None:
    result = StepResult(True, 1.5, 3)
    assert (result.update_successful, result.grad_norm, result.num_zeros_in_grad) == (True, 1.5, 3)
    ok, norm, zeros = result
    assert (ok, norm, zeros) == (True, 1.5, 3)
    assert result == (True, 1.5, 3)


@pytest.mark.parametrize("module", ["memory.py", "model_space.py"])
def test_state_and_memory_helpers_do_not_import_the_optimizer(module: str) -> None:
    """They take a record of what they read, so base -> memory / model_space is one-way (no
    import of megabuf.optimizer.base, not even under TYPE_CHECKING)."""
    tree = ast.parse((OPTIMIZER_DIR / module).read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert "megabuf.optimizer.base" not in imported, imported


# ---- non-finite grads without a grad scaler -----------------------------------------------------
@pytest.mark.parametrize("name", list(NONFINITE))
def test_nonfinite_grad_norm_skips_the_step_on_every_rank(results: Any, name: str) -> None:
    """NaN in one rank's input, no grad scaler: every rank returns StepResult(False, nan, None);
    params and optimizer state are bitwise unchanged and fp32 grad copies are released; the next
    clean step is bitwise what a run without the poisoned step gives, and equals torch."""
    case = NONFINITE[name]
    for rank, res in enumerate(_per_rank(results, f"nonfinite/{name}")):
        assert res["fields"] == ("update_successful", "grad_norm", "num_zeros_in_grad"), rank
        ok, norm, zeros = res["result"]
        assert ok is False and norm is not None and math.isnan(norm) and zeros is None, (rank, res)
        assert res["params_unchanged"], f"rank {rank}: a skipped step changed the params"
        assert res["state_unchanged"], f"rank {rank}: a skipped step changed optimizer state"
        assert res["grad_copies_released"], f"rank {rank}: fp32 grad copies kept"
        assert res["ok_after"], rank
        assert res["bitwise_as_if_skipped"] and res["state_as_if_skipped"], rank
        worst = _worst(res["errors"])
        assert worst[1] <= _tolerance(case, res), (rank, worst)
    if name == "distopt_bf16_grads":
        assert _per_rank(results, f"nonfinite/{name}")[0]["grad_copies"] > 0


# ---- stale grads --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(UNSYNCED))
def test_step_refuses_grads_not_synced_this_iteration(results: Any, name: str) -> None:
    """step() after zero_grad()/zero_grad_buffer() without backward (the lazily zeroed buffer still
    holds the last step's grads), or after backward without finish_grad_sync(), raises naming the
    chunk, the rank and the fix, and changes nothing; the completed iteration equals torch."""
    for rank, res in enumerate(_per_rank(results, f"unsynced/{name}")):
        message = res["message"]
        assert "model chunk 0" in message and f"rank {res['rank']}" in message, message
        assert "finish_grad_sync()" in message and "finalize_model_grads" in message, message
        assert res["params_unchanged"], f"rank {rank}: refused step changed params"
        assert res["ok_after"], rank
        worst = _worst(res["errors"])
        assert worst[1] <= FP32_ATOL, (rank, worst)


# ---- main params follow the model params --------------------------------------------------------
@pytest.mark.parametrize("name", list(EDITS))
def test_main_params_follow_edits_of_model_params(results: Any, name: str) -> None:
    """bf16 params edited after the optimizer exists: model.load_state_dict(other weights) and an
    in-place edit under no_grad are picked up by the next step() (param._version moved); a .data
    edit with an explicit reload_model_params(). Two more steps equal torch from the edited
    weights (without reloading, the fp32 main params would overwrite the edit)."""
    for rank, res in enumerate(_per_rank(results, f"edit/{name}")):
        worst = _worst(res["errors"])
        assert worst[1] <= _tolerance(EDITS[name], res), (rank, worst)


@pytest.mark.parametrize("name", list(PRECISION))
def test_bf16_main_params_keep_fp32_precision_across_steps(results: Any, name: str) -> None:
    """SGD steps too small to change a bf16 param add up in the fp32 main params: the optimizer's
    own write-back into the bf16 params must not count as an edit that reloads (rounds) them."""
    for rank, res in enumerate(_per_rank(results, f"precision/{name}")):
        worst = _worst(res["errors"])
        assert worst[1] <= PRECISION_RTOL * res["largest_move"], (rank, worst, res["largest_move"])


@pytest.mark.parametrize("name", list(ROUNDTRIP))
def test_optimizer_state_round_trip_resumes_bitwise(results: Any, name: str) -> None:
    """Model then optimizer load_state_dict (the load_checkpoint order) resumes bitwise: the loaded
    fp32 main params are not re-read from the bf16 params, and FP32Optimizer (whose main params
    are the model params) can load at all."""
    for rank, res in enumerate(_per_rank(results, f"roundtrip/{name}")):
        assert res["bitwise"], f"rank {rank}: resumed run differs"
