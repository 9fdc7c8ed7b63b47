"""Comm hook state in checkpoints ([Note: comm hook state in checkpoints]), with a test-only
hook that has PowerSGD's shape of state (checkpoint_hook_state_cases.ResidualQuantize): saved
at step 3 and reloaded into new engines, the continuation is bitwise the uninterrupted run's
at the same dp size (same and other bucket size; all-reduce and distributed optimizer; async
save; several chunks; dense + expert buffers); at a smaller dp size each rank gets the merged
form and the group's total residual is preserved; mismatches are strict by default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_hook_state_cases import (
    VARIANTS,
    chunks_case,
    errors_case,
    expert_case,
    load_merged,
    pipeline_case,
    save_then_continue,
)
from dist_pool import case_result, run_each

import megabuf.checkpoint


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> Path:
    return Path(tmp_path_factory.mktemp("hook_ckpt"))


@pytest.fixture(scope="module")
def dp4(pools: Any, root: Path) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {n: (save_then_continue, str(root), n) for n in VARIANTS}
    cases["expert"] = (expert_case, str(root))
    cases["pp2"] = (pipeline_case, str(root))
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp2(pools: Any, root: Path, dp4: Any) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {n: (save_then_continue, str(root), n) for n in VARIANTS}
    cases |= {f"{n}_from4": (load_merged, str(root), n, 4) for n in VARIANTS}
    cases["chunks"] = (chunks_case, str(root))
    cases["errors"] = (errors_case, str(root))
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def dp1(pools: Any, root: Path, dp2: Any) -> list[dict[str, Any]]:
    cases = {f"{n}_from2": (load_merged, str(root), n, 2) for n in VARIANTS}
    return pools(1).run(run_each, cases)  # type: ignore[no-any-return]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _same(a["replicated"], b["replicated"]) and _same(a["per_rank"], b["per_rank"])


@pytest.mark.parametrize("world", [4, 2])
@pytest.mark.parametrize("name", VARIANTS)
def test_same_dp_resume_is_bitwise_at_any_bucket_size(
    dp4: Any, dp2: Any, world: int, name: str
) -> None:
    """A new engine (same bucket size, or another one: state is in param space) gets exactly
    the state each rank saved (per_rank_merged False) and continues bit for bit as the run
    that never stopped; "rs_async" is the distributed optimizer with an async save, training
    on while it is written."""
    for rank, res in enumerate(case_result(dp4 if world == 4 else dp2, name)):
        for label in ("same", "other_bucket"):
            assert res[f"{label}_merged"] is False, (rank, label)
            assert _same_state(res[f"{label}_loaded"], res["at_save"]), (rank, label)
            assert _same(res[label], res["uninterrupted"]), (world, name, rank, label)
        assert res["at_save"]["per_rank"], "the hook kept residuals by step 3"
        assert res["same_buckets"] != res["other_bucket_buckets"], "another bucket layout"


@pytest.mark.parametrize("name", VARIANTS)
def test_the_hook_state_changes_the_result(dp2: Any, name: str) -> None:
    """Loaded with strict_comm_hooks=False into a model whose hook is registered after the load
    (so its state starts fresh): a warning names the dropped state, and the params differ from
    the uninterrupted run's (the state matters; the bitwise test above is not vacuous)."""
    for res in case_result(dp2, name):
        assert not _same(res["lost"], res["uninterrupted"])
        (warning,) = res["lost_warnings"]
        assert "ResidualQuantize" in warning and "'dense' buffers" in warning, warning
        assert "its state is dropped" in warning, warning
        assert "strict_comm_hooks=False" in warning, warning


def _total(per_rank: list[dict[str, Any]], key: str) -> torch.Tensor:
    total = per_rank[0]["per_rank"][key].clone()
    for state in per_rank[1:]:
        total += state["per_rank"][key]
    return total


