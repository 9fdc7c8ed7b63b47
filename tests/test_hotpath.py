"""The hot path on real gloo ranks: one collective per bucket group where the strategy allows it
([Note: one collective per bucket group]) with grads bitwise equal to one group per bucket, and
bf16 grad shards upcast in windows with params bitwise equal to one full fp32 copy ([Note: bf16
grads without an fp32 copy]), the saving reported by memory_report."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from hotpath_cases import coalesce_case, reverse_wait_case, upcast_case

from megabuf.transport.collectives import adjacent_runs

CASES: dict[str, tuple[Any, ...]] = {
    "all_reduce": (coalesce_case, {}),
    "reduce_scatter": (coalesce_case, {"distopt": True}),
    "reduce_scatter_coalesced": (coalesce_case, {"distopt": True, "coalesce": True}),
    "reverse_wait": (reverse_wait_case, {}),
    "upcast_window_1": (upcast_case, 1),
    "upcast_window_100": (upcast_case, 100),
}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES)  # type: ignore[no-any-return]


def test_adjacent_views_merge_into_one_and_others_do_not() -> None:
    buf = torch.arange(10.0)
    runs = adjacent_runs([buf[0:3], buf[3:7], buf[8:10], torch.ones(2)])
    assert [r.tolist() for r in runs] == [[0, 1, 2, 3, 4, 5, 6], [8, 9], [1, 1]]
    assert runs[0].data_ptr() == buf.data_ptr()  # a view, not a copy


@pytest.mark.parametrize(
    ("name", "op", "per"),
    [
        ("all_reduce", "all_reduce", "n_buffers"),  # union of each buffer's buckets
        # (no coalesced all-reduce case: gloo's allreduce_coalesced refuses mixed dtypes)
        ("reduce_scatter", "reduce_scatter", "n_buckets"),  # gloo: an all-to-all per bucket
        ("reduce_scatter_coalesced", "reduce_scatter", 1),  # coalescing manager
    ],
)
def test_collectives_per_bucket_group(results: Any, name: str, op: str, per: Any) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["n_groups"] == 1 and res["n_buffers"] == 2, res
        assert res["n_buckets"] == 2, res  # disable_bucketing: one bucket per buffer
        want = res[per] if isinstance(per, str) else per
        assert res["calls"] == {op: want}, f"{name} rank {rank}: {res['calls']}"
        assert res["same"], f"{name} rank {rank}: grads differ from one group per bucket"


@pytest.mark.parametrize("name", ["reduce_scatter", "reduce_scatter_coalesced"])
def test_param_gather_is_one_call_per_bucket_group(results: Any, name: str) -> None:
    for res in case_result(results, name):
        assert res["gathers"] == 1, res  # gloo: one p2p batch; native: one coalesced batch


@pytest.mark.parametrize(("name", "window"), [("upcast_window_1", 1), ("upcast_window_100", 100)])
def test_bf16_grads_upcast_in_windows(results: Any, name: str, window: int) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["clipped"], res  # the clip factor path is exercised
        assert res["same_params"] and res["same_norms"], f"rank {rank}: {res}"
        full_nbytes = 4 * res["half_numel"]
        assert res["full"] == (full_nbytes, 0), res
        copy_nbytes, saved = res["windowed"]
        assert copy_nbytes <= 4 * max(window, res["largest_numel"]), res
        assert copy_nbytes > 0 and saved == full_nbytes - copy_nbytes > 0, res
        assert res["user_class"] == (full_nbytes, 0), res  # not windowed: one full copy


def test_coalesced_batch_waited_in_any_order_gives_each_result_once(results: Any) -> None:
    # every record holds the batch behind a wait-once guard: waiting the last first neither
    # runs its epilogue before the data nor lets gloo copy the batch out twice
    for rank, res in enumerate(case_result(results, "reverse_wait")):
        assert res["same"], f"rank {rank}: {res}"
