"""The grad hooks' hot path. [Note: small grads accumulate in place] (megabuf/sync/grads.py): the
runs zeroed at `zero_grad_buffer()` (pure), and on 2 gloo ranks against a single-process
reference: small params accumulate into `main_grad` in place, while every visible `.grad` and
every grad keeps the [Note: grad contract] and [Note: grads the user changed]. [Note: one
bookkeeping per backward] (megabuf/sync/grad_sync.py): counted per backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from small_grad_cases import (
    REFERENCE_CASES,
    check_bookkeeping,
    check_linked,
    check_no_backward,
    check_reference,
    run_cases,
)

from megabuf.sync.grads import contiguous_runs


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
    check_no_backward(results)


def test_small_params_accumulate_in_place_and_grads_equal_the_reference(results: Any) -> None:
    check_linked(results)


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_grads_equal_the_reference(results: Any, case: str) -> None:
    check_reference(results, case)


def test_the_engine_bookkeeping_runs_once_per_backward(results: Any) -> None:
    check_bookkeeping(results)
