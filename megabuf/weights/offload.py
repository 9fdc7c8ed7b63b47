"""`offload` / `restore`: an engine gets out of the device's way and comes back bitwise intact.

[Note: what offload releases]
For every model chunk: the grad memory (the contiguous `grad_data`, or under optim_grads* the
grad shards and any full bucket holding grads; exposed `.grad` tensors; "grad_scratch": gloo's
reduce-scatter landing zones, never kept), the param memory (`param_data`, or under
optim_grads_params the param shards, after every unit's full params were released; under
no_shard the params' own storages; an FP8 param's bytes and scale, its fp32 master counted as
main_params, with or without the optimizer) and the module's buffers; with the optimizer: its
fp32 main params (those that are copies; fp32 main params that *are* `param_data` views were
counted as params) and every state tensor on the device. Released bytes per category are
`OffloadReport.released_nbytes`; tests check them against the layout (`tests/weights_cases.py`).
Storages are released in place ([Note: release in place] in stash.py); exposed `.grad` tensors
are detached from their params meanwhile, so a backward run while offloaded creates new ones
instead of adding into released memory (it then raises at the param's grad hook), and are put
back on restore. With `keep_grads=True` the grads are copied to the host and restored bitwise
(offload between micro-batches); without, they are dropped, `restore` zero-fills them and starts
a new iteration (`zero_grad_buffer()`): the next step needs a new backward, which the optimizer
checks. Before releasing anything, gathers in flight are waited for (`publish_params()`; under
optim_grads_params `reshard_params()`); a grad reduction in flight, or a micro-batch reduction
still owed, is refused by name: finish the grad sync first. The engine's ledger drops by the
bytes it tracks (`SHARDED_CATEGORIES`), and records the host copies as "offloaded_host".
While offloaded every entry point raises `EngineOffloadedError` ([Note: offloaded engine] in
megabuf/sync/residency.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megabuf.buckets.bucket_group import GradSyncState
from megabuf.ddp import DistributedDataParallel, as_model_chunks
from megabuf.fp8 import broadcast_tensors
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.sync.grad_sync import SyncPhase
from megabuf.weights.stash import StorageStash

SHARDED_CATEGORIES = (
    "param_shard", "unsharded_params", "verify_param_access", "grad_shard", "grad_buckets",
    "grad_scratch",
)  # fmt: skip
"""The ledger categories whose storages offload releases (the others stay, e.g. comm hooks')."""
HOST_CATEGORY = "offloaded_host"
CATEGORIES = ("grads", "grad_scratch", "params", "module_buffers", "main_params", "optimizer_state")


@dataclass(frozen=True)
class OffloadReport:
    """What one `offload` released on this rank, in bytes."""

    released_nbytes: dict[str, int]  # per category of CATEGORIES (all present)
    host_nbytes: int  # copies kept on the host (everything released but dropped grads)

    @property
    def total_nbytes(self) -> int:
        return sum(self.released_nbytes.values())


@dataclass
class Offloaded:
    """The offload in force on `chunks` (held by each chunk's `Residency`)."""

    chunks: list[DistributedDataParallel]
    optimizer: MegabufOptimizer | None
    keep_grads: bool
    stash: StorageStash
    ledger_freed: list[dict[str, int]] = field(default_factory=list)  # per chunk
    # exposed `.grad` tensors, detached from their params while offloaded
    grads: list[tuple[torch.nn.Parameter, Tensor]] = field(default_factory=list)


def offload(
    model_or_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
    optimizer: MegabufOptimizer | None = None,
    *,
    keep_grads: bool = False,
) -> OffloadReport:
    """Release every device storage of `model_or_chunks` (and of `optimizer`'s main params and
    state); see [Note: what offload releases]. Not collective. Returns the bytes released."""
    chunks = as_model_chunks(model_or_chunks, "megabuf.weights.offload")
    _check_can_offload(chunks, optimizer)
    for chunk in chunks:
        chunk.engine.param_side.publish()  # gathers in flight land first ([Note: who waits ...])
        chunk.engine.param_side.reshard()
    stash = StorageStash(_device(chunks))
    for category, tensors, keep in _collect(chunks, optimizer, keep_grads):
        stash.add(category, tensors, keep=keep)
    with torch.profiler.record_function("megabuf::offload"):
        stash.release()
    record = Offloaded(chunks, optimizer, keep_grads, stash)
    for chunk in chunks:  # autograd's AccumulateGrad must not write into a released `.grad`
        for param in chunk.module.parameters():
            if param.grad is not None:
                record.grads.append((param, param.grad))
                param.grad = None
    for chunk in chunks:
        ledger = chunk.engine.memory_ledger
        freed = {c: ledger.now(c) for c in SHARDED_CATEGORIES if ledger.now(c) > 0}
        for category, nbytes in freed.items():
            ledger.free(category, nbytes)
        record.ledger_freed.append(freed)
        chunk.engine.offload(record)  # [Note: offloaded engine]
    chunks[0].engine.memory_ledger.alloc(HOST_CATEGORY, stash.host_nbytes)
    released = {c: 0 for c in CATEGORIES} | stash.nbytes()
    return OffloadReport(released, stash.host_nbytes)


def restore(
    model_or_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
    optimizer: MegabufOptimizer | None = None,
) -> None:
    """Undo `offload`: the same storages, refilled (bitwise; dropped grads as zeros, and then
    a new iteration starts). `model_or_chunks` must be what was offloaded; `optimizer`, if
    given, the optimizer offloaded with it (restored in any case). Not collective."""
    chunks = as_model_chunks(model_or_chunks, "megabuf.weights.restore")
    record = chunks[0].engine.offloaded
    if not isinstance(record, Offloaded):
        raise RuntimeError(
            f"megabuf: restore() on rank {chunks[0].engine.rank}: the model is not offloaded "
            "(offload it with megabuf.weights.offload, or skip the restore)"
        )
    if [id(c) for c in record.chunks] != [id(c) for c in chunks]:
        raise ValueError(
            f"megabuf: restore() got {len(chunks)} model chunk(s), not the {len(record.chunks)} "
            "offloaded together; pass the same model / list of chunks as to offload()"
        )
    if optimizer is not None and optimizer is not record.optimizer:
        raise ValueError(
            "megabuf: restore() got an optimizer that was not offloaded with this model; pass "
            "the one given to offload(), or none (it is restored with the model)"
        )
    with torch.profiler.record_function("megabuf::restore"):
        record.stash.restore()
    for param, grad in record.grads:
        param.grad = grad
    chunks[0].engine.memory_ledger.free(HOST_CATEGORY, record.stash.host_nbytes)
    for chunk, freed in zip(chunks, record.ledger_freed, strict=True):
        for category, nbytes in freed.items():
            chunk.engine.memory_ledger.alloc(category, nbytes)
        chunk.engine.restore()
    if not record.keep_grads:
        for chunk in chunks:
            chunk.zero_grad_buffer()


def is_offloaded(model: DistributedDataParallel) -> bool:
    return model.engine.offloaded is not None


def _check_can_offload(
    chunks: list[DistributedDataParallel], optimizer: MegabufOptimizer | None
) -> None:
    """Refuse what cannot be released now, by name (nothing is released yet)."""
    for i, chunk in enumerate(chunks):
        chunk.engine.check_resident(f"offload() of model chunk {i}")
        for group in chunk.engine.all_bucket_groups:
            if group.grad_state is GradSyncState.DISPATCHED:
                raise RuntimeError(
                    f"megabuf: offload() on rank {chunk.engine.rank}: model chunk {i}, bucket "
                    f"group {group.group_id} has a grad reduction in flight; call "
                    "model.finish_grad_sync() (or let backward finish it) before offloading"
                )
        if chunk.engine.sync.phase is SyncPhase.MICROBATCH_OWED:
            raise RuntimeError(
                f"megabuf: offload() on rank {chunk.engine.rank}: model chunk {i} owes a "
                "micro-batch reduction (reduce_each_microbatch inside no_sync()); call "
                "model.finish_microbatch() before offloading"
            )
    if optimizer is not None:
        mine = {id(c) for c in chunks}
        if {id(c) for c in optimizer.model_chunks} != mine:
            raise ValueError(
                "megabuf: offload() got an optimizer over other model chunks than the ones "
                "given; offload the optimizer with exactly the chunks it steps"
            )


def _device(chunks: list[DistributedDataParallel]) -> torch.device:
    devices = {p.device for c in chunks for p in c.module.parameters()}
    if len(devices) != 1:
        raise ValueError(f"megabuf: offload() needs every param on one device, got {devices}")
    return devices.pop()


def _collect(
    chunks: list[DistributedDataParallel], optimizer: MegabufOptimizer | None, keep_grads: bool
) -> Iterator[tuple[str, list[Tensor | None], bool]]:
    """(category, tensors, keep) in counting order; see [Note: what offload releases]."""
    for chunk in chunks:
        buffers = chunk.engine.buffers
        buckets = [b for buf in buffers for b in buf.buckets]
        grads: list[Tensor | None] = [b.grad_data for b in buckets]
        grads += [b.grad_shard for b in buckets]
        grads += [p.grad for p in chunk.module.parameters()]
        yield "grads", grads, keep_grads
        scratch: list[Tensor | None] = [b.scratch for b in buckets]
        for group in chunk.engine.all_bucket_groups:  # [Note: grad storage]: full ones keep none
            scratch += group.grads.scratch
        yield "grad_scratch", scratch, False  # landing zones: contents never outlive a reduction
        params: list[Tensor | None] = [b.param_data for b in buckets]
        params += [b.param_shard for b in buckets]
        # an FP8 param: its bytes and scale ([Note: FP8 params]); else its data
        params += [t for p in chunk.module.parameters() for t in broadcast_tensors(p)]
        yield "params", params, True
        masters: list[Tensor | None] = [
            m for buf in buffers if buf.fp8 is not None for m in buf.fp8.masters
        ]
        yield "main_params", masters, True  # FP8 params' fp32 masters (the buffer's)
        yield "module_buffers", list(chunk.module.buffers()), True
    if optimizer is None:
        return
    mains = optimizer.main_params
    yield "main_params", [mp.main for mp in mains], True
    yield "grads", [mp.main.grad for mp in mains], keep_grads
    state: list[Tensor | None] = [
        value
        for domain in optimizer.domains
        for per_param in domain.optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, Tensor)
    ]
    yield "optimizer_state", state, True
