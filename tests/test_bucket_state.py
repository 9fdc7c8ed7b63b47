"""Pure state-machine tests of `BucketGroup` and `DispatchChain`: no process group.

Every collective goes through `RecordingCollectives`, which records the call and fakes it as if
`world_size` ranks held identical values (a sum multiplies by `world_size`, an average is the
identity), so numerics are checkable without torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from megabuf.buckets.bucket_group import BucketGroup, DispatchChain, GradSyncState, ParamSyncState
from megabuf.buckets.buffer import _ParamAndGradBucket
from megabuf.config import DistributedDataParallelConfig as Config
from megabuf.sync.hooks import make_grad_hook
from megabuf.sync.nan_check import raise_on_nonfinite_grads
from megabuf.transport.collective_backends import CollectiveStrategy
from megabuf.transport.collectives import Collectives, PendingCollective

RANK = 5  # global rank of every group built here; error messages must name it
IDLE, DISPATCHED, SYNCED = GradSyncState.IDLE, GradSyncState.DISPATCHED, GradSyncState.SYNCED
VALID, STALE = ParamSyncState.VALID, ParamSyncState.STALE
OVERLAP = Config(overlap_grad_reduce=True)
GATHER = Config(use_distributed_optimizer=True, overlap_param_gather=True)


@dataclass
class RecordedPending(PendingCollective):
    """A collective with no handles that counts how often it was waited for."""

    waits: int = 0

    def wait(self) -> None:
        self.waits += 1
        super().wait()


@dataclass
class Call:
    op: str
    data: Tensor  # the whole tensor the collective reads (a bucket's grad_data or param_data)
    snapshot: Tensor  # its values when the call was issued
    async_op: bool
    average: bool | None = None
    scale: float | None = None
    shard_start: int | None = None  # element offset of this rank's shard inside `data`
    scratch: Tensor | None = None
    tag: int | None = None
    pending: RecordedPending | None = None


def _offset(view: Tensor, base: Tensor) -> int:
    return (view.data_ptr() - base.data_ptr()) // base.element_size()


class RecordingCollectives(Collectives):
    def __init__(
        self,
        world_size: int = 1,
        *,
        has_avg: bool = False,
        reduce_scatter: str = "native",
        bad_peer_ranks: Sequence[int] = (),
    ) -> None:
        super().__init__()
        self.world_size = world_size
        self.fake_strategy = CollectiveStrategy(
            reduce_scatter=reduce_scatter,  # type: ignore[arg-type]
            all_gather="native",
            has_avg=has_avg,
        )
        self.bad_peer_ranks = tuple(bad_peer_ranks)  # flagged by the NaN check's MAX reduce
        self.calls: list[Call] = []
        self.max_calls = 0

    def strategy(self, group: Any, device: Any) -> CollectiveStrategy:
        return self.fake_strategy

    def global_rank(self, group: Any, group_rank: int) -> int:
        return 100 + group_rank

    def _sum(self, tensor: Tensor, op: Any) -> None:
        if op == dist.ReduceOp.SUM:  # identical ranks; AVG of identical values is the identity
            tensor.mul_(self.world_size)

    def _issue(self, call: Call, output: Tensor | None, divide: int, scale: float = 1.0) -> Any:
        call.pending = RecordedPending(call.op, [], output, None, divide, scale)
        self.calls.append(call)
        if not call.async_op:  # as Collectives does for a synchronous call
            call.pending.wait()
        return call.pending

    def all_reduce(
        self, tensor: Tensor, group: Any, *, average: bool = False, async_op: bool = True
    ) -> PendingCollective:
        call = Call("all_reduce", tensor, tensor.clone(), async_op, average=average)
        op, divide = self._avg_plan(tensor, self.world_size, average, self.fake_strategy.has_avg)
        self._sum(tensor, op)
        return self._issue(call, tensor, divide)

    def reduce_scatter(
        self,
        output: Tensor,
        input: Tensor,
        group: Any,
        *,
        average: bool = False,
        async_op: bool = True,
        scratch: Tensor | None = None,
        scale: float = 1.0,
    ) -> PendingCollective:
        call = Call(
            "reduce_scatter", input, input.clone(), async_op, average=average, scale=scale,
            shard_start=_offset(output, input), scratch=scratch,
        )  # fmt: skip
        op, divide = self._avg_plan(input, self.world_size, average, self.fake_strategy.has_avg)
        self._sum(output, op)
        return self._issue(call, output, divide, scale)

    def all_gather(
        self, output: Tensor, input: Tensor, group: Any, *, async_op: bool = True, tag: int = 0
    ) -> PendingCollective:
        call = Call(
            "all_gather", output, output.clone(), async_op, shard_start=_offset(input, output),
            tag=tag,
        )  # fmt: skip
        return self._issue(call, None, 1)

    def all_reduce_max(self, tensor: Tensor, group: Any) -> None:
        self.max_calls += 1
        for r in self.bad_peer_ranks:
            tensor[:, r] = 1.0


@pytest.fixture(autouse=True)
def _no_process_group() -> Iterator[None]:
    yield
    assert not (dist.is_available() and dist.is_initialized())


def make_group(
    numels: Sequence[int] = (2, 2),
    *,
    cfg: Config | None = None,
    coll: Collectives | None = None,
    group_id: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    dtype: torch.dtype = torch.float32,
    factor: float = 1.0,
    chain: DispatchChain | None = None,
    stale: float = 0.0,
) -> BucketGroup:
    """One bucket over fresh params; main_grad views hold `stale` (lazy zeroing), padding 0."""
    cfg = cfg or Config()
    params = [nn.Parameter(torch.zeros(n)) for n in numels]
    numel_unpadded = sum(numels)
    numel = -(-numel_unpadded // dp_size) * dp_size
    grad_data = torch.zeros(numel, dtype=dtype)  # 1-D, grad dtype, padded numel
    grad_data[:numel_unpadded] = stale
    param_data = torch.zeros(numel) if cfg.use_distributed_optimizer else None
    start = 0
    for p in params:
        p.main_grad = grad_data[start : start + p.numel()]  # type: ignore[attr-defined]
        if param_data is not None:
            p.data = param_data[start : start + p.numel()]
        start += p.numel()
    bucket = _ParamAndGradBucket(params, param_data, grad_data, 0, numel_unpadded, factor, 0)
    return BucketGroup(
        [bucket], cfg, None, coll or RecordingCollectives(dp_size), group_id=group_id,
        dp_rank=dp_rank, dp_size=dp_size, rank=RANK,
        param_to_name={p: f"g{group_id}.p{i}" for i, p in enumerate(params)}, chain=chain,
    )  # fmt: skip


def grad(group: BucketGroup, i: int, value: float = 1.0) -> None:
    """One backward's gradient for param `i` of `group`, through the real backward hook."""
    param = group.params_list[i]
    param.grad = torch.full_like(param, value)
    main_grad = param.main_grad  # type: ignore[attr-defined]
    hook = make_grad_hook(main_grad, group, i, False, on_grad=lambda: None, in_backward=[False])
    hook(param)


