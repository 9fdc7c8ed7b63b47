"""Pipeline schedules on 4 gloo ranks: PP=2 x DP=2 with 1F1B and interleaved (2 chunks per stage),
PP=4 x DP=1, and no pipelining at DP=4 give the same params after 3 SGD steps as one process on
the global batch, with overlap flags on and off, with and without the distributed optimizer; tied
embeddings on the first and last stage stay identical; the schedule calls its hooks in Megatron's
order."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from pipeline_cases import pipeline_case

ATOL = 1e-6
OVERLAP = {"overlap_grad_reduce": True, "bucket_size": 200}
DISTOPT = {"use_distributed_optimizer": True, "bucket_size": 200}
DISTOPT_OVERLAP = {**DISTOPT, "overlap_grad_reduce": True, "overlap_param_gather": True}
DISTOPT_ALIGN = {**DISTOPT_OVERLAP, "align_param_gather": True}
CASES: dict[str, dict[str, Any]] = {
    "no_pipelining_dp4_overlap": {"pp": 1, "config": OVERLAP},
    "1f1b_sync": {"pp": 2},
    "1f1b_overlap": {"pp": 2, "config": OVERLAP},
    "1f1b_overlap_per_token_loss": {"pp": 2, "config": OVERLAP, "per_token": True},
    "1f1b_distopt": {"pp": 2, "config": DISTOPT},
    "1f1b_distopt_overlap": {"pp": 2, "config": DISTOPT_OVERLAP},
    "interleaved_sync": {"pp": 2, "chunks": 2},
    "interleaved_overlap": {"pp": 2, "chunks": 2, "config": OVERLAP, "microbatches": 6},
    "interleaved_distopt": {"pp": 2, "chunks": 2, "config": DISTOPT},
    "interleaved_distopt_align": {"pp": 2, "chunks": 2, "config": DISTOPT_ALIGN},
    "pp4_1f1b_overlap": {"pp": 4, "config": OVERLAP},
    "pp4_interleaved_overlap": {"pp": 4, "chunks": 2, "config": OVERLAP},  # has empty stages
    # chunks without params still join every grad-norm reduction of the distributed optimizer
    "pp4_interleaved_distopt_empty_chunks": {"pp": 4, "chunks": 2, "config": DISTOPT_OVERLAP},
}


PIPELINED = [name for name, case in CASES.items() if case["pp"] > 1]
DISTRIBUTED_OPTIMIZER = [
    name for name, case in CASES.items() if case.get("config", {}).get("use_distributed_optimizer")
]


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases = {name: (pipeline_case, case) for name, case in CASES.items()}
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", CASES)
def test_params_match_single_process_after_3_steps(results: Any, name: str) -> None:
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        worst = max(res["errors"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        assert worst[1] <= ATOL, f"{name} rank {rank}: {worst[0]} off by {worst[1]:.3g}"
    # together the ranks hold every param of the GPT
    held = set().union(*(res["errors"] for res in per_rank))
    assert "blocks.3.fc_out.bias" in held and "tok_emb.weight" in held, name
    assert ("lm_head.weight" in held) == (CASES[name]["pp"] > 1), name


@pytest.mark.parametrize("name", PIPELINED)
def test_tied_embeddings_identical_across_first_and_last_stage(results: Any, name: str) -> None:
    per_rank = case_result(results, name)
    first = [r["tied"]["tok_emb.weight"] for r in per_rank if r["pp_rank"] == 0]
    last_stage = CASES[name]["pp"] - 1
    last = [r["tied"]["lm_head.weight"] for r in per_rank if r["pp_rank"] == last_stage]
    assert first and last, name
    for a in first:
        for b in last:
            assert torch.equal(a, b), name


def _index(events: list[tuple[Any, ...]], event: tuple[Any, ...]) -> int:
    return events.index(event)


@pytest.mark.parametrize("name", ["1f1b_sync", "1f1b_overlap", "pp4_1f1b_overlap"])
def test_1f1b_hook_order(results: Any, name: str) -> None:
    m_last = 3
    overlap = "overlap" in name
    for rank, res in enumerate(case_result(results, name)):
        ev, stage = res["events"], res["pp_rank"]
        assert ev[0] == ("no_sync_enter", 0) and ev[-1] == ("finalize",), (name, ev)
        assert ev.count(("no_sync_enter", 0)) == ev.count(("no_sync_exit", 0)) == 1
        exit_at, last_b = _index(ev, ("no_sync_exit", 0)), _index(ev, ("B", 0, m_last))
        backwards = [i for i, e in enumerate(ev) if e[0] == "B"]
        if overlap and stage > 0:  # reduction launched by grad_sync_func after cool-down
            assert exit_at > backwards[-1], (name, rank, ev)
        else:  # sync back on right before the last backward only
            assert backwards[-2] < exit_at < last_b, (name, rank, ev)
        if overlap:
            assert ev.count(("grad_sync", 0)) == 1 and _index(ev, ("grad_sync", 0)) > last_b
        else:
            assert ("grad_sync", 0) not in ev


@pytest.mark.parametrize(("name", "m_last"), [("interleaved_overlap", 5), ("interleaved_sync", 3)])
def test_interleaved_hook_order(results: Any, name: str, m_last: int) -> None:
    overlap = "overlap" in name
    for rank, res in enumerate(case_result(results, name)):
        ev = res["events"]
        assert ev[:2] == [("no_sync_enter", 0), ("no_sync_enter", 1)], (name, ev)
        assert ev[-1] == ("finalize",) and ("F", 0, 0) in ev
        for chunk in (0, 1):
            last_b = _index(ev, ("B", chunk, m_last))
            in_no_sync = _no_sync_depth(ev[:last_b]) > 0
            assert in_no_sync == overlap, (name, rank, chunk, ev)  # hooks vs grad_sync_func
            if overlap:
                assert ev.count(("grad_sync", chunk)) == 1
                assert _index(ev, ("grad_sync", chunk)) > last_b, (name, rank, ev)


def _compute_positions(events: list[tuple[Any, ...]], phase: str) -> list[int]:
    return [i for i, e in enumerate(events) if e[0] == phase]


def _window(events: list[tuple[Any, ...]], after: int) -> tuple[int, int]:
    """(after, the index of the next forward, backward or finalize event): the open interval
    in which nothing but sync hooks may run."""
    nxt = next(i for i in range(after + 1, len(events)) if events[i][0] in ("F", "B", "finalize"))
    return after, nxt


@pytest.mark.parametrize(
    ("name", "m_last", "pp"), [("interleaved_overlap", 5, 2), ("pp4_interleaved_overlap", 3, 4)]
)
def test_interleaved_grad_sync_fires_exactly_pp_rank_backwards_after_the_chunks_last(
    results: Any, name: str, m_last: int, pp: int
) -> None:
    """Claim (Megatron's interleaved schedule): on stage s, chunk c's grad sync is launched
    right after the backward that comes s backward steps after c's last backward micro-batch
    (so every stage launches it at the same pipeline step), or after the last backward when
    fewer remain, and before the next forward or backward: bounded on both sides, on every
    rank and stage. "After c's last backward" alone holds on stage 0 by construction and on
    later stages even when the sync fires s steps early."""
    seen_stages = set()
    for rank, res in enumerate(case_result(results, name)):
        ev, stage = res["events"], res["pp_rank"]
        seen_stages.add(stage)
        backwards = _compute_positions(ev, "B")
        for chunk in (0, 1):
            last = backwards.index(_index(ev, ("B", chunk, m_last)))
            k = last + stage
            at = (
                backwards[k] if k < len(backwards) else max(_compute_positions(ev, "F") + backwards)
            )
            lo, hi = _window(ev, at)
            syncs = [i for i, e in enumerate(ev) if e == ("grad_sync", chunk)]
            assert len(syncs) == 1 and lo < syncs[0] < hi, (name, rank, stage, chunk, ev)
    assert seen_stages == set(range(pp)), seen_stages


@pytest.mark.parametrize("name", ["1f1b_overlap", "pp4_1f1b_overlap"])
def test_1f1b_grad_sync_fires_after_the_last_backward_and_before_finalize(
    results: Any, name: str
) -> None:
    """Claim: with grad_sync_func, 1F1B launches the reduction after the stage's last compute
    step (cool-down included) and before finalize, on every stage: nothing computes between."""
    for rank, res in enumerate(case_result(results, name)):
        ev = res["events"]
        last = max(i for i, e in enumerate(ev) if e[0] in ("F", "B"))
        lo, hi = _window(ev, last)
        syncs = [i for i, e in enumerate(ev) if e == ("grad_sync", 0)]
        assert len(syncs) == 1 and lo < syncs[0] < hi and ev[hi] == ("finalize",), (rank, ev)


def _no_sync_depth(events: list[tuple[Any, ...]]) -> int:
    return sum(
        +1 if e == ("no_sync_enter", 0) else -1
        for e in events
        if e[0].startswith("no_sync") and e[1] == 0
    )


def test_interleaved_align_dispatches_param_sync_first(results: Any) -> None:
    for res in case_result(results, "interleaved_distopt_align"):
        ev = res["events"]
        first_f = _index(ev, ("F", 0, 0))
        assert ("param_sync", 0) in ev[:first_f] and ("param_sync", 1) in ev[:first_f], ev


def test_later_stages_and_chunks_use_one_bucket_group(results: Any) -> None:
    for res in case_result(results, "interleaved_overlap"):
        groups = res["n_groups"]
        if res["pp_rank"] == 0:
            assert groups[0] > 2 and groups[1] == 1, groups
        else:
            assert groups == [1, 1], groups


@pytest.mark.parametrize("name", DISTRIBUTED_OPTIMIZER)
def test_distributed_optimizer_grad_norm_counts_tied_embedding_once(
    results: Any, name: str
) -> None:
    checked = 0
    for rank, res in enumerate(case_result(results, name)):
        for got, want in zip(res["norms"], res["ref_norms"], strict=True):
            assert abs(got - want) <= 1e-5 * want, f"{name} rank {rank}: {got} vs {want}"
            checked += 1
    assert checked > 0
