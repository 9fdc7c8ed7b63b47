"""[Note: counted arrivals] (megabuf/buckets/arrivals.py): the counter alone against a fake bucket
group (when Python runs, what it hands out, raising without losing the chain), and on 2 gloo ranks
(tests/counted_cases.py) every loop bitwise equal to per-param Python hooks, the first also
against a single-process reference; the refusals and the hooks' lifetime."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from counted_cases import CASES, LOOPS
from dist_pool import case_result, run_each
from torch import nn

from megabuf.buckets.arrivals import CountedArrivals


class FakeGroup:
    """What a counter asks of its bucket group, recorded."""

    def __init__(self, n: int, counts: bool = True) -> None:
        self.params_list = [nn.Parameter(torch.zeros(2)) for _ in range(n)]
        for p in self.params_list:
            p.main_grad = torch.zeros(2)  # type: ignore[attr-defined]
        self.accepts_grads = True
        self.counts_arrivals = counts
        self.sharded_grads = None
        self.ready_at: list[int] = []
        self.arrivals = 0
        self.unwritten: bytearray | None = None
        self.fail_when_ready: Exception | None = None

    def on_all_arrived(self) -> None:
        self.ready_at.append(self.arrivals)
        if self.fail_when_ready is not None:
            raise self.fail_when_ready

    def on_counted_grad_outside_idle(self) -> None:
        raise RuntimeError("fake: dispatched")

    def set_unwritten(self, flags: bytearray) -> None:
        self.unwritten = flags

    def name_of(self, param: nn.Parameter) -> str:
        return f"p{next(i for i, q in enumerate(self.params_list) if q is param)}"


def _counter(group: FakeGroup, total: int) -> tuple[CountedArrivals, list[int]]:
    calls: list[int] = []
    counter = CountedArrivals(group, total, lambda: lambda: calls.append(1), [False])  # type: ignore[arg-type]
    return counter, calls


def _arrive(counter: CountedArrivals, group: FakeGroup, times: int) -> None:
    for _ in range(times):
        group.arrivals += 1
        assert counter.hook(group.params_list[0]) is None  # a hook must return None


def test_python_runs_at_the_first_arrival_and_at_the_learned_total_only() -> None:
    group = FakeGroup(5)
    counter, bookkeeping = _counter(group, total=7)
    _arrive(counter, group, 6)
    assert group.ready_at == [] and counter.python_turns == 1 and len(bookkeeping) == 1
    _arrive(counter, group, 1)
    assert group.ready_at == [7] and counter.python_turns == 2
    _arrive(counter, group, 2)  # after the group was ready: each one checked, none ready again
    assert group.ready_at == [7] and counter.python_turns == 4
    counter.reset()
    group.arrivals = 0
    _arrive(counter, group, 7)
    assert group.ready_at == [7, 7] and counter.python_turns == 6


def test_a_total_of_one_is_ready_at_its_first_arrival() -> None:
    group = FakeGroup(1)
    counter, _ = _counter(group, total=1)
    _arrive(counter, group, 1)
    assert group.ready_at == [1] and counter.python_turns == 1


@pytest.mark.parametrize("total", [0, 3])
def test_without_counting_a_long_run_passes_without_python(total: int) -> None:
    """Overlap off (total 0) or inside no_sync() (counts_arrivals False): nothing gets ready."""
    group = FakeGroup(3, counts=total == 0)
    counter, _ = _counter(group, total=total)
    _arrive(counter, group, 12)
    assert group.ready_at == [] and counter.python_turns == 1


def test_an_error_raises_at_every_arrival_until_a_reset_and_counting_then_resumes() -> None:
    group = FakeGroup(2)
    counter, _ = _counter(group, total=2)
    group.fail_when_ready = ValueError("planted")
    _arrive(counter, group, 1)
    with pytest.raises(ValueError, match="planted"):
        _arrive(counter, group, 1)
    with pytest.raises(ValueError, match="planted"):  # the chain kept its counter
        _arrive(counter, group, 1)
    group.fail_when_ready = None
    counter.reset()
    group.arrivals = 0
    _arrive(counter, group, 2)
    assert group.ready_at == [2, 2]


def test_an_arrival_after_the_dispatch_raises_what_the_group_says() -> None:
    group = FakeGroup(2)
    counter, _ = _counter(group, total=2)
    _arrive(counter, group, 2)
    group.accepts_grads = False
    with pytest.raises(RuntimeError, match="fake: dispatched"):
        _arrive(counter, group, 1)


def test_reconcile_copies_own_tensors_links_them_and_flags_params_without_grads() -> None:
    group = FakeGroup(3)
    counter, _ = _counter(group, total=3)
    linked, own, none = group.params_list
    linked.grad = linked.main_grad  # type: ignore[attr-defined]
    own.grad = torch.tensor([3.0, 4.0])
    counter.reconcile()
    assert own.grad is own.main_grad and own.main_grad.tolist() == [3.0, 4.0]  # type: ignore[attr-defined]
    assert linked.grad is linked.main_grad and none.grad is None  # type: ignore[attr-defined]
    assert group.unwritten == bytearray([0, 0, 1])


def test_reconcile_refuses_a_grad_that_requires_grad_by_name() -> None:
    group = FakeGroup(2)
    counter, _ = _counter(group, total=2)
    group.rank = 0  # type: ignore[attr-defined]
    group.params_list[1].grad = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"p1 got a grad that requires grad"):
        counter.reconcile()


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES)  # type: ignore[no-any-return]


LOOP_CASES = [f"loop_{name}" for name in LOOPS] + ["loop_megabuf_sync", "loop_torch_sync"]


@pytest.mark.parametrize("case", LOOP_CASES)
def test_counted_loops_are_bitwise_the_per_param_hooks(results: Any, case: str) -> None:
    for rank, res in enumerate(case_result(results, case)):
        assert res["diff"] == 0.0, (rank, res)
        assert res["turns_off"] == [None] * 7, res  # the control ran with Python hooks
        assert None not in res["turns"] and sum(res["turns"]) > 0, (rank, res)  # all counted


def test_python_runs_twice_per_group_per_iteration_with_overlap(results: Any) -> None:
    """megabuf loop, 4 iterations, counting from the second: first arrival and the last; the
    group of `spare` (unused on rank 1) only at its first... none on rank 1."""
    for rank, res in enumerate(case_result(results, "loop_megabuf")):
        counted = res["turns"]
        assert counted[1:] == [6] * 6, (rank, counted)  # 3 iterations x (first, last)
        assert counted[0] == (6 if rank == 0 else 0), (rank, counted)
        assert res["reference_error"] < 1e-6, res


def test_without_overlap_python_runs_once_per_group_per_iteration(results: Any) -> None:
    for rank, res in enumerate(case_result(results, "loop_megabuf_sync")):
        assert res["turns"][1:] == [3] * 6, (rank, res)


def test_refusals_name_the_group_or_param_and_reset_recovers(results: Any) -> None:
    for rank, res in enumerate(case_result(results, "refusals")):
        span = r"a param of layers\.5\.\w+ \.\. layers\.5\.\w+ received a gradient after its"
        assert re.search(span + r" bucket group \d+ was dispatched", res["extra_True"]), res
        assert "received a gradient after its bucket group" in res["extra_False"], res
        assert res["after_diff"] == 0.0, res
        for counting in (True, False):
            got = res[f"create_graph_{counting}"]
            named = r"(layers\.\d|spare)\.\w+ got a grad that requires grad"
            assert re.search(named, got), (rank, got)


def test_counted_hooks_go_with_the_engine(results: Any) -> None:
    for rank, res in enumerate(case_result(results, "lifetime")):
        assert res == {"counted_groups": 7, "hooks_left": 0, "plain": True}, (rank, res)