@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (2, 1)], ids=["4to2", "2to1"])
@pytest.mark.parametrize("name", VARIANTS)
def test_other_dp_gets_the_merged_form_and_keeps_the_total_residual(
    dp4: Any, dp2: Any, dp1: Any, saved: int, loaded: int, name: str
) -> None:
    """Saved at dp=4 (dp=2), loaded at dp=2 (dp=1): per_rank_merged with counts 4 (2); the
    test hook divides the sum by its group size, so the new group's residuals add up bitwise
    to the saved group's (summed in rank order); replicated state is loaded as saved, and two
    more steps run."""
    before = [r["at_save"] for r in case_result({4: dp4, 2: dp2}[saved], name)]
    after = case_result({2: dp2, 1: dp1}[loaded], f"{name}_from{saved}")
    keys = set(before[0]["per_rank"])
    assert keys
    for res in after:
        assert res["merged"] is True
        assert res["counts"] == dict.fromkeys(keys, saved)
        assert _same(res["loaded"]["replicated"], before[0]["replicated"])
        assert res["step_after"] == before[0]["replicated"]["step"] + 2
    loaded_states = [r["loaded"] for r in after]
    for key in keys:
        assert torch.equal(_total(loaded_states, key), _total(before, key)), key


def test_several_chunks_save_each_hook_and_resume_bitwise(dp2: Any) -> None:
    """Two model chunks with a hook each: both slots are saved ("chunk0/dense", "chunk1/dense")
    and the continuation is bitwise; loading a checkpoint saved with chunk 1 unhooked into
    chunks both hooked names chunk 1's hook as having no saved state."""
    for res in case_result(dp2, "chunks"):
        assert res["same"] and all(res["same"]), res["same"]
        assert res["slots"] == ["chunk0/dense", "chunk1/dense"]
        assert "'chunk1/dense'" in res["missing"] and "checkpoint holds none" in res["missing"]
        assert "'chunk0/dense'" not in res["missing"], res["missing"]


def test_expert_keys_are_held_by_their_expert_dp_group_and_resume_bitwise(
    dp4: Any, root: Path
) -> None:
    """ep=2 x expt_dp=2 (ranks 0, 2 hold ep rank 0's experts; 1, 3 ep rank 1's): one hook on
    both kinds is one slot; each expert key is stored with its ep rank and held by exactly its
    expt_dp group, dense keys by all 4 (listed as the slot's ranks); the hook (which raises on
    keys of params it does not reduce) gets back exactly its own state; bitwise continuation."""
    meta = json.loads((root / "expert" / "metadata.json").read_text())
    (slot,) = meta["comm_hooks"].values()
    assert slot["ranks"] == [0, 1, 2, 3]
    holders = {k: e.get("holders", slot["ranks"]) for k, e in slot["per_rank"].items()}
    expert = {k: h for k, h in holders.items() if ".experts." in k}
    assert expert and len(expert) < len(holders)
    assert all("holders" in slot["per_rank"][k] for k in expert)  # others: "all the slot's"
    for key, held in holders.items():
        if key in expert:
            want = [0, 2] if "/ep0/" in key else [1, 3]
            assert held == want, (key, held)
        else:
            assert held == [0, 1, 2, 3], (key, held)
    for rank, res in enumerate(case_result(dp4, "expert")):
        assert res["both_kinds_one_hook"] and res["merged"] is False
        assert _same_state(res["loaded"], res["at_save"]), rank
        assert _same(res["resumed"], res["uninterrupted"]), rank


def test_pipeline_stages_save_their_own_slot_and_resume_bitwise(dp4: Any, root: Path) -> None:
    """pp=2 x dp=2: the hooks of stage 0 and stage 1 are saved as slots "stage0/dense" and
    "stage1/dense", held by that stage's dp ranks; a new engine gets each stage's state back and
    continues bit for bit."""
    meta = json.loads((root / "pp2" / "metadata.json").read_text())
    assert sorted(meta["comm_hooks"]) == ["stage0/dense", "stage1/dense"]
    assert meta["comm_hooks"]["stage0/dense"]["ranks"] == [0, 1]
    assert meta["comm_hooks"]["stage1/dense"]["ranks"] == [2, 3]
    for rank, res in enumerate(case_result(dp4, "pp2")):
        assert res["at_save"]["per_rank"], rank
        assert _same_state(res["loaded"], res["at_save"]), rank
        assert _same(res["resumed"], res["uninterrupted"]), rank


