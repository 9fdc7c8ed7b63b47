"""Checkpoints people can trust (issue 12): plain torch optimizers save and load through the same
calls; every megabuf optimizer loads into a fresh model; a damaged file or an interrupted save
never loads silently wrong; `extra=` travels with the checkpoint; export to one plain
state_dict. 2 ranks; the test side damages files between the saving and the loading run."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_trust_cases import (
    CROSS,
    FRESH_CASES,
    TORCH_CASES,
    async_saves,
    cross_resume,
    export_full_state,
    fresh_model_resume,
    load_extra,
    load_outcome,
    save_after,
    save_with_extra,
    torch_load_outcome,
    torch_optimizer_resume,
    torch_optimizer_save,
)
from dist_pool import case_result, run_each
from optimizer_cases import Net

import megabuf
import megabuf.checkpoint


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _edit_metadata(path: Path) -> None:  # still valid JSON, one number changed
    meta = json.loads(path.read_text())
    meta["world_size"] = 3  # the index no longer matches its checksum
    path.write_text(json.dumps(meta))


# label -> (file to damage, how, what the error must name)
DAMAGE: dict[str, tuple[str, Callable[[Path], None], list[str]]] = {
    "truncated_rank_file": ("__1_0.distcp", _truncate, ["written by rank 1", "truncated"]),
    "truncated_metadata": ("metadata.json", _truncate, ["written by rank 0", "not valid JSON"]),
    "flipped_byte": ("__1_0.distcp", _flip_byte, ["written by rank 1", "SHA-256"]),
    "flipped_common": ("common.pt", _flip_byte, ["written by rank 0", "SHA-256"]),
    "truncated_dcp_metadata": (".metadata", _truncate, ["written by rank 0", "truncated"]),
    "missing_rank_file": ("__0_0.distcp", Path.unlink, ["written by rank 0", "is missing"]),
    "edited_metadata": ("metadata.json", _edit_metadata, ["written by rank 0", "checksum"]),
}
# label -> checkpoint the loader must return ("A": the committed one, "B": the new complete one)
SWAPS = {"between_renames": "A", "first_save_complete": "B", "first_save_mid_write": None}


def _interrupt(root: Path) -> None:
    """Leave the directories an interrupted save leaves ([Note: checkpoint crash safety])."""
    os.replace(root / "swapA", root / "between_renames.old")  # first rename done ...
    os.replace(root / "swapB", root / "between_renames.tmp")  # ... second not yet
    os.replace(root / "firstB", root / "first_save_complete.tmp")
    os.replace(root / "midB", root / "first_save_mid_write.tmp")
    (root / "first_save_mid_write.tmp" / "metadata.json").unlink()


@pytest.fixture(scope="module")
def runs(pools: Any, tmp_path_factory: Any) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("trust")
    cases: dict[str, tuple[Any, ...]] = {
        n: (torch_optimizer_save, str(root), n) for n in TORCH_CASES
    }
    cases |= {n: (fresh_model_resume, str(root), n) for n in FRESH_CASES}
    cases |= {f"save_{label}": (save_after, str(root), label, 3) for label in DAMAGE}
    cases |= {f"save_{n}": (save_after, str(root), n, s) for n, s in
              (("swapA", 1), ("swapB", 2), ("firstB", 2), ("midB", 2))}  # fmt: skip
    cases |= {"save_extra": (save_with_extra, str(root)), "export": (export_full_state, str(root))}
    cases["async"] = (async_saves, str(root))
    saved = pools(2).run(run_each, cases)
    for label, (name, damage, _) in DAMAGE.items():
        case_result(saved, f"save_{label}")
        damage(root / label / name)
    _interrupt(root)
    loads: dict[str, tuple[Any, ...]] = {n: (load_outcome, str(root), n) for n in DAMAGE}
    loads |= {n: (load_outcome, str(root), n) for n in SWAPS}
    loads["extra"] = (load_extra, str(root))
    loads |= {label: (cross_resume, str(root), label) for label in CROSS}
    loads["torch_into_megabuf"] = (load_outcome, str(root), "torch_adamw")
    loads["megabuf_into_torch"] = (torch_load_outcome, str(root), "async1")
    loaded = pools(2).run(run_each, loads)
    at_dp1 = {n: (torch_optimizer_resume, str(root), n, None) for n in TORCH_CASES}
    return {"root": root, "saved": saved, "loaded": loaded, "dp1": pools(1).run(run_each, at_dp1)}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("name", TORCH_CASES)
def test_torch_optimizer_saves_and_resumes_in_model_space(runs: Any, name: str) -> None:
    """save_checkpoint(path, model, torch_optimizer) on the all-reduce path (was: KeyError
    'pieces'): loaded into a fresh model with another bucket size at dp=2, the remaining steps
    reproduce the uninterrupted run bit for bit; at dp=1 (one bucket) to fp32 rounding."""
    for rank, res in enumerate(case_result(runs["saved"], name)):
        assert _equal(res["same_dp"], res["uninterrupted"]), (name, rank)
    want = case_result(runs["saved"], name)[0]["uninterrupted"]
    got = case_result(runs["dp1"], name)[0]
    worst = max((got[n] - want[n]).abs().max().item() for n in want)
    assert worst <= 1e-6, (name, worst)


def test_torch_optimizer_state_is_param_shaped_offline(runs: Any) -> None:
    """The torch optimizer's state is stored by param name, param-shaped, readable offline:
    equal to the optimizer's own state at save time."""
    want = case_result(runs["saved"], "torch_adamw")[0]["state_at_save"]
    state = megabuf.checkpoint.consolidated_optimizer_state(runs["root"] / "torch_adamw")
    assert set(state) == set(want)
    for key, entry in state.items():
        assert set(entry) == set(want[key]) == {"step", "exp_avg", "exp_avg_sq"}, key
        assert all(torch.equal(entry[k], want[key][k]) for k in entry), key