def make_chain(
    n: int, coll: RecordingCollectives, cfg: Config = OVERLAP, order: Sequence[int] | None = None,
    **kw: Any,
) -> tuple[DispatchChain, list[BucketGroup]]:  # fmt: skip
    chain = DispatchChain()
    groups = [make_group(cfg=cfg, coll=coll, group_id=k, chain=chain, **kw) for k in range(n)]
    chain.set_order([groups[k] for k in order] if order is not None else groups)
    return chain, groups


def finish_iteration(chain: DispatchChain) -> None:
    """What DistributedDataParallel.finish_grad_sync does with one chain."""
    chain.dispatch_rest()
    for g in chain.groups:
        g.finish_grad_sync()
    for g in chain.groups:
        g.learn_arrivals()


def zero_grad_buffer(chain: DispatchChain) -> None:
    for g in chain.groups:
        g.reset()
    chain.reset()


def learned_chain(
    n: int, coll: RecordingCollectives, **kw: Any
) -> tuple[DispatchChain, list[BucketGroup]]:
    """A chain after its learning iteration (one grad per param), calls cleared."""
    chain, groups = make_chain(n, coll, **kw)
    for g in groups:
        for i in range(len(g.params_list)):
            grad(g, i)
    finish_iteration(chain)
    zero_grad_buffer(chain)
    coll.calls.clear()
    return chain, groups


