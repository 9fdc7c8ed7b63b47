"""Checkpoints are in model space: saved at dp=4 (synchronously, and asynchronously for the bf16
variant), they resume at dp=2 and dp=1 with other bucket sizes, and 5 more steps give the same
params as the uninterrupted run; the ZeRO-3 variant (optim_grads_params at dp=4) resumes under
ZeRO-1 at dp=2 and under no_shard at dp=1. Pipeline (pp=2) and expert-parallel (ep=2) models, on the
distributed optimizer and the all-reduce path, save and resume at the same sizes; their
full_state_dict gathers every stage and ep rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import (
    MISMATCHES,
    PARALLEL,
    VARIANTS,
    leftovers,
    mismatch_error,
    parallel_export,
    parallel_mismatch_error,
    parallel_save_then_resume,
    resume,
    save_then_continue,
)
from dist_pool import case_result, run_each

import megabuf
import megabuf.checkpoint

FP32_ATOL = 1e-6
BF16_ULPS = 2 * 2.0**-8  # two bf16 ulps at the largest param magnitude (see optimizer tests)


@pytest.fixture(scope="module")
def saved(pools: Any, tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    cases: dict[str, tuple[Any, ...]] = {
        name: (save_then_continue, str(root), name) for name in VARIANTS
    }
    cases |= {name: (parallel_save_then_resume, str(root), name) for name in PARALLEL}
    cases |= {f"export_{n}": (parallel_export, n) for n in ("pp2", "ep2")}
    cases["leftovers"] = (leftovers, str(root))  # after every save
    return root, pools(4).run(run_each, cases)


@pytest.fixture(scope="module", params=[(2, 37), (1, None)], ids=["dp2-bucket37", "dp1-one_bucket"])
def resumed(request: Any, saved: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    """Saved at dp=4 (bucket sizes 100 / 60), loaded at dp=2 (bucket size 37) and dp=1 (one
    bucket), 5 more steps; and loads into models that do not fit the checkpoint."""
    root, _ = saved
    world_size, bucket_size = request.param
    cases: dict[str, tuple[Any, ...]] = {
        name: (resume, str(root), name, bucket_size) for name in VARIANTS
    }
    cases |= {label: (mismatch_error, str(root), label) for label in MISMATCHES}
    cases |= {f"{n}_at_1": (parallel_mismatch_error, str(root), n) for n in ("pp2", "ep2")}
    return world_size, pools(world_size).run(run_each, cases)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    errors = {n: (got[n] - want[n]).abs().max().item() for n in want}
    return max(errors.items(), key=lambda kv: kv[1])


def _tolerance(name: str, params: dict[str, torch.Tensor]) -> float:
    if not VARIANTS[name].get("bf16"):
        return FP32_ATOL
    return BF16_ULPS * max(p.abs().max().item() for p in params.values())


@pytest.mark.parametrize("name", VARIANTS)
def test_resume_at_same_dp_is_bitwise(saved: Any, name: str) -> None:
    """Everything the step depends on is in the checkpoint: resuming at dp=4 with the same
    layout reproduces the uninterrupted run bit for bit."""
    _, per_rank = saved
    for rank, res in enumerate(case_result(per_rank, name)):
        want, got = res["uninterrupted"], res["same_dp"]
        assert all(torch.equal(got[n], want[n]) for n in want), (rank, name)


def test_save_leaves_one_file_per_rank_and_no_temporary_files(saved: Any) -> None:
    root, per_rank = saved
    case_result(per_rank, "fp32_adam")
    assert case_result(per_rank, "leftovers")[0] == []
    assert sorted(p.name for p in (root / "fp32_adam").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
        "common.pt", "metadata.json",
    ]  # fmt: skip


@pytest.mark.parametrize("name", VARIANTS)
def test_resume_at_other_dp_and_bucket_size(saved: Any, resumed: Any, name: str) -> None:
    """Params after loading at another dp size and bucket size and 5 more steps equal the
    uninterrupted dp=4 run."""
    want = case_result(saved[1], name)[0]["uninterrupted"]
    world_size, per_rank = resumed
    for rank, got in enumerate(case_result(per_rank, name)):
        worst = _worst(got, want)
        assert worst[1] <= _tolerance(name, want), (world_size, rank, name, worst)


MISMATCH_MESSAGES = {
    "other_model": ["missing entries", "a.weight"],
    "other_dtype": ["torch.bfloat16", "embed.weight"],
    "other_optimizer": [  # Adam saved, SGD loading: the hyperparameters differ
        "saved by torch.optim.adam.Adam",
        "['dampening', 'momentum', 'nesterov'] in this optimizer only",
    ],
    "not_a_checkpoint": ["no metadata.json"],
}


@pytest.mark.parametrize("label", MISMATCHES)
def test_loading_into_a_mismatch_says_what_does_not_match(resumed: Any, label: str) -> None:
    _, per_rank = resumed
    message = case_result(per_rank, label)[0]
    for part in MISMATCH_MESSAGES[label]:
        assert part in message, (label, message)


def test_consolidated_state_is_param_shaped_in_model_space(saved: Any) -> None:
    """Offline, from the dp=4 files: every param's main param and Adam moments, reassembled into
    param-shaped tensors; the fp32 main params equal the params at save time, and the moments
    equal torch Adam's after the same steps on the global batch in one process."""
    root, per_rank = saved
    result = case_result(per_rank, "fp32_adam")[0]
    at_save, reference = result["at_save"], result["reference_state"]
    state = megabuf.checkpoint.consolidated_optimizer_state(root / "fp32_adam")
    assert set(state) == set(at_save)
    for key, entry in state.items():
        assert torch.equal(entry["main"], at_save[key]), key
        for moment in ("exp_avg", "exp_avg_sq"):
            want = reference[key][moment]
            assert entry[moment].shape == at_save[key].shape, (key, moment)
            err = (entry[moment] - want).abs().max().item()
            assert err <= 1e-5 * want.abs().max().item() + 1e-12, (key, moment, err)