KIND = {
    "fp32_allreduce_built": "FP32Optimizer", "fp32_allreduce_expert_built": "FP32Optimizer",
    "bf16_allreduce_expert": "MixedPrecisionOptimizer",
    "bf16_distopt_expert": "DistributedOptimizer", "fp32_distopt_built": "DistributedOptimizer",
}  # fmt: skip


@pytest.mark.parametrize("name", FRESH_CASES)
def test_every_megabuf_optimizer_loads_into_a_fresh_model(runs: Any, name: str) -> None:
    """fp32 / bf16 x all-reduce / distributed x dense / expert params: a fresh model and
    optimizer load the params at save time exactly and resume bit for bit."""
    for rank, res in enumerate(case_result(runs["saved"], name)):
        assert res["kind"] == KIND[name], (name, res["kind"])
        assert _equal(res["loaded"], res["at_save"]), (name, rank)
        assert _equal(res["resumed"], res["uninterrupted"]), (name, rank)


@pytest.mark.parametrize("label", DAMAGE)
def test_damaged_file_raises_naming_file_and_rank(runs: Any, label: str) -> None:
    """A truncated, altered or missing file (or metadata.json) raises on every rank, naming the
    file and the rank that wrote it (was: bare OSError / JSONDecodeError, or a silent load)."""
    name, _, parts = DAMAGE[label]
    for rank, res in enumerate(case_result(runs["loaded"], label)):
        message = res.get("error", "loaded without error")
        for part in [f"{label}/{name}", *parts]:
            assert part in message, (label, rank, part, message)


@pytest.mark.parametrize("label", SWAPS)
def test_interrupted_swap_loads_the_committed_checkpoint(runs: Any, label: str) -> None:
    """Between the two renames <path> is gone: the loader takes <path>.old (the committed
    checkpoint), not the newer <path>.tmp; a first save that finished writing loads from
    <path>.tmp; one interrupted mid-write raises saying so."""
    want = {"A": "save_swapA", "B": "save_swapB" if label == "between_renames" else "save_firstB"}
    other = {"A": "save_swapB", "B": "save_swapA"}
    for rank, res in enumerate(case_result(runs["loaded"], label)):
        if SWAPS[label] is None:
            assert "interrupted before it finished writing" in res.get("error", ""), (rank, res)
            continue
        expected = case_result(runs["saved"], want[SWAPS[label]])[rank]
        assert "params" in res, (label, rank, res)
        assert _equal(res["params"], expected), (label, rank)
        assert not _equal(res["params"], case_result(runs["saved"], other[SWAPS[label]])[rank])


def test_extra_is_stored_with_the_checkpoint_and_restores_rng(runs: Any) -> None:
    """extra= comes back from load_checkpoint on every rank (rank 0's); its RNG states restore
    the streams exactly; a checkpoint saved without extra returns None."""
    drawn = case_result(runs["saved"], "save_extra")[0]
    for rank, res in enumerate(case_result(runs["loaded"], "extra")):
        assert res["extra"] == {"step": 1, "best_loss": 0.25, "config": {"lr": 1e-2}}, rank
        assert torch.equal(res["torch_next"], drawn["torch_next"]), rank
        assert res["python_next"] == drawn["python_next"], rank
        assert res["without"] is None, rank
    assert (runs["root"] / "extra" / "extra.pt").is_file()