def dispatched(coll: RecordingCollectives, groups: Sequence[BucketGroup]) -> list[int]:
    owner = {id(b.grad_data): g.group_id for g in groups for b in g.buckets}
    return [owner[id(c.data)] for c in coll.calls]


# ---- grad lifecycle ---------------------------------------------------------------------------
def test_grad_lifecycle_idle_dispatched_synced_reset() -> None:
    coll = RecordingCollectives()
    g = make_group(coll=coll)
    assert g.grad_state is IDLE
    g.start_grad_sync()
    assert g.grad_state is DISPATCHED and len(coll.calls) == 1
    g.finish_grad_sync()
    assert g.grad_state is SYNCED
    g.finish_grad_sync()  # already synced: no second collective
    assert len(coll.calls) == 1
    g.reset()
    assert g.grad_state is IDLE
    g.finish_grad_sync()  # from IDLE: dispatches first
    assert g.grad_state is SYNCED and len(coll.calls) == 2


@pytest.mark.parametrize("overlap", [False, True])
def test_async_op_follows_overlap_and_finish_waits(overlap: bool) -> None:
    coll = RecordingCollectives()
    g = make_group(cfg=Config(overlap_grad_reduce=overlap), coll=coll)
    g.start_grad_sync()
    (call,) = coll.calls
    assert call.async_op is overlap and call.pending is not None
    assert (call.pending.waits == 0) is overlap  # a synchronous call is finished at once
    g.finish_grad_sync()
    assert call.pending.waits >= 1


@pytest.mark.parametrize("state", ["DISPATCHED", "SYNCED"])
def test_expect_guard_names_both_states_and_rank(state: str) -> None:
    g = make_group(group_id=3)
    g.start_grad_sync()
    if state == "SYNCED":
        g.finish_grad_sync()
    wanted = rf"group 3 grad sync is {state}, expected IDLE \(rank {RANK}\)"
    with pytest.raises(RuntimeError, match=wanted):
        g.start_grad_sync()
    assert g.grad_state.name == state
    other = "IDLE or SYNCED" if state == "DISPATCHED" else "IDLE or DISPATCHED"
    with pytest.raises(RuntimeError, match=rf"is {state}, expected {other} \(rank {RANK}\)"):
        g.readiness.expect(*(GradSyncState[s] for s in other.split(" or ")))


def test_reset_while_dispatched_raises() -> None:
    g = make_group(cfg=OVERLAP, group_id=2)
    g.start_grad_sync()
    wanted = rf"group 2 was reset while .* in flight \(rank {RANK}\)"
    with pytest.raises(RuntimeError, match=wanted):
        g.reset()
    assert g.grad_state is DISPATCHED
    g.finish_grad_sync()
    g.reset()
    assert g.grad_state is IDLE


# ---- param lifecycle --------------------------------------------------------------------------
def test_param_lifecycle_valid_stale_dispatched_valid() -> None:
    coll = RecordingCollectives(2)
    g = make_group((3, 2), cfg=GATHER, coll=coll, group_id=4, dp_rank=1, dp_size=2)
    assert g.param_state is VALID
    g.mark_params_stale()
    assert g.param_state is STALE and coll.calls == []
    g.start_param_sync()
    assert g.param_state is ParamSyncState.DISPATCHED
    (call,) = coll.calls
    assert (call.op, call.async_op, call.tag) == ("all_gather", True, 4)
    assert call.data is g.buckets[0].param_data and call.shard_start == 3  # rank 1 of 6 padded
    assert call.pending is not None and call.pending.waits == 0
    g.finish_param_sync()
    assert g.param_state is VALID and call.pending.waits == 1


