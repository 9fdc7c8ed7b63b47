"""Fault injection: a real rank process is killed (SIGKILL) at each stage of a save that would
replace checkpoint A by checkpoint B, and a fresh model at the same dp size then loads exactly A
(B once the second rename happened). See [Note: checkpoint crash safety]."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from background_jobs import Call, Runner
from checkpoint_trust_cases import load_outcome, save_twice_and_die
from dist_pool import case_result, run_each

from megabuf.testing.launch import SpawnError, spawn

# stage -> (the rank that dies, the checkpoint a loader must then see)
STAGES = {
    "mid_write": (1, "A"),  # rank 1 part-way through its rank file
    "before_metadata": (0, "A"),  # every rank file written, no metadata.json yet
    "before_renames": (0, "A"),  # <path>.tmp complete, nothing renamed
    "between_renames": (0, "A"),  # <path> -> <path>.old done, <path>.tmp -> <path> not
    "after_renames": (0, "B"),  # committed, <path>.old not yet removed
}


def _crash_every_stage() -> Path:
    """Each stage's save, its ranks spawned on a thread beside the suite ([Note: background
    jobs]); `crashed` removes the directory."""
    root = Path(tempfile.mkdtemp(prefix="megabuf-faults-"))
    for stage in STAGES:
        (root / stage).mkdir()
        with pytest.raises(SpawnError):
            spawn(save_twice_and_die, 2, str(root / stage), stage, timeout_s=180)
    return root


CRASHES = Call("checkpoint faults: a rank killed at each stage", _crash_every_stage)


@pytest.fixture(scope="module")
def crashed(pools: Any, background: Runner) -> Iterator[tuple[Path, list[dict[str, Any]]]]:
    root = background.result(CRASHES)
    cases = {stage: (load_outcome, str(root / stage), "ckpt") for stage in STAGES}
    yield root, pools(2).run(run_each, cases)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.background(CRASHES)
@pytest.mark.parametrize("stage", STAGES)
def test_rank_killed_during_save_leaves_the_committed_checkpoint(crashed: Any, stage: str) -> None:
    root, per_rank = crashed
    dead, which = STAGES[stage]
    other = "B" if which == "A" else "A"
    assert [p.name for p in (root / stage).glob("died-*")] == [f"died-{stage}-rank{dead}"]
    for rank, res in enumerate(case_result(per_rank, stage)):
        assert "params" in res, (stage, rank, res)
        want = torch.load(root / stage / f"{which}-rank{rank}.pt", weights_only=True)
        unwanted = torch.load(root / stage / f"{other}-rank{rank}.pt", weights_only=True)
        assert all(torch.equal(res["params"][n], want[n]) for n in want), (stage, rank)
        assert not all(torch.equal(res["params"][n], unwanted[n]) for n in want), (stage, rank)