@pytest.mark.parametrize("name", PARALLEL)
def test_pipeline_and_expert_parallel_checkpoints_resume_bitwise(saved: Any, name: str) -> None:
    """pp=2 x dp=2 (1F1B, tied embeddings on both stages) and ep=2 x expt_dp=2 (MoE), each
    with the distributed optimizer and on the all-reduce path (FP32Optimizer), Adam: loading
    into a fresh model restores the params at save time, and the remaining steps reproduce the
    uninterrupted run bit for bit on every rank."""
    _, per_rank = saved
    kind = "FP32Optimizer" if name.endswith("_allreduce") else "DistributedOptimizer"
    for rank, res in enumerate(case_result(per_rank, name)):
        assert res["kind"] == kind, (name, res["kind"])
        at_save = res["at_save"]
        assert any(not torch.equal(res["fresh"][k], at_save[k]) for k in at_save), rank
        for key in at_save:
            assert torch.equal(res["loaded"][key], at_save[key]), (name, rank, key)
            assert torch.equal(res["resumed"][key], res["uninterrupted"][key]), (name, rank, key)


PREFIX_OF = {
    "pp2": lambda rank, key: f"stage{rank // 2}/",
    "ep2": lambda rank, key: f"ep{rank % 2}/" if ".experts." in key else "",
}


@pytest.mark.parametrize("name", ["pp2", "ep2"])
def test_full_state_dict_gathers_every_stage_and_ep_rank(saved: Any, name: str) -> None:
    """megabuf.full_state_dict at pp=2 / ep=2: rank 0 holds every rank's params under their
    checkpoint keys (stage / ep-rank prefixed), equal to the published params; others None."""
    _, per_rank = saved
    results = case_result(per_rank, f"export_{name}")
    state = results[0]["state"]
    assert all(res["state"] is None for res in results[1:])
    for rank, res in enumerate(results):
        for key, value in res["params"].items():
            local = key.split("/", 1)[1]
            full = PREFIX_OF[name](rank, local) + local
            assert torch.equal(state[full], value), (name, rank, full)


def test_pipeline_and_expert_checkpoint_keys_carry_stage_and_ep_rank(saved: Any) -> None:
    """Rank order (pp, expt_dp, ep): ranks 0-1 hold stage 0 and 2-3 stage 1; even ranks ep rank
    0, odd ranks ep rank 1. Each rank's params at save time are the consolidated main params
    under its stage / ep-rank key."""
    root, per_rank = saved
    for name, prefix_of in (
        ("pp2", lambda rank, key: f"stage{rank // 2}/"),
        ("ep2", lambda rank, key: f"ep{rank % 2}/" if ".experts." in key else ""),
    ):
        state = megabuf.checkpoint.consolidated_optimizer_state(root / name)
        seen = set()
        for rank, res in enumerate(case_result(per_rank, name)):
            for key, value in res["at_save"].items():
                local = key.split("/", 1)[1]  # "<chunk index>/<param name>"
                full = prefix_of(rank, local) + local
                assert torch.equal(state[full]["main"], value), (name, rank, full)
                seen.add(full)
        assert seen == set(state), (name, sorted(set(state) - seen))


@pytest.mark.parametrize(
    ("name", "sizes"),
    [("pp2", "pipeline-parallel size 2 and expert-parallel size 1"),
     ("ep2", "pipeline-parallel size 1 and expert-parallel size 2")],
)  # fmt: skip
def test_pipeline_and_expert_sizes_must_match_at_load(resumed: Any, name: str, sizes: str) -> None:
    """Saved at pp=2 / ep=2, loaded at pp=1 / ep=1: a ValueError naming both sizes."""
    _, per_rank = resumed
    for msg in case_result(per_rank, f"{name}_at_1"):
        assert f"saved at {sizes}" in msg and "runs at pp_size 1 and ep_size 1" in msg, msg
        assert "same pipeline / expert-parallel sizes" in msg, msg
