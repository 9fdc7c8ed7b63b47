"""The combination matrix, extended (issue 46): hybrid sharding with every option that moves the
1/dp, offload / restore with expert-parallel params, the weight version over a skipped step,
MuonAdamW's per-group settings. 4 gloo ranks, one pool run (cases in matrix2_cases.py); each
case against a single-process reference on the global batch or an independent walk."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from matrix2_cases import (
    hybrid_scaling_case,
    muon_groups_case,
    offload_expert_case,
    version_skip_case,
)

FP32_GRAD_BOUND = 1e-5  # relative; fp32 sums in another order, 3 steps apart from the reference
BF16_GRAD_BOUND = 1e-2  # bf16 grads of each rank's slice (the reference's too), summed in fp32
FP16_GRAD_BOUND = 2e-2  # fp16 grads of the scaled loss vs one fp16 backward on the global batch
# a level that sums where it should average: off by a factor 2 (relative error >= 1)
FP32_PARAM_BOUND = 1e-6  # as test_hybrid: 3 AdamW steps at lr 1e-2
SGD_BOUND = 1e-6  # as test_matrix: clipped SGD on the MoE model
MUON_BOUND = 1e-5  # muon_cases: bitwise at dp 2; at dp 4 the owner's sum order may round

AVG = {"average_in_collective": True}
FP32 = {"grad_reduce_in_fp32": True}
DET = {"deterministic_reduction": True}
HYBRID: dict[str, dict[str, Any]] = {
    "avg-optim": {"strategy": "optim", "micro": 2, "ddp": AVG},
    "avg-optim_grads": {"strategy": "optim_grads", "micro": 2, "ddp": AVG},
    "avg-optim_grads_params": {"strategy": "optim_grads_params", "micro": 2, "ddp": AVG},
    "avg-optim_grads-rem": {"strategy": "optim_grads", "micro": 2, "ddp": AVG,
                            "accumulation": "reduce_each_microbatch"},
    "avg-expert-optim_grads": {"strategy": "optim_grads", "micro": 2, "ddp": AVG, "expert": True},
    "fp32-optim_grads": {"strategy": "optim_grads", "bf16": True, "ddp": FP32},
    "fp32-avg-optim": {"strategy": "optim", "bf16": True, "ddp": {**FP32, **AVG}},
    "hook-optim_grads": {"strategy": "optim_grads", "micro": 2, "hook": True},
    "hook-avg-optim": {"strategy": "optim", "micro": 2, "hook": True, "ddp": AVG},
    "fp16-optim_grads": {"strategy": "optim_grads", "fp16": True},
    "fp16-avg-optim": {"strategy": "optim", "fp16": True, "ddp": AVG},
    "det-avg-optim_grads": {"strategy": "optim_grads", "micro": 2, "ddp": {**DET, **AVG}},
    "det-avg-optim_grads_params": {"strategy": "optim_grads_params", "ddp": {**DET, **AVG}},
}  # fmt: skip
OFFLOAD = ("no_shard", "optim", "optim_grads_params")
VERSIONS = ("no_shard", "optim_grads")
MUON = ("no_shard", "optim")


def _cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {
        f"hybrid-{name}": (hybrid_scaling_case, case) for name, case in HYBRID.items()
    }
    cases |= {f"offload-{s}": (offload_expert_case, s) for s in OFFLOAD}
    cases |= {f"versions-{s}": (version_skip_case, s) for s in VERSIONS}
    cases |= {f"muon-{s}": (muon_groups_case, s) for s in MUON}
    return cases


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, _cases())  # type: ignore[no-any-return]


def _grad_bound(case: dict[str, Any]) -> float:
    if case.get("fp16"):
        return FP16_GRAD_BOUND
    return BF16_GRAD_BOUND if case.get("bf16") else FP32_GRAD_BOUND


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_reduced_grads_are_the_global_mean_under_every_scaling_option(
    results: Any, name: str
) -> None:
    """R = 2 x S = 2: every rank's reduced shard is the global batch's grad (times the loss
    scale) after every step, the replicas agree, and fp32 params match the reference."""
    case = HYBRID[name]
    ranks = case_result(results, f"hybrid-{name}")
    for rank, res in enumerate(ranks):
        assert res["split"] == (2, 2), res["split"]
        assert all(res["applied"]), (rank, res["applied"])
        assert max(res["grad_errors"]) < _grad_bound(case), (rank, res["grad_errors"])
    assert len({r["digest"] for r in ranks}) == 1, "replicas differ"
    if not (case.get("bf16") or case.get("fp16")):
        assert max(r["error"] for r in ranks) < FP32_PARAM_BOUND, [r["error"] for r in ranks]


@pytest.mark.parametrize("strategy", OFFLOAD)
def test_offload_with_experts_leaves_nothing_live_and_restores_bitwise(
    results: Any, strategy: str
) -> None:
    """ep 2 (expert dp 2 != dp 4): after offload the storage walk finds no live byte in the
    dense or the expert buffers nor anywhere else the engine and optimizer hold; the ledger
    agrees; restore brings back the same bytes bitwise; training then matches the whole model."""
    for rank, res in enumerate(case_result(results, f"offload-{strategy}")):
        assert res["before"]["expert"] > 0 and res["before"]["dense"] > 0, (rank, res["before"])
        assert not any(res["offloaded"].values()), (rank, res["offloaded"])
        assert all(v == 0 for v in res["ledger"].values()), (rank, res["ledger"])
        assert res["released"] == res["before"]["total"], (rank, res)
        # the same storages come back (exposed .grad views of grad_data may be dropped: a new
        # iteration starts, [Note: what offload releases])
        back = {k: v for k, v in res["restored"].items() if k != "other"}
        assert back == {k: v for k, v in res["before"].items() if k != "other"}, (rank, res)
        assert res["bitwise"], rank
        assert all(res["applied"]), (rank, res["applied"])
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < SGD_BOUND, (rank, worst)


@pytest.mark.parametrize("strategy", VERSIONS)
def test_the_weight_version_counts_applied_updates_across_a_skipped_step(
    results: Any, strategy: str
) -> None:
    """ep 2, an inf in one expert's grad on rank 1 at step 1: skipped everywhere; the version
    weight_version() reports and export_weights stamps is 1, 1, 2; the skipped step's params are
    the previous step's."""
    for rank, res in enumerate(case_result(results, f"versions-{strategy}")):
        steps = res["steps"]
        assert [s["applied"] for s in steps] == [True, False, True], (rank, steps)
        assert [s["version"] for s in steps] == [1, 1, 2], (rank, steps)
        assert [s["exported"] for s in steps] == [[1], [1], [2]], (rank, steps)
        assert steps[1]["digest"] == steps[0]["digest"] != steps[2]["digest"], rank


@pytest.mark.parametrize("strategy", MUON)
def test_muon_adamw_per_group_settings_override_the_constructors(
    results: Any, strategy: str
) -> None:
    """Four groups (two Muon, two AdamW) with lr, weight decay, momentum, nesterov, betas, eps of
    their own: every param equals torch.optim.Muon + AdamW given the same groups."""
    for rank, res in enumerate(case_result(results, f"muon-{strategy}")):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < MUON_BOUND, (rank, worst)