def test_full_state_dict_is_the_plain_module_state(runs: Any) -> None:
    """Rank 0 gets (and a file holds) the module's own state_dict: its names, no wrapper
    prefix, the published params after the last step; other ranks get None. The same entries
    come out of a checkpoint offline."""
    rank0, rank1 = case_result(runs["saved"], "export")
    state, params = rank0["state"], rank0["params"]
    assert rank1["state"] is None
    assert list(state) == list(Net().state_dict())
    assert all(torch.equal(state[n], params[n]) for n in params)
    from_file = torch.load(runs["root"] / "export" / "model.pt", weights_only=True)
    assert _equal(from_file, state)
    Net().load_state_dict(from_file, strict=True)
    offline = megabuf.checkpoint.consolidated_model_state(runs["root"] / "exported")
    assert _equal(offline, state)


CROSS_KIND = {
    "distopt_to_allreduce": "FP32Optimizer", "allreduce_to_distopt": "DistributedOptimizer",
    "bf16_distopt_to_allreduce": "MixedPrecisionOptimizer",
}  # fmt: skip


@pytest.mark.parametrize("label", CROSS)
def test_resume_across_optimizer_sharding_overlap_and_bucket_size(runs: Any, label: str) -> None:
    """Saved with the distributed optimizer, loaded on the all-reduce path (and back), with
    another overlap setting and bucket size: the params at save time come back exactly and the
    remaining steps reproduce the uninterrupted run bit for bit (dp=2 sums are order-free)."""
    saved_name, _ = CROSS[label]
    for rank, res in enumerate(case_result(runs["loaded"], label)):
        want = case_result(runs["saved"], saved_name)[rank]
        assert res["kind"] == CROSS_KIND[label], (label, res["kind"])
        assert _equal(res["loaded"], want["at_save"]), (label, rank)
        assert _equal(res["resumed"], want["uninterrupted"]), (label, rank)


def test_async_saves_hold_the_state_at_their_call(runs: Any) -> None:
    """Training goes on while an asynchronous save is written: each checkpoint holds the params
    at its save_checkpoint call, the next save finished the previous one, and resuming from the
    first reproduces the uninterrupted run bit for bit."""
    for rank, res in enumerate(case_result(runs["saved"], "async")):
        assert res["first_done"], rank
        assert not _equal(res["at_first"], res["at_second"]), rank
        assert _equal(res["loaded_first"], res["at_first"]), rank
        assert _equal(res["loaded_second"], res["at_second"]), rank
        assert _equal(res["resumed"], res["uninterrupted"]), rank


def test_dcp_to_torch_save_gives_one_plain_file_of_the_params(runs: Any, tmp_path: Path) -> None:
    """torch.distributed.checkpoint.format_utils.dcp_to_torch_save turns a megabuf checkpoint
    (dp=2, distributed optimizer: each rank wrote its shard pieces) into one torch.save file:
    "model" is the module's state_dict (the params at save), "optimizer" each param's flat
    state, equal to what megabuf's own offline reader assembles."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    state = case_result(runs["saved"], "export")[0]["state"]
    dcp_to_torch_save(runs["root"] / "exported", tmp_path / "one.pt")
    plain = torch.load(tmp_path / "one.pt", weights_only=True)
    assert list(plain["model"]) == list(state) and _equal(plain["model"], state)
    offline = megabuf.checkpoint.consolidated_optimizer_state(runs["root"] / "exported")
    assert set(plain["optimizer"]) == set(offline) == set(dict(Net().named_parameters()))
    for key, entry in offline.items():
        assert (
            set(plain["optimizer"][key]) == set(entry) == {"main", "step", "exp_avg", "exp_avg_sq"}
        )
        for name, value in entry.items():
            assert torch.equal(plain["optimizer"][key][name].view(value.shape), value), (key, name)


@pytest.mark.parametrize(
    ("label", "parts"),
    [("torch_into_megabuf", ["megabuf-torch-optimizer-v1", "megabuf-optimizer-v1"]),
     ("megabuf_into_torch", ["saved with a megabuf optimizer", "cannot fill the torch optimizer"])],
)  # fmt: skip
def test_optimizer_kind_mismatch_is_named(runs: Any, label: str, parts: list[str]) -> None:
    """A checkpoint of a plain torch optimizer does not load into a megabuf optimizer, nor the
    other way round: a ValueError on every rank says which was saved."""
    for rank, res in enumerate(case_result(runs["loaded"], label)):
        for part in parts:
            assert part in res.get("error", "loaded without error"), (label, rank, res)