def test_mark_params_stale_while_dispatched_raises() -> None:
    g = make_group(cfg=GATHER, group_id=4)
    g.mark_params_stale()
    g.start_param_sync()
    wanted = rf"group 4 param sync is DISPATCHED, expected VALID \(rank {RANK}\)"
    with pytest.raises(RuntimeError, match=wanted):
        g.mark_params_stale()
    assert g.param_state is ParamSyncState.DISPATCHED


def test_start_param_sync_noop_when_valid_or_dispatched() -> None:
    coll = RecordingCollectives()
    g = make_group(cfg=GATHER, coll=coll)
    g.start_param_sync()  # VALID
    assert coll.calls == [] and g.param_state is VALID
    g.mark_params_stale()
    g.start_param_sync()
    g.start_param_sync()  # already DISPATCHED
    assert len(coll.calls) == 1 and g.param_state is ParamSyncState.DISPATCHED


@pytest.mark.parametrize("skip", [False, True])
def test_finish_param_sync_prefetches_next_group(skip: bool) -> None:
    coll = RecordingCollectives()
    g0, g1 = (make_group(cfg=GATHER, coll=coll, group_id=k) for k in range(2))
    g0.set_next_param_gather(g1)
    g0.mark_params_stale()
    g1.mark_params_stale()
    g0.finish_param_sync(skip_next_bucket_dispatch=skip)  # STALE: gathers itself first
    assert g0.param_state is VALID
    assert [c.tag for c in coll.calls] == ([0] if skip else [0, 1])
    assert g1.param_state is (STALE if skip else ParamSyncState.DISPATCHED)


def test_sync_param_gather_finishes_at_once_without_prefetch() -> None:
    coll = RecordingCollectives()
    cfg = Config(use_distributed_optimizer=True)  # overlap_param_gather off
    g0, g1 = (make_group(cfg=cfg, coll=coll, group_id=k) for k in range(2))
    g0.set_next_param_gather(g1)
    g0.mark_params_stale()
    g1.mark_params_stale()
    g0.start_param_sync()
    assert g0.param_state is VALID and g1.param_state is STALE
    assert [(c.tag, c.async_op) for c in coll.calls] == [(0, False)]


# ---- dispatch chain ---------------------------------------------------------------------------
def test_chain_dispatches_in_chain_order_when_ready_out_of_order() -> None:
    coll = RecordingCollectives()
    _, groups = learned_chain(3, coll, order=[2, 0, 1])
    grad(groups[1], 0)
    grad(groups[1], 1)
    grad(groups[0], 0)
    grad(groups[0], 1)
    assert groups[0].all_ready and groups[1].all_ready and coll.calls == []  # head 2 not ready
    assert [g.grad_state for g in groups] == [IDLE] * 3
    grad(groups[2], 0)
    grad(groups[2], 1)
    assert dispatched(coll, groups) == [2, 0, 1]
    assert [g.grad_state for g in groups] == [DISPATCHED] * 3


def test_dispatch_rest_dispatches_remaining_in_order_ready_or_not() -> None:
    coll = RecordingCollectives()
    chain, groups = learned_chain(3, coll, order=[2, 0, 1])
    grad(groups[2], 0)
    grad(groups[2], 1)  # head ready: dispatched by on_ready
    grad(groups[1], 0)  # group 1 half written, group 0 not at all
    assert dispatched(coll, groups) == [2]
    chain.dispatch_rest()
    assert dispatched(coll, groups) == [2, 0, 1] and chain.next_index == 3
    assert groups[0].unused_indices == (0, 1) and groups[1].unused_indices == (1,)
    chain.dispatch_rest()  # nothing left
    assert len(coll.calls) == 3


