"""Checkpoints where features meet (issue 29), 4 gloo ranks in one sweep:
- a plain torch optimizer saves and resumes at pp=2, ep=2 (expert dp 2 != dp 4) and pp=2 x ep=2
  (expert dp 1 != dp 2): each stage's and ep rank's param groups are kept (they were rank 0's
  alone: loading failed on every other stage / ep rank); what a checkpoint lacks for a rank is
  refused naming the params, the stage / ep rank and the rank, or, with
  strict_optimizer=False, warned about;
- megabuf optimizers under optim_grads (± reduce_each_microbatch) and optim_grads_params at
  ep=2 and pp=2, and under every strategy at pp=2 x ep=2;
- round trips at states where every field is non-trivial: fp16 with a dynamic loss scaler
  mid-growth and PowerSGD's error feedback; LocalSGD's counters.
Every resumed run is compared bit for bit with the run that never stopped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_combo_cases import (
    FP16_STEPS,
    POISON,
    SCALER,
    faulty_loads,
    fp16_scaler_powersgd,
    local_sgd_between_averagings,
    local_sgd_round_trip,
    megabuf_round_trip,
    torch_optimizer_refusals,
    torch_round_trip,
)
from dist_pool import case_result, run_each

TORCH_SHAPES = ["pp2", "ep2", "pp2_ep2"]
# cells of the combination matrix not covered elsewhere (tests/test_checkpoint.py: no_shard and
# optim at pp2 and ep2; optim / optim_grads_params / no_shard at dp only)
MEGABUF_CELLS = (
    [("optim_grads_rem", "dp")]
    + [
        (strategy, shape)
        for shape in ("ep2", "pp2")
        for strategy in ("optim_grads", "optim_grads_rem", "optim_grads_params")
    ]
    + [
        (s, "pp2_ep2")
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_rem", "optim_grads_params")
    ]
)


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> Path:
    return Path(tmp_path_factory.mktemp("combo_ckpt"))


@pytest.fixture(scope="module")
def runs(pools: Any, root: Path) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {
        f"torch_{s}": (torch_round_trip, str(root), s) for s in TORCH_SHAPES
    }
    cases["faulty"] = (faulty_loads, str(root))  # edits torch_pp2_ep2's checkpoint
    cases |= {f"{st}_{sh}": (megabuf_round_trip, str(root), sh, st) for st, sh in MEGABUF_CELLS}
    cases["fp16"] = (fp16_scaler_powersgd, str(root))
    cases["local_sgd"] = (local_sgd_round_trip, str(root))
    cases["local_sgd_between"] = (local_sgd_between_averagings, str(root))
    cases["refusals"] = (torch_optimizer_refusals,)
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _same_state(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> bool:
    return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)


def _check_round_trip(res: dict[str, Any], where: Any) -> None:
    assert not _equal(res["at_save"], res["uninterrupted"]), where  # it trained on
    assert _equal(res["loaded"], res["at_save"]), where
    assert _equal(res["resumed"], res["uninterrupted"]), where


@pytest.mark.parametrize("shape", TORCH_SHAPES)
def test_torch_optimizer_resumes_bitwise_at_pp_and_ep(runs: Any, root: Path, shape: str) -> None:
    """torch.optim.AdamW over the megabuf-wrapped model: every rank gets back exactly its
    optimizer state (every param stepped) and the resumed run is bitwise the uninterrupted
    one; one common file per (stage, ep rank), listed in metadata.json."""
    for rank, res in enumerate(case_result(runs, f"torch_{shape}")):
        assert res["kind"] == "AdamW"
        state = res["state_at_save"]
        assert state and all(state.values()), (shape, rank)
        assert _same_state(res["loaded_state"], state), (shape, rank)
        _check_round_trip(res, (shape, rank))
    meta = json.loads((root / f"torch_{shape}" / "metadata.json").read_text())
    coords = {"pp2": ["pp0-ep0", "pp1-ep0"], "ep2": ["pp0-ep0", "pp0-ep1"]}
    want = coords.get(shape, ["pp0-ep0", "pp0-ep1", "pp1-ep0", "pp1-ep1"])
    assert sorted(meta["torch_commons"]) == want, meta["torch_commons"]
    assert meta["torch_commons"]["pp0-ep0"] == "common.pt"


# pp2 x ep2 at world 4: rank = pp * 2 + ep_rank (expert dp 1)
COORD = ["pp0-ep0", "pp0-ep1", "pp1-ep0", "pp1-ep1"]


def test_rank0_only_torch_state_is_refused_by_name(runs: Any) -> None:
    """A checkpoint holding rank 0's param groups alone (as saved before the fix): every rank
    raises; the ranks of other stages / ep ranks name their coordinate, their params, their
    rank and strict_optimizer=False."""
    for rank, res in enumerate(case_result(runs, "faulty")):
        message = res["rank0_only"]["strict"]["error"]
        missing = 1 if rank == 0 else rank  # rank 0 reports the first failing rank's message
        assert f"rank {missing}" in message, (rank, message)
        assert f"pipeline stage / ep rank {COORD[missing]}" in message, (rank, message)
        assert "moe.router.weight" in message and "strict_optimizer=False" in message, message


def test_rank0_only_torch_state_loads_relaxed_with_a_warning(runs: Any) -> None:
    """strict_optimizer=False: ranks 1-3 warn naming their coordinate; the per-param state is
    in the checkpoint (every stage's pieces were saved), so it is loaded and the run resumes
    bit for bit with the hyperparameters the optimizer was built with."""
    results = case_result(runs, "faulty")
    for rank, res in enumerate(results):
        relaxed = res["rank0_only"]["relaxed"]
        if rank == 0:
            assert relaxed["warnings"] == [], relaxed["warnings"]
        else:
            (warning,) = relaxed["warnings"]
            assert COORD[rank] in warning and "hyperparameters" in warning, warning
        want = case_result(runs, "torch_pp2_ep2")[rank]
        assert _same_state(relaxed["loaded_state"], want["state_at_save"]), rank
        assert _equal(relaxed["resumed"], want["uninterrupted"]), rank


def test_lost_expert_state_is_refused_by_name_or_started_fresh(runs: Any) -> None:
    """The index lost stage 1's ep rank 1 expert pieces: strictly, every rank raises with rank
    3's message naming those params; relaxed, rank 3 warns and those params' state starts
    fresh (the rest loads): stage 1 leaves the uninterrupted run, stage 0 does not."""
    for rank, res in enumerate(case_result(runs, "faulty")):
        lost = res["lost"]
        message = lost["strict"]["error"]
        assert "rank 3" in message and "stage1/ep1/moe.experts.0.fc1.weight" in message, message
        assert "strict_optimizer=False" in message, message
        relaxed = lost["relaxed"]
        want = case_result(runs, "torch_pp2_ep2")[rank]
        fresh = [k for k, v in relaxed["loaded_state"].items() if not v]
        if rank == 3:
            (warning,) = relaxed["warnings"]
            assert "stage1/ep1/moe.experts" in warning and "start" in warning, warning
            assert fresh and all(".experts." in k for k in fresh), fresh
        else:
            assert relaxed["warnings"] == [] and fresh == [], (rank, fresh)
        # stage 1's tokens meet rank 3's experts: both its ranks leave the run, stage 0 does not
        assert _equal(relaxed["resumed"], want["uninterrupted"]) is (rank < 2), rank


@pytest.mark.parametrize(("strategy", "shape"), MEGABUF_CELLS)
def test_megabuf_optimizer_resumes_bitwise(runs: Any, strategy: str, shape: str) -> None:
    """Adam through megabuf.build_optimizer, two micro-batches per step: the loaded params are
    those at save time, the resumed run is bitwise the uninterrupted one, on every rank."""
    for rank, res in enumerate(case_result(runs, f"{strategy}_{shape}")):
        kind = "FP32Optimizer" if strategy == "no_shard" else "DistributedOptimizer"
        assert res["kind"] == kind, (strategy, res["kind"])
        _check_round_trip(res, (strategy, shape, rank))


def test_fp16_scaler_mid_growth_and_powersgd_residuals_resume_bitwise(runs: Any) -> None:
    """fp16 params, distributed optimizer, PowerSGD, dynamic loss scale: saved after 4 steps
    (an inf on one rank at step 2) with the scale grown once, the growth tracker at 1 and the
    hysteresis tracker at 1 of 2, and non-zero PowerSGD residuals. A fresh engine gets every
    field back; the scale's further course (growth at step 4, the inf at step 5) and the
    params are bitwise those of the uninterrupted run."""
    for rank, res in enumerate(case_result(runs, "fp16")):
        assert res["oks"] == [s not in POISON for s in range(FP16_STEPS)], res["oks"]
        at_save = res["at_save"]["scaler"]
        assert at_save == {
            "scale": SCALER["initial_scale"] * 2,
            "growth_tracker": 1,
            "hysteresis_tracker": 1,
        }, at_save
        assert res["loaded"]["scaler"] == at_save, rank
        residuals = res["at_save"]["residuals"]
        assert residuals and any(float(r.abs().max()) > 0 for r in residuals.values()), rank
        assert _equal(res["loaded"]["residuals"], residuals), rank
        assert res["resumed_scaler_end"] == res["scaler_end"], rank
        assert _equal(res["resumed"], res["uninterrupted"]), rank


def test_local_sgd_counters_resume_bitwise(runs: Any) -> None:
    """LocalSGD saved right after an averaging (hook step 3, past start_step 1; averaged_at
    3): a fresh engine gets the counters back, averages at the same steps (5, 7) and ends
    bitwise equal to the uninterrupted run."""
    for rank, res in enumerate(case_result(runs, "local_sgd")):
        assert res["averaged"] == [False, False, True, False, True, False, True], res["averaged"]
        assert res["at_save"] == {"step": 3, "averaged_at": 3}, res["at_save"]
        assert res["loaded"] == res["at_save"], rank
        assert _equal(res["resumed"], res["uninterrupted"]), rank


def test_local_sgd_checkpoint_between_averagings_is_refused_on_every_rank(runs: Any) -> None:
    """One local step after the averaging the replicas differ: the save raises naming the step
    and the last averaging (a checkpoint would keep rank 0's params only); the checkpoint
    saved at the averaging stays and loads (hook step 3)."""
    for rank, res in enumerate(case_result(runs, "local_sgd_between")):
        assert "at step 4, between parameter averagings (the last at step 3)" in res["error"], (
            rank,
            res,
        )
        assert "PeriodicAverager.step()" in res["error"] and res["loaded_step"] == 3, (rank, res)


def test_torch_optimizer_over_sharded_strategies_is_refused_by_name(runs: Any) -> None:
    """The checkpoint cells of a plain torch optimizer under optim, optim_grads (±
    reduce_each_microbatch) and optim_grads_params, at dp only, ep=2, pp=2 and pp=2 x ep=2:
    its first step raises naming the param and build_optimizer, so no such state exists to
    save."""
    for res in case_result(runs, "refusals"):
        assert len(res) == 16, sorted(res)
        for cell, message in res.items():
            assert "AdamW steps" in message and "build_optimizer" in message, (cell, message)
