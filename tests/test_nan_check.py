"""[Note: NaN check] (megabuf/sync/nan_check.py): with check_for_nan_in_grad the flags stay on the
device while backward dispatches the buckets; one MAX all-reduce and one host read per
finish_grad_sync, whatever the number of buckets, and none from inside backward.

Pure tests use test_bucket_state's recording fake and a dispatch mode that sees every op that
reads a tensor on the host; the multi-process case runs the real engine on 2 gloo ranks with a
`Collectives` subclass that counts the agreement's all-reduces and where they were issued."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_bucket_state import RecordingCollectives, agree_on_nan, grad, make_chain
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import megabuf
from megabuf.config import DistributedDataParallelConfig as Config
from megabuf.transport.collectives import Collectives

# ops that copy a value to the host (Tensor.__bool__, .item(), nonzero's output size, ...)
HOST_READS = {"_local_scalar_dense", "is_nonzero", "item", "nonzero", "equal"}
CHECKED = Config(overlap_grad_reduce=True, check_for_nan_in_grad=True)


class HostReads(TorchDispatchMode):
    """Records the host-reading ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in HOST_READS:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads() -> Iterator[HostReads]:
    with HostReads() as mode:
        yield mode


@pytest.mark.parametrize("num_groups", [1, 4])
def test_backward_dispatch_reads_nothing_and_agreement_is_one_collective(num_groups: int) -> None:
    coll = RecordingCollectives(2, bad_peer_ranks=())
    chain, groups = make_chain(num_groups, coll, cfg=CHECKED, dp_size=2)
    for g in groups:  # first (learning) iteration, then a learned one
        grad(g, 0), grad(g, 1)
    chain.dispatch_rest()
    for g in groups:
        g.finish_grad_sync(), g.learn_arrivals(), g.reset()
    chain.reset()
    with host_reads() as mode:
        for g in groups:
            grad(g, 0)
            grad(g, 1, float("nan") if g is groups[-1] else 1.0)  # completes: dispatched here
    assert all(g.grad_state.name == "DISPATCHED" for g in groups)
    assert mode.ops == [] and coll.max_calls == 0, mode.ops  # nothing read, nothing agreed
    for g in groups:
        g.finish_grad_sync()
    with pytest.raises(RuntimeError, match=rf"bucket group {num_groups - 1}, params: "):
        agree_on_nan(coll, *groups)
    assert coll.max_calls == 1


def test_agreement_names_every_bad_bucket_and_peer_rank() -> None:
    coll = RecordingCollectives(2, bad_peer_ranks=(1,))  # the peer flags every bucket
    chain, groups = make_chain(3, coll, cfg=CHECKED, dp_size=2)
    for g in groups:
        grad(g, 0), grad(g, 1)
    chain.dispatch_rest()
    for g in groups:
        g.finish_grad_sync()
    with pytest.raises(RuntimeError) as err:
        agree_on_nan(coll, *groups)
    msg = str(err.value)
    for k in range(3):
        assert f"bucket group {k}, params: g{k}.p0, g{k}.p1) on rank(s) [101]" in msg, msg
    assert msg.endswith("This rank (5) has non-finite grads in: none"), msg
    assert coll.max_calls == 1


def test_flags_are_per_iteration() -> None:
    """A NaN of the last iteration is forgotten by zero_grad_buffer (reset)."""
    coll = RecordingCollectives(1)
    chain, (g,) = make_chain(1, coll, cfg=CHECKED)
    grad(g, 0, float("inf")), grad(g, 1)
    chain.dispatch_rest()
    g.finish_grad_sync()
    with pytest.raises(RuntimeError, match=r"grads in: g0\.p0$"):
        agree_on_nan(coll, g)
    g.reset(), chain.reset()
    grad(g, 0), grad(g, 1)
    chain.dispatch_rest()
    g.finish_grad_sync()
    agree_on_nan(coll, g)  # clean
    assert coll.max_calls == 2


# ---- real engine, 2 gloo ranks ------------------------------------------------------------------
class CountingCollectives(Collectives):
    """Counts all_reduce_max calls."""

    def __init__(self) -> None:
        super().__init__()
        self.max_calls = 0

    def all_reduce_max(self, tensor: Tensor, group: Any) -> None:
        self.max_calls += 1
        super().all_reduce_max(tensor, group)