def test_set_order_rejects_foreign_group() -> None:
    chain = DispatchChain()
    mine = make_group(chain=chain)
    foreign = make_group(chain=DispatchChain(), group_id=1)
    with pytest.raises(ValueError, match="own groups once"):
        chain.set_order([mine, foreign])
    with pytest.raises(ValueError, match="own groups once"):
        chain.set_order([make_group(group_id=2)])  # no chain at all
    assert chain.groups == []


def test_set_order_rejects_duplicate_group() -> None:
    chain = DispatchChain()
    g = make_group(chain=chain)
    with pytest.raises(ValueError, match="own groups once"):
        chain.set_order([g, g])
    assert chain.groups == []


def test_set_order_rejects_second_call() -> None:
    chain = DispatchChain()
    g0, g1 = (make_group(chain=chain, group_id=k) for k in range(2))
    chain.set_order([g1, g0])
    with pytest.raises(RuntimeError, match="called twice"):
        chain.set_order([g0, g1])
    assert chain.groups == [g1, g0]


def test_set_order_rejects_second_call_after_empty_order() -> None:
    chain = DispatchChain()
    g = make_group(chain=chain)
    chain.set_order([])
    with pytest.raises(RuntimeError, match="called twice"):
        chain.set_order([g])


# ---- learned grad arrivals ([Note: grad readiness]) --------------------------------------------
def test_learning_iteration_dispatches_nothing_during_backward() -> None:
    coll = RecordingCollectives()
    chain, groups = make_chain(2, coll)
    for g in groups:
        grad(g, 0)
        grad(g, 1)
    assert coll.calls == [] and not any(g.all_ready or g.readiness.learned for g in groups)
    assert [g.grad_state for g in groups] == [IDLE, IDLE]
    finish_iteration(chain)
    assert dispatched(coll, groups) == [0, 1] and all(g.readiness.learned for g in groups)


def test_learn_arrivals_counts_at_least_one() -> None:
    coll = RecordingCollectives()
    chain, (g,) = make_chain(1, coll, numels=(2, 2, 2))
    grad(g, 0)
    grad(g, 0)
    grad(g, 1)  # param 2 gets nothing in the learning iteration
    finish_iteration(chain)
    assert g.readiness.expected == [2, 1, 1]
    zero_grad_buffer(chain)
    grad(g, 0)
    grad(g, 1)
    grad(g, 2)
    g.learn_arrivals()  # learned once: later iterations do not relearn
    assert g.readiness.expected == [2, 1, 1]


def test_learn_arrivals_needs_overlap() -> None:
    coll = RecordingCollectives()
    chain, (g,) = make_chain(1, coll, cfg=Config())
    grad(g, 0)
    finish_iteration(chain)
    assert not g.readiness.learned and not g.all_ready


def test_param_with_two_arrivals_readies_group_after_second() -> None:
    coll = RecordingCollectives()
    chain, (g,) = make_chain(1, coll)
    grad(g, 0)
    grad(g, 0)
    grad(g, 1)
    finish_iteration(chain)
    zero_grad_buffer(chain)
    coll.calls.clear()
    grad(g, 0)
    grad(g, 1)
    assert not g.all_ready and coll.calls == []
    grad(g, 0)
    assert g.grad_state is DISPATCHED
    (call,) = coll.calls
    assert call.async_op and call.snapshot.tolist() == [2.0, 2.0, 1.0, 1.0]


def test_grad_after_dispatch_raises_mentioning_no_sync() -> None:
    coll = RecordingCollectives()
    _, (g,) = learned_chain(1, coll)
    grad(g, 0)
    grad(g, 1)
    assert g.grad_state is DISPATCHED
    wanted = rf"g0.p1 .* after .* group 0 was dispatched \(rank {RANK}\)"
    with pytest.raises(RuntimeError, match=wanted):
        grad(g, 1)
    try:
        grad(g, 0)
    except RuntimeError as exc:
        assert "no_sync()" in str(exc)
    else:
        pytest.fail("a grad after dispatch was accepted")


