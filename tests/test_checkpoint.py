"""Checkpoints are in model space: saved at dp=4, they resume at dp=2 and dp=1 with other bucket
sizes, and 5 more steps give the same params as the uninterrupted run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_cases import VARIANTS, resume, save_then_continue

import megabuf

FP32_ATOL = 1e-6
BF16_ULPS = 2 * 2.0**-8  # two bf16 ulps at the largest param magnitude (see optimizer tests)


@pytest.fixture(scope="module")
def saved(pools: Any, tmp_path_factory: Any) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, pools(4).run(save_then_continue, str(root))


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[str, float]:
    errors = {n: (got[n] - want[n]).abs().max().item() for n in want}
    return max(errors.items(), key=lambda kv: kv[1])


def _tolerance(name: str, params: dict[str, torch.Tensor]) -> float:
    if not VARIANTS[name].get("bf16"):
        return FP32_ATOL
    return BF16_ULPS * max(p.abs().max().item() for p in params.values())


def test_resume_at_same_dp_is_bitwise(saved: Any) -> None:
    """Everything the step depends on is in the checkpoint: resuming at dp=4 with the same
    layout reproduces the uninterrupted run bit for bit; the save left no temporary files."""
    root, per_rank = saved
    for rank, res in enumerate(per_rank):
        for name in VARIANTS:
            want, got = res[name]["uninterrupted"], res[name]["same_dp"]
            assert all(torch.equal(got[n], want[n]) for n in want), (rank, name)
    assert per_rank[0]["leftovers"] == []
    assert sorted(p.name for p in (root / "fp32_adam").iterdir()) == [
        "common.pt", "metadata.json", "rank00000.pt", "rank00001.pt", "rank00002.pt",
        "rank00003.pt",
    ]  # fmt: skip


@pytest.mark.parametrize(("world_size", "bucket_size"), [(2, 37), (1, None)])
def test_resume_at_other_dp_and_bucket_size(
    saved: Any, pools: Any, world_size: int, bucket_size: int | None
) -> None:
    """Saved at dp=4 (bucket sizes 100 / 60), loaded at dp=2 (bucket size 37) and dp=1 (one
    bucket), 5 more steps: params equal the uninterrupted dp=4 run."""
    root, per_rank = saved
    results = pools(world_size).run(resume, str(root), bucket_size)
    for rank, res in enumerate(results):
        for name in VARIANTS:
            want = per_rank[0][name]["uninterrupted"]
            worst = _worst(res[name], want)
            assert worst[1] <= _tolerance(name, want), (world_size, rank, name, worst)
    errors = results[0]["errors"]
    assert "missing entries" in errors["other_model"] and "a.weight" in errors["other_model"]
    assert "torch.bfloat16" in errors["other_dtype"] and "embed.weight" in errors["other_dtype"]
    assert "optimizer class torch.optim.adam.Adam was saved" in errors["other_optimizer"]
    assert "no metadata.json" in errors["not_a_checkpoint"]


def test_consolidated_state_is_param_shaped_in_model_space(saved: Any) -> None:
    """Offline, from the dp=4 files: every param's main param and Adam moments, reassembled into
    param-shaped tensors; the fp32 main params equal the params at save time."""
    root, per_rank = saved
    state = megabuf.consolidated_optimizer_state(root / "fp32_adam")
    at_save = per_rank[0]["fp32_adam"]["at_save"]
    assert set(state) == set(at_save)
    for key, entry in state.items():
        assert torch.equal(entry["main"], at_save[key]), key
        for moment in ("exp_avg", "exp_avg_sq"):
            assert entry[moment].shape == at_save[key].shape, (key, moment)