def counting_case() -> dict[str, Any]:
    """Four buckets with overlap; iterations 0 (learning) and 1 clean, 2 with a NaN input on
    rank 1, 3 clean again. Backward leaves the sync to finish_grad_sync (deferred), so what the
    backward hooks issue and what the finish issues are counted apart."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, check_for_nan_in_grad=True, bucket_size=72
    )
    coll = CountingCollectives()
    model = megabuf.DistributedDataParallel(net, cfg, collectives=coll)
    out: dict[str, Any] = {"groups": len(model.engine.all_bucket_groups)}
    for it in range(4):
        model.zero_grad_buffer()
        x = torch.randn(3, 8)
        if it == 2 and dist.get_rank() == 1:
            x[0, 0] = float("nan")
        before = coll.max_calls
        with model.deferred_grad_sync():
            model(x).sum().backward()
        out[f"backward_calls{it}"] = coll.max_calls - before
        _finish(model, out, it)
        out[f"calls{it}"] = coll.max_calls - before
        out[f"unsynced{it}"] = (
            model.engine.sync.unsynced_group() is not None
        )  # grads dropped on error
    return out


@pytest.fixture(scope="module")
def counted(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(counting_case)


def test_one_agreement_per_finish_none_from_the_backward_hooks(
    counted: list[dict[str, Any]],
) -> None:
    for res in counted:
        assert res["groups"] == 4, res  # several buckets, one collective each sync
        for it in range(4):
            assert res[f"backward_calls{it}"] == 0 and res[f"calls{it}"] == 1, res
        # learned iterations: the backward hooks dispatched every group (flags taken there)
        assert res["dispatched0"] == 0 and res["dispatched1"] == res["dispatched2"] == 4, res


def test_nan_on_one_rank_raises_on_both_naming_rank_1(counted: list[dict[str, Any]]) -> None:
    """Every rank raises and drops the NaN grads (an optimizer step would refuse them); the next
    iteration is clean."""
    for rank, res in enumerate(counted):
        assert res["error0"] is res["error1"] is res["error3"] is None, res
        assert [res[f"unsynced{it}"] for it in range(4)] == [False, False, True, False], res
        msg = res["error2"]
        assert msg is not None and "NaN or Inf" in msg and "rank(s) [1]" in msg, msg
        mine = msg.split("grads in: ")[-1]
        assert ("0.weight" in mine) if rank == 1 else mine == "none", msg


# ---- GPU: no host synchronisation inside backward ----------------------------------------------
def cuda_backward_syncs_case() -> dict[str, Any]:
    """World 1 on NCCL: backward with the NaN check and overlap runs under
    `torch.cuda.set_sync_debug_mode("error")` (any host synchronisation raises); the third
    iteration's NaN is still reported by finish_grad_sync."""
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]).cuda()
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, check_for_nan_in_grad=True, bucket_size=64 * 65
    )
    model = megabuf.DistributedDataParallel(net, cfg)
    out: dict[str, Any] = {}
    for it in range(3):
        model.zero_grad_buffer()
        x = torch.randn(8, 64, device="cuda")
        if it == 2:
            x[0, 0] = float("nan")
        loss = model(x).sum()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with model.deferred_grad_sync():
                loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _finish(model, out, it)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for NCCL")
def test_cuda_backward_with_nan_check_never_synchronises(pools: Any) -> None:
    (res,) = pools(1, "nccl").run(cuda_backward_syncs_case)
    assert res["dispatched1"] == res["dispatched2"] == 4, res  # flags taken in the hooks
    assert res["error0"] is None and res["error1"] is None, res
    assert res["error2"] is not None and "rank(s) [0]" in res["error2"], res


def _finish(model: Any, out: dict[str, Any], it: int) -> None:
    """Record how many groups backward dispatched, then finish_grad_sync's error (or None)."""
    out[f"dispatched{it}"] = sum(
        g.grad_state.name == "DISPATCHED" for g in model.engine.all_bucket_groups
    )
    try:
        model.finish_grad_sync()
        out[f"error{it}"] = None
    except RuntimeError as exc:
        out[f"error{it}"] = str(exc)