def test_no_sync_arrivals_do_not_count() -> None:
    coll = RecordingCollectives()
    _, (g,) = learned_chain(1, coll)
    g.is_last_microbatch = False
    grad(g, 0)
    grad(g, 1)
    assert not g.all_ready and coll.calls == [] and g.grad_state is IDLE
    g.is_last_microbatch = True
    grad(g, 0)
    assert not g.all_ready
    grad(g, 1)
    (call,) = coll.calls
    assert call.snapshot.tolist() == [2.0] * 4  # both micro-batches reduced together


def test_no_sync_arrivals_are_not_learned() -> None:
    coll = RecordingCollectives()
    chain, (g,) = make_chain(1, coll)
    g.is_last_microbatch = False
    grad(g, 0)
    grad(g, 0)
    g.is_last_microbatch = True
    grad(g, 0)
    grad(g, 1)
    finish_iteration(chain)
    assert g.readiness.expected == [1, 1]


# ---- missing grads ----------------------------------------------------------------------------
def test_unwritten_grads_zero_filled_at_dispatch_written_kept() -> None:
    coll = RecordingCollectives()
    g = make_group((2, 3, 2), coll=coll, stale=7.0)
    grad(g, 0, 1.5)
    grad(g, 2, -2.0)
    assert g.params_list[1].main_grad.eq(7.0).all()  # type: ignore[attr-defined]
    g.start_grad_sync()
    assert g.unused_indices == (1,)
    (call,) = coll.calls  # zero-filled before the collective was issued
    assert call.snapshot.tolist() == [1.5, 1.5, 0.0, 0.0, 0.0, -2.0, -2.0]


def test_mark_written_true_only_first_time_after_reset() -> None:
    g = make_group((2, 2), stale=7.0)
    assert g.mark_written(0) is True
    assert g.mark_written(0) is False
    g.reset()
    grad(g, 0, 1.0)  # first grad overwrites the stale value
    grad(g, 0, 2.0)  # later ones add
    assert g.params_list[0].main_grad.tolist() == [3.0, 3.0]  # type: ignore[attr-defined]
    g.finish_grad_sync()
    assert g.mark_written(1) is False  # zero-filled at dispatch: no longer fresh
    g.reset()
    assert g.mark_written(0) is True and g.mark_written(1) is True


# ---- scaling ----------------------------------------------------------------------------------
def test_all_reduce_prescales_by_gradient_scaling_factor() -> None:
    coll = RecordingCollectives(2)
    g = make_group((2, 2), coll=coll, dp_size=2, factor=0.5)
    grad(g, 0, 3.0)
    grad(g, 1, 5.0)
    g.finish_grad_sync()
    (call,) = coll.calls
    assert (call.op, call.average) == ("all_reduce", False)
    assert call.snapshot.tolist() == [1.5, 1.5, 2.5, 2.5]
    assert g.buckets[0].grad_data.tolist() == [3.0, 3.0, 5.0, 5.0]  # mean of 2 equal ranks


@pytest.mark.parametrize(
    "dtype, prescaled",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float16, True)],
    ids=["fp32", "bf16", "fp16"],
)
def test_reduce_scatter_scales_shard_only_except_fp16(dtype: torch.dtype, prescaled: bool) -> None:
    coll = RecordingCollectives(2)
    cfg = Config(use_distributed_optimizer=True)
    g = make_group((2, 2), cfg=cfg, coll=coll, dp_rank=1, dp_size=2, dtype=dtype, factor=0.5)
    grad(g, 0, 3.0)
    grad(g, 1, 5.0)
    g.finish_grad_sync()
    (call,) = coll.calls
    assert (call.op, call.average, call.shard_start) == ("reduce_scatter", False, 2)
    assert call.scale == (1.0 if prescaled else 0.5)
    assert call.snapshot.tolist() == ([1.5, 1.5, 2.5, 2.5] if prescaled else [3, 3, 5, 5])
    data = g.buckets[0].grad_data.tolist()
    assert data[2:] == [5.0, 5.0]  # this rank's shard: the mean over ranks
    assert data[:2] == ([1.5, 1.5] if prescaled else [3.0, 3.0])  # other shard: not scaled