def test_offline_state_lists_every_slot_key_and_holder(dp2: Any, root: Path) -> None:
    """consolidated_comm_hook_state: without a process group, the saved state by slot; per-rank
    tensors by saving rank equal what each rank held at save time, scalars as saved."""
    per_rank = case_result(dp2, "ar")
    state = megabuf.checkpoint.consolidated_comm_hook_state(root / "ar_dp2")
    slot = state["dense"]
    assert slot["class"].endswith("ResidualQuantize") and slot["layout"] == {}
    assert slot["replicated"]["format"] == "v1" and slot["replicated"]["step"] == 3
    assert slot["replicated"]["rng"].dtype == torch.uint8
    for rank, res in enumerate(per_rank):
        for key, value in res["at_save"]["per_rank"].items():
            assert torch.equal(slot["per_rank"][key][rank], value), (rank, key)


MESSAGES = {
    "no_hook": ["ResidualQuantize", "'dense' buffers", "no comm hook", "strict_comm_hooks=False"],
    "stateless_hook": ["Compress(bfloat16, wire) (stateless)", "strict_comm_hooks=False"],
    "other_class": ["saved by", "ResidualQuantize", "OtherStateful", "strict_comm_hooks=False"],
    "no_saved_state": ["checkpoint holds none", "before it was added", "strict_comm_hooks=False"],
    "layout": ["refused its saved state", "tied to the bucket layout", "bucket_numels"],
    "object": ["['bad']", "of type object", "never a process group"],
    "group": ["['bad']", "ProcessGroup", "never a process group"],
    "rank_dependent": ["'counter'", "differs across the ranks", "rank 0", "rank 1", "per_rank"],
}


@pytest.mark.parametrize("label", MESSAGES)
def test_mismatches_raise_on_every_rank_naming_hook_and_option(dp2: Any, label: str) -> None:
    for res in case_result(dp2, "errors"):
        for part in MESSAGES[label]:
            assert part in res[label], (label, part, res[label])


def test_relaxed_loads_warn_and_keep_the_initial_state(dp2: Any) -> None:
    """strict_comm_hooks=False: a checkpoint without hook state loads into a hooked model (a
    warning; the hook stays at step 0); a hook of another class warns once and keeps its
    own initial state. A layout-bound hook loads at its own bucket size; nothing is left at
    the path of a refused save."""
    for res in case_result(dp2, "errors"):
        assert res["relaxed_step"] == 0
        assert (
            len(res["relaxed_warnings"]) == 1
            and "before it was added" in res["relaxed_warnings"][0]
        )
        assert len(res["other_class_relaxed"]) == 1, res["other_class_relaxed"]
        assert res["layout_same"] == "no error"
        assert res["x_exists"] is False


def test_merged_sum_is_in_rank_order_and_fp32_for_half_dtypes() -> None:
    """The merge of per-rank values (no process group): fp32 values summed in rank order as
    they are; bf16 values summed in fp32 and rounded once (not rounded at every add)."""
    from megabuf.checkpoint.hook_load import _sum

    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(64, generator=g) for _ in range(4)]
    assert torch.equal(_sum(fp32), ((fp32[0] + fp32[1]) + fp32[2]) + fp32[3])
    big, small = torch.full((8,), 256.0), torch.full((8,), 0.75)
    half = [big.bfloat16(), small.bfloat16(), small.bfloat16()]
    assert _sum(half).dtype == torch.bfloat16
    per_add = (half[0] + half[1]) + half[2]  # 256: each 0.75 is lost (bf16 ulp at 256 is 2)
    assert torch.equal(per_add, big.bfloat16())
    assert torch.equal(_sum(half), torch.full((8,), 258.0, dtype=torch.bfloat16))  # 257.5 once
    assert _sum(fp32[:1]) is fp32[0]
