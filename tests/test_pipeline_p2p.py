"""Pipeline point-to-point needs no tags ([Note: pipeline point-to-point]). On 4 gloo ranks whose
point-to-point runs the way NCCL's does (every tag the same, so messages match in issue order;
every operation waited for as soon as it is issued, so a send first on both ends deadlocks: see
`NcclLikeP2P`), 1F1B and interleaved at PP 2 (x DP 2) and PP 4 give bitwise the losses and grads
of one process running the same stages one after another, with activations above 256 KiB, and
every message goes out in a batched group."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from pipeline_cases import same_tag_case

CASES: dict[str, dict[str, Any]] = {
    "1f1b_pp2": {"pp": 2},
    "1f1b_pp4": {"pp": 4, "microbatches": 6},
    "interleaved_pp2": {"pp": 2, "chunks": 2, "microbatches": 4},
    "interleaved_pp4": {"pp": 4, "chunks": 2, "microbatches": 8},
    "interleaved_pp4_all_warmup": {"pp": 4, "chunks": 2, "microbatches": 4},
}


def _expected_grads(per_rank: list[dict[str, Any]]) -> dict[tuple[int, str], torch.Tensor]:
    """The reference grads after megabuf's reductions: each dp slice's sequential grads summed
    over dp and halved (exact, whichever side of the sum the 1/dp lands on), then the tied
    embedding's two copies summed (the `embd` all-reduce)."""
    refs = [r["reference"] for r in sorted(per_rank, key=lambda r: r["dp_rank"]) if r["reference"]]
    grads = {}
    for key in refs[0]["grads"]:
        total = refs[0]["grads"][key].clone()
        for ref in refs[1:]:
            total += ref["grads"][key]
        grads[key] = total * (1.0 / len(refs))
    last = max(stage for stage, _ in grads)
    tied = grads[(0, "tok_emb.weight")] + grads[(last, "lm_head.weight")]
    return grads | {(0, "tok_emb.weight"): tied, (last, "lm_head.weight"): tied}


@pytest.mark.parametrize("name", CASES)
def test_same_tag_nccl_like_p2p_matches_sequential_reference_bitwise(pools: Any, name: str) -> None:
    # one run per case: a deadlocked case must not take the others with it
    per_rank = case_result(pools(4).run(run_each, {name: (same_tag_case, CASES[name])}), name)
    expected = _expected_grads(per_rank)
    checked = set()
    for rank, res in enumerate(per_rank):
        assert res["activation_nbytes"] > 256 * 1024, res["activation_nbytes"]
        counts = res["counts"]
        assert counts["single"] == 0 and counts["groups"] > 0, (name, rank, counts)
        for key, grad in res["grads"].items():
            assert torch.equal(grad, expected[key]), f"{name} rank {rank}: grad {key} differs"
            checked.add(key)
        ref = next(
            r["reference"] for r in per_rank if r["reference"] and r["dp_rank"] == res["dp_rank"]
        )
        if res["losses"]:  # the last stage
            assert len(res["losses"]) == CASES[name].get("microbatches", 4), name
            for m, (got, want) in enumerate(zip(res["losses"], ref["losses"], strict=True)):
                assert torch.equal(got, want), f"{name} rank {rank}: loss of micro-batch {m}"
    assert checked == set(expected), (name, set(expected) - checked)  # every stage's params