@pytest.mark.parametrize("distopt", [False, True], ids=["all_reduce", "reduce_scatter"])
def test_average_in_collective_is_forwarded(distopt: bool) -> None:
    coll = RecordingCollectives(2)
    cfg = Config(average_in_collective=True, use_distributed_optimizer=distopt)
    g = make_group((2, 2), cfg=cfg, coll=coll, dp_size=2)
    grad(g, 0, 3.0)
    grad(g, 1, 5.0)
    g.finish_grad_sync()
    (call,) = coll.calls
    assert call.op == ("reduce_scatter" if distopt else "all_reduce") and call.average is True
    assert call.scale in (None, 1.0)
    assert g.buckets[0].grad_data.tolist() == [3.0, 3.0, 5.0, 5.0]


@pytest.mark.parametrize("strategy", ["all_to_all", "native"])
def test_reduce_scatter_scratch_kept_across_iterations(strategy: str) -> None:
    coll = RecordingCollectives(2, reduce_scatter=strategy)
    g = make_group(cfg=Config(use_distributed_optimizer=True), coll=coll, dp_size=2)
    g.finish_grad_sync()
    scratch = g.buckets[0].scratch
    g.reset()
    g.finish_grad_sync()
    assert [c.scratch for c in coll.calls] == [scratch, scratch]
    if strategy == "native":
        assert scratch is None
    else:
        assert scratch is not None and scratch.shape == g.buckets[0].grad_data.shape


# ---- NaN check ([Note: NaN check]) ------------------------------------------------------------
def agree_on_nan(coll: RecordingCollectives, *groups: BucketGroup, dp_rank: int = 0) -> None:
    """What DistributedDataParallel.finish_grad_sync does after the reductions."""
    raise_on_nonfinite_grads(
        groups, coll, None, dp_rank=dp_rank, dp_size=groups[0].dp_size, rank=RANK
    )


def test_nan_check_names_global_ranks_and_local_params() -> None:
    coll = RecordingCollectives(4, bad_peer_ranks=(2,))
    cfg = Config(check_for_nan_in_grad=True)
    g = make_group((2, 2, 2), cfg=cfg, coll=coll, dp_rank=1, dp_size=4)
    grad(g, 0)
    grad(g, 1, float("inf"))
    g.start_grad_sync()  # flags recorded on the device, nothing agreed on yet
    assert coll.max_calls == 0 and len(coll.calls) == 1
    g.finish_grad_sync()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[101, 102\].*grads in: g0.p1$"):
        agree_on_nan(coll, g, dp_rank=1)
    assert coll.max_calls == 1 and g.grad_state is IDLE  # the NaN grads are dropped


def test_nan_check_ignores_stale_values_of_unwritten_grads() -> None:
    coll = RecordingCollectives(2)
    g = make_group(cfg=Config(check_for_nan_in_grad=True), coll=coll, dp_size=2)
    g.buckets[0].grad_data[:2] = float("nan")  # param 0 is stale NaN, never written
    grad(g, 1)
    g.start_grad_sync()  # zero-filled before the flags are taken
    g.finish_grad_sync()
    agree_on_nan(coll, g)
    assert coll.max_calls == 1 and g.unused_indices == (0,) and len(coll.calls) == 1


# ---- abandon and accumulation after sync ------------------------------------------------------
def test_abandon_grad_sync_waits_and_returns_to_idle() -> None:
    coll = RecordingCollectives()
    chain, (g,) = learned_chain(1, coll)
    grad(g, 0)
    grad(g, 1)
    (call,) = coll.calls
    assert call.pending is not None and call.pending.waits == 0
    g.abandon_grad_sync()
    assert call.pending.waits == 1 and g.grad_state is IDLE and not g.all_ready
    assert g.mark_written(0) is True  # nothing counts as written any more
    chain.reset()
    grad(g, 1)
    assert len(coll.calls) == 1  # readiness restarted from zero
    grad(g, 0)
    assert len(coll.calls) == 2 and g.grad_state is DISPATCHED


