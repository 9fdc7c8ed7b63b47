"""The grad hooks' hot path. [Note: small grads accumulate in place] (megabuf/grads.py): the
runs zeroed at `zero_grad_buffer()` (pure), and on 2 gloo ranks against a single-process
reference: small params accumulate into `main_grad` in place, while every visible `.grad` and
every grad keeps the [Note: grad contract] and [Note: grads the user changed]. [Note: one
bookkeeping per backward] (megabuf/grad_sync.py): counted per backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from small_grad_cases import run_cases

from megabuf.grads import contiguous_runs

TOL = 1e-6  # dp 2: megabuf averages (g0 + g1) / 2, the reference adds g0 / 2 + g1 / 2


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return case_result(pools(2).run(run_each, {"small": (run_cases,)}), "small")


def _spans(runs: list[torch.Tensor], base: torch.Tensor) -> list[tuple[int, int]]:
    return [(r.storage_offset() - base.storage_offset(), r.numel()) for r in runs]


def test_runs_cover_adjacent_small_views_padding_included_and_a_large_one_breaks_them() -> None:
    flat = torch.zeros(100)
    small = [flat[0:4], flat[6:10].view(2, 2), flat[10:12]]  # 4..6 is padding
    large = flat[20:40]
    after = [flat[40:42], flat[50:51]]
    runs = contiguous_runs([*reversed(small), large, *after], max_numel=10)  # any order
    assert sorted(_spans(runs, flat)) == [(0, 12), (40, 11)]
    runs[0].fill_(1.0)
    assert flat[20:40].eq(0).all()  # the large view is never inside a run


def test_views_of_different_buffers_never_share_a_run() -> None:
    one, two = torch.zeros(8), torch.zeros(8)
    runs = contiguous_runs([one[0:2], two[2:4], one[2:4]], max_numel=4)
    assert len(runs) == 2 and {r.numel() for r in runs} == {4, 2}


def test_a_step_without_backward_after_zero_grad_buffer_changes_no_param(results: Any) -> None:
    for rank, res in enumerate(results):
        assert res["no_backward"] == {"grads_none": True, "unchanged": True}, rank


def test_small_params_accumulate_in_place_and_grads_equal_the_reference(results: Any) -> None:
    for rank, res in enumerate(results):
        linked = res["linked"]
        assert linked["small"] == ["a.bias", "b.bias", "norm.bias", "norm.weight", "scale"]
        # all but the first param to get its grad (scale: the last in forward), whose hook is
        # where the others are linked
        assert linked["linked_before_accumulation"] == linked["small"][:-1], (rank, linked)
        assert linked["all_linked_after"] and linked["error"] <= TOL, (rank, linked)


@pytest.mark.parametrize(
    "case", ["microbatches", "user_grad", "fresh_after_sync", "fresh_after_empty_sync"]
)
def test_grads_equal_the_reference(results: Any, case: str) -> None:
    for rank, res in enumerate(results):
        assert res[case] <= TOL, (rank, case, res[case])


def test_the_engine_bookkeeping_runs_once_per_backward(results: Any) -> None:
    for rank, res in enumerate(results):
        assert res["bookkeeping"] == {
            "one_backward": 1,
            "two_no_sync_backwards": 2,
            "two_backwards_one_graph": 2,
            "after_a_raised_backward": 1,
        }, rank