def test_grad_after_synced_clears_chain_readiness_and_accumulates() -> None:
    coll = RecordingCollectives(2)
    chain, groups = learned_chain(2, coll, numels=(2,), dp_size=2, factor=0.5)
    grad(groups[0], 0, 1.0)
    grad(groups[1], 0, 10.0)
    finish_iteration(chain)
    assert [g.grad_state for g in groups] == [SYNCED, SYNCED]
    grad(groups[1], 0, 2.0)  # a second backward without zero_grad_buffer()
    assert [g.grad_state for g in groups] == [IDLE, IDLE] and chain.next_index == 0
    assert groups[1].all_ready and not groups[0].all_ready and len(coll.calls) == 2
    grad(groups[0], 0, 3.0)
    assert dispatched(coll, groups) == [0, 1, 0, 1]
    finish_iteration(chain)
    assert groups[0].buckets[0].grad_data.tolist() == [4.0, 4.0]
    assert groups[1].buckets[0].grad_data.tolist() == [12.0, 12.0]


def test_grad_after_synced_with_distributed_optimizer_raises() -> None:
    coll = RecordingCollectives(2)
    cfg = Config(overlap_grad_reduce=True, use_distributed_optimizer=True)
    chain, (g,) = learned_chain(1, coll, cfg=cfg, dp_size=2)
    grad(g, 0)
    grad(g, 1)
    finish_iteration(chain)
    wanted = rf"without zero_grad_buffer\(\) \(rank {RANK}, g0.p1\).*use_distributed_optimizer"
    with pytest.raises(RuntimeError, match=wanted):
        grad(g, 1)
    assert g.grad_state is SYNCED


def test_grad_after_synced_with_expert_group_in_chain_raises() -> None:
    coll = RecordingCollectives(2)
    chain = DispatchChain()
    dense = make_group(coll=coll, chain=chain, dp_size=2, factor=0.5)
    expert = make_group(coll=coll, chain=chain, group_id=1, dp_size=2, factor=0.25)  # ep 2
    chain.set_order([dense, expert])
    finish_iteration(chain)
    with pytest.raises(RuntimeError, match="does not map already-reduced grads"):
        grad(dense, 0)
    assert dense.grad_state is SYNCED and expert.grad_state is SYNCED


# ---- Collectives._avg_plan --------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, size, average, native, op, divide, divided_in_place",
    [
        (torch.float32, 4, False, True, "SUM", 1, False),
        (torch.float32, 1, True, True, "SUM", 1, False),
        (torch.float16, 1, True, False, "SUM", 1, False),
        (torch.float32, 4, True, True, "AVG", 1, False),
        (torch.float16, 4, True, True, "AVG", 1, False),
        (torch.float16, 4, True, False, "SUM", 1, True),
        (torch.float32, 4, True, False, "SUM", 4, False),
        (torch.bfloat16, 4, True, False, "SUM", 4, False),
    ],
    ids=[
        "sum", "size1-native", "size1-fp16", "native-avg", "native-avg-fp16",
        "fp16-divided-before", "fp32-divided-after", "bf16-divided-after",
    ],
)  # fmt: skip
def test_avg_plan(
    dtype: torch.dtype,
    size: int,
    average: bool,
    native: bool,
    op: str,
    divide: int,
    divided_in_place: bool,
) -> None:
    t = torch.full((3,), 8.0, dtype=dtype)
    got_op, got_divide = Collectives._avg_plan(t, size, average, native)
    assert got_op == getattr(dist.ReduceOp, op) and got_divide == divide
    assert t.tolist() == ([2.0] * 3 if divided_in_place else [8.0] * 3)
