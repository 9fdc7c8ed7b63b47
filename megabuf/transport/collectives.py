"""Every torch.distributed call megabuf makes, as thin typed wrappers.

Each wrapper takes an explicit group and `async_op` (`send`/`recv`, `batch_p2p`: always async),
returns a `PendingCollective` (finish it with `.wait()`), counts in `Collectives.stats` the bytes
it hands to torch.distributed (`CommStats`), and runs the same code at world size 1. Tests may
subclass `Collectives` to intercept or fake any call; `observers` hear of each call.
How each operation is realised on a (backend, device type) is chosen in
megabuf/transport/collective_backends.py ([Note: collective strategies], [Note: one collective per
bucket group]).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.join import Join
from torch.distributed.distributed_c10d import _coalescing_manager

from megabuf.transport import collective_backends as backends
from megabuf.transport import observers
from megabuf.transport.comm_records import (
    CommStats,
    P2PMessage,
    PendingCollective,
    WaitOnce,
    adjacent_runs,
    nbytes_of,
    sum_chunks,
)
from megabuf.transport.worker_refs import HELD

Group = ProcessGroup | None

__all__ = [
    "Collectives", "CommStats", "Group", "P2PMessage", "PendingCollective", "adjacent_runs",
    "sum_chunks",
]  # fmt: skip


class Collectives:
    """The collective layer, one per engine; `stats`: bytes handed over, and their ring figure."""

    def __init__(
        self, strategies: Mapping[tuple[str, str], backends.CollectiveStrategy] | None = None
    ) -> None:
        self.strategies = dict(backends.BACKEND_STRATEGIES if strategies is None else strategies)
        self.stats, self.observers = CommStats(), observers.CollectiveObservers()
        # [Note: wire accounting by group]: the same counts, per named process group
        self.group_stats: dict[str, CommStats] = {}
        self._group_names: dict[int, tuple[str, Group]] = {}

    def name_groups(self, groups: Mapping[str, Group]) -> None:
        """Count from now on what each of `groups` is handed in `group_stats[name]`; a group
        under two names keeps the first. Unnamed groups count under "other", the default group
        (None) under "world"."""
        for name, group in groups.items():
            if group is not None and id(group) not in self._group_names:
                self._group_names[id(group)] = (name, group)  # the group kept: ids stay unique

    def stats_of(self, group: Group) -> CommStats:
        """The counts of `group` (by its name; "other" when unnamed)."""
        named = self._group_names.get(id(group))
        name = named[0] if named is not None else "world" if group is None else "other"
        if name not in self.group_stats:
            self.group_stats[name] = CommStats()
        return self.group_stats[name]

    def _record(self, group: Group, op: str, **nbytes: int) -> None:
        self.observers.issued(group, op, nbytes)  # [Note: collective observers]
        self.stats.record(op, **nbytes)
        self.stats_of(group).record(op, **nbytes)

    def strategy(self, group: Group, device: torch.device | str) -> backends.CollectiveStrategy:
        """How `group` moves tensors on `device` (the tensor's device, or its type)."""
        backend, device_type = dist.get_backend_config(group), torch.device(device).type
        return backends.choose_strategy(backend, device_type, self.strategies)

    @staticmethod
    def rank(group: Group = None) -> int:
        """This rank's rank in `group` (None: the default group)."""
        return dist.get_rank(group)

    @staticmethod
    def size(group: Group = None) -> int:
        """The number of ranks of `group` (None: the default group)."""
        return dist.get_world_size(group)

    def global_rank(self, group: Group, group_rank: int) -> int:
        """The global rank of `group_rank` in `group` (None: the default group)."""
        return dist.get_global_rank(group, group_rank) if group is not None else group_rank

    @staticmethod
    def _avg_plan(tensor: Tensor, size: int, average: bool, native_avg: bool) -> tuple[Any, int]:
        """(reduce op, divisor applied on wait) for a sum or an average over `size` ranks.

        A group of one needs no AVG (NCCL's AVG is also buggy there before 2.29.7). Without a
        native AVG the sum is divided afterwards, except for fp16, whose sum of `size` values
        can overflow where the mean would not: it is divided (in place) before summing."""
        if not average or size == 1:
            return dist.ReduceOp.SUM, 1
        if native_avg:
            return dist.ReduceOp.AVG, 1
        if tensor.dtype == torch.float16:
            tensor.div_(size)
            return dist.ReduceOp.SUM, 1
        return dist.ReduceOp.SUM, size

    def all_reduce(
        self, tensor: Tensor, group: Group, *, average: bool = False, async_op: bool = True
    ) -> PendingCollective:
        """Sum (or average) `tensor` in place across `group`."""
        size = dist.get_world_size(group)
        self._record_all_reduce(tensor, size, group)
        has_avg = self.strategy(group, tensor.device).has_avg
        op, divide = self._avg_plan(tensor, size, average, has_avg)
        with torch.profiler.record_function("megabuf::all_reduce"):
            HELD.hold(tensor)  # [Note: a backend thread's last reference]
            work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        return self._pending("all_reduce", work, tensor, None, divide)

    def reduce_scatter(
        self, output: Tensor, input: Tensor, group: Group, *, average: bool = False,
        async_op: bool = True, scratch: Tensor | None = None, scale: float = 1.0,
    ) -> PendingCollective:  # fmt: skip
        """output (this rank's 1/size chunk of `input`) = scale * sum over ranks of that chunk.

        `scratch` (same shape as input) is required by the all-to-all strategy; callers keep it
        so steady-state steps allocate nothing. `scale` is applied to the output only: 1/size of
        the work of scaling the input.
        """
        size = dist.get_world_size(group)
        if input.numel() != output.numel() * size:
            raise ValueError(
                f"megabuf: reduce_scatter input has {input.numel()} elements, expected "
                f"{output.numel()} x group size {size}"
            )
        strategy, ring = self.strategy(group, input.device), (size - 1) * nbytes_of(output)
        with torch.profiler.record_function("megabuf::reduce_scatter"):
            if strategy.reduce_scatter == "all_to_all":
                if scratch is None:
                    scratch = torch.empty_like(input)
                self._record_reduce_scatter(input, scratch, ring, group)
                _, divide = self._avg_plan(input, size, average, native_avg=False)  # local sum
                HELD.hold(scratch, input)
                work = dist.all_to_all_single(scratch, input, group=group, async_op=async_op)
                return self._pending("reduce_scatter", work, output, scratch, divide, scale)
            self._record_reduce_scatter(input, output, ring, group)
            op, divide = self._avg_plan(input, size, average, strategy.has_avg)
            HELD.hold(output, input)
            work = dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)
        return self._pending("reduce_scatter", work, output, None, divide, scale)

    def _record_all_reduce(self, tensor: Tensor, size: int, group: Group, op: str = "all_reduce"
                           ) -> None:  # fmt: skip
        nbytes = nbytes_of(tensor)  # in place: handed over as input and written as output
        self._record(
            group,
            op, input_nbytes=nbytes, output_nbytes=nbytes,
            ring_nbytes=2 * (size - 1) * nbytes // size,
        )  # fmt: skip

    def _record_reduce_scatter(self, input: Tensor, landing: Tensor, ring: int, group: Group
                               ) -> None:  # fmt: skip
        self._record(group, "reduce_scatter", input_nbytes=nbytes_of(input),
                     output_nbytes=nbytes_of(landing), ring_nbytes=ring)  # fmt: skip

    def all_gather(
        self, output: Tensor, input: Tensor, group: Group, *, async_op: bool = True, tag: int = 0
    ) -> PendingCollective:
        """output = concatenation over ranks of each rank's `input` (a 1-D shard)."""
        size = dist.get_world_size(group)
        if output.numel() != input.numel() * size:
            raise ValueError(
                f"megabuf: all_gather output has {output.numel()} elements, expected "
                f"{input.numel()} x group size {size}"
            )
        ring = (size - 1) * nbytes_of(input)
        with torch.profiler.record_function("megabuf::all_gather"):
            if self.strategy(group, input.device).all_gather != "p2p":
                self._record(group,
                    "all_gather", input_nbytes=nbytes_of(input), output_nbytes=nbytes_of(output),
                    ring_nbytes=ring,
                )  # fmt: skip
                HELD.hold(output, input)
                work = dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)
                return self._pending("all_gather", work, None, None, 1)
        return self._p2p_all_gather([(output, input)], group, async_op=async_op, tag=tag)

    def _p2p_all_gather(
        self, pairs: Sequence[tuple[Tensor, Tensor]], group: Group, *, async_op: bool, tag: int
    ) -> PendingCollective:
        """The gloo all-gather of every (output, input) pair as one batch of point-to-point
        messages (bucket by bucket, peer by peer: the same order on every rank)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ops, sent, received, ring = [], 0, 0, 0
        for output, input in pairs:
            chunks = output.view(size, -1)
            if chunks[rank].data_ptr() != input.data_ptr():
                chunks[rank].copy_(input)
            ring += (size - 1) * nbytes_of(input)
            for peer in range(size):
                if peer != rank:
                    peer_global = dist.get_global_rank(group, peer) if group else peer
                    ops.append(dist.P2POp(dist.isend, input, peer_global, group, tag))
                    ops.append(dist.P2POp(dist.irecv, chunks[peer], peer_global, group, tag))
                    sent, received = sent + nbytes_of(input), received + nbytes_of(chunks[peer])
        self._record(
            group, "all_gather", input_nbytes=sent, output_nbytes=received, ring_nbytes=ring
        )
        with torch.profiler.record_function("megabuf::all_gather"):
            handles = dist.batch_isend_irecv(ops) if ops else []
        pending = PendingCollective("all_gather", list(handles))
        if not async_op:
            pending.wait()
        return pending

    # ---- one bucket group's calls ([Note: one collective per bucket group]) ------------------
    def all_reduce_many(
        self, tensors: Sequence[Tensor], group: Group, *, average: bool = False,
        async_op: bool = True,
    ) -> list[PendingCollective]:  # fmt: skip
        """All-reduce every tensor in place: adjacent views as one, the rest batched if the
        strategy coalesces."""
        runs = adjacent_runs(tensors)
        if len(runs) > 1 and self._coalesces(group, runs[0].device, "all_reduce"):
            return self._coalesced(
                "all_reduce", group, async_op,
                lambda: [self.all_reduce(t, group, average=average) for t in runs],
            )  # fmt: skip
        return [self.all_reduce(t, group, average=average, async_op=async_op) for t in runs]

    def reduce_scatter_many(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], group: Group, *,
        average: bool = False, async_op: bool = True, scratches: Sequence[Tensor | None],
        scales: Sequence[float],
    ) -> list[PendingCollective]:  # fmt: skip
        """`reduce_scatter` of every (output, input) pair: batched if the strategy coalesces
        native reduce-scatters, never merged ([Note: one collective per bucket group])."""
        args = list(zip(outputs, inputs, scratches, scales, strict=True))

        def issue(async_: bool) -> list[PendingCollective]:
            return [
                self.reduce_scatter(
                    o, i, group, average=average, async_op=async_, scratch=sc, scale=f
                )
                for o, i, sc, f in args
            ]

        if len(args) > 1 and self._coalesces(group, inputs[0].device, "reduce_scatter"):
            return self._coalesced("reduce_scatter", group, async_op, lambda: issue(True))
        return issue(async_op)

    def _coalesces(self, group: Group, device: torch.device, op: str) -> bool:
        """The strategy batches `op` in the coalescing manager (its native form only)."""
        strategy = self.strategy(group, device)
        native = op == "all_reduce" or getattr(strategy, op) == "native"
        return strategy.coalesce == "manager" and native

    def all_gather_many(
        self, outputs: Sequence[Tensor], inputs: Sequence[Tensor], group: Group, *,
        async_op: bool = True, tag: int = 0,
    ) -> list[PendingCollective]:  # fmt: skip
        """`all_gather` of every (output, input) pair: one p2p batch on gloo, a coalesced batch
        where the strategy coalesces native all-gathers, else one call each."""
        pairs = list(zip(outputs, inputs, strict=True))
        if not pairs:
            return []
        strategy = self.strategy(group, inputs[0].device)
        if strategy.all_gather == "p2p":
            return [self._p2p_all_gather(pairs, group, async_op=async_op, tag=tag)]
        if len(pairs) > 1 and self._coalesces(group, inputs[0].device, "all_gather"):
            return self._coalesced(
                "all_gather", group, async_op,
                lambda: [self.all_gather(o, i, group, tag=tag) for o, i in pairs],
            )  # fmt: skip
        return [self.all_gather(o, i, group, async_op=async_op, tag=tag) for o, i in pairs]

    def _coalesced(
        self, op: str, group: Group, async_op: bool, issue: Callable[[], list[PendingCollective]]
    ) -> list[PendingCollective]:
        """Issue native collectives (each `async_op=True`) inside torch's coalescing manager,
        which records them and launches them as one batch with one work handle. The records
        keep their epilogues (AVG division, scale); every record holds the batch's handle
        behind a wait-once guard, so waiting on any of them first waits for the batch, once
        (a second wait of gloo's coalesced work would copy its results out again, over an
        epilogue already applied). Counted as one call."""
        with _coalescing_manager(group, None, async_ops=True) as manager:
            pendings = issue()  # placeholders: torch returns no real work inside the manager
        batch = WaitOnce(list(manager.works))
        for pending in pendings:
            pending.handles = [batch]
        self.stats.calls[op] -= len(pendings) - 1
        self.stats_of(group).calls[op] -= len(pendings) - 1
        if not async_op:
            for pending in pendings:
                pending.wait()
        return pendings

    def broadcast(self, tensor: Tensor, src_group_rank: int, group: Group) -> None:
        """Synchronously copy `tensor` from group rank `src_group_rank` to every rank."""
        src = dist.get_global_rank(group, src_group_rank) if group else src_group_rank
        nbytes = nbytes_of(tensor)
        if dist.get_rank() == src:
            self._record(
                group, "broadcast", input_nbytes=nbytes, output_nbytes=0, ring_nbytes=nbytes
            )
        else:
            self._record(group, "broadcast", input_nbytes=0, output_nbytes=nbytes, ring_nbytes=0)
        with torch.profiler.record_function("megabuf::broadcast"):
            HELD.hold(tensor)
            dist.broadcast(tensor, src=src, group=group)

    def all_to_all(
        self, output: Tensor, input: Tensor, group: Group, *,
        output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
        async_op: bool = True,
    ) -> PendingCollective:  # fmt: skip
        """Rows `input_split_sizes[r]` of `input` go to group rank r; `output` receives
        `output_split_sizes[r]` rows from each rank r, in rank order (equal splits if None)."""
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        checks = (("input", input, input_split_sizes), ("output", output, output_split_sizes))
        for name, t, splits in checks:
            rows = t.shape[0] if t.dim() else 0
            if splits is not None and (len(splits) != size or sum(splits) != rows):
                raise ValueError(
                    f"megabuf: all_to_all {name} split sizes {splits} must have group size "
                    f"{size} entries summing to the {name}'s {rows} rows (rank {dist.get_rank()})"
                )
        row_nbytes = nbytes_of(input) // max(1, input.shape[0]) if input.dim() else 0
        kept = input_split_sizes[rank] if input_split_sizes is not None else input.shape[0] // size
        self._record(group,
            "all_to_all", input_nbytes=nbytes_of(input), output_nbytes=nbytes_of(output),
            ring_nbytes=(input.shape[0] - kept) * row_nbytes,
        )  # fmt: skip
        with torch.profiler.record_function("megabuf::all_to_all"):
            HELD.hold(output, input)
            work = dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group,
                async_op=async_op,
            )  # fmt: skip
        return self._pending("all_to_all", work, None, None, 1)

    def send(
        self, tensor: Tensor, dst_group_rank: int, group: Group, *, tag: int = 0
    ) -> PendingCollective:
        """Asynchronous point-to-point send to group rank `dst_group_rank` (pipelines). The
        returned record owns `tensor` until `wait()`: do not modify it before then."""
        dst = dist.get_global_rank(group, dst_group_rank) if group else dst_group_rank
        nbytes = nbytes_of(tensor)
        self._record(group, "send", input_nbytes=nbytes, output_nbytes=0, ring_nbytes=nbytes)
        with torch.profiler.record_function("megabuf::send"):
            work = dist.isend(tensor, dst=dst, group=group, tag=tag)
        # `output` keeps the sent tensor alive until wait(); nothing is written into it.
        return PendingCollective("send", [work] if work is not None else [], output=tensor)

    def recv(
        self, tensor: Tensor, src_group_rank: int, group: Group, *, tag: int = 0
    ) -> PendingCollective:
        """Asynchronous point-to-point receive into `tensor` from group rank `src_group_rank`."""
        src = dist.get_global_rank(group, src_group_rank) if group else src_group_rank
        self._record(group, "recv", input_nbytes=0, output_nbytes=nbytes_of(tensor), ring_nbytes=0)
        with torch.profiler.record_function("megabuf::recv"):
            work = dist.irecv(tensor, src=src, group=group, tag=tag)
        return PendingCollective("recv", [work] if work is not None else [], output=tensor)

    def batch_p2p(self, messages: Sequence[P2PMessage], group: Group) -> PendingCollective:
        """Issue `messages` as one batched group (`torch.distributed.batch_isend_irecv`), in the
        given order; `wait()` on the result finishes all of them. NCCL ignores tags and matches
        the messages of a pair of ranks in issue order, so callers must issue them in an order
        both ends share. The caller keeps every message's tensor alive and unmodified until
        `wait()` returns. An empty list issues nothing."""
        ops, sent, received = [], 0, 0
        for m in messages:
            peer = self.global_rank(group, m.peer)
            ops.append(
                dist.P2POp(dist.isend if m.send else dist.irecv, m.tensor, peer, group, m.tag)
            )
            if m.send:
                sent += nbytes_of(m.tensor)
            else:
                received += nbytes_of(m.tensor)
        self._record(
            group, "batch_p2p", input_nbytes=sent, output_nbytes=received, ring_nbytes=sent
        )
        with torch.profiler.record_function("megabuf::batch_p2p"):
            handles = dist.batch_isend_irecv(ops) if ops else []
        return PendingCollective("batch_p2p", list(handles))

    def all_reduce_sparse(self, grad: Tensor, group: Group) -> PendingCollective:
        """Async in-place sum of a sparse COO `grad` (gloo); what lands is coalesced."""
        ring = (self.size(group) - 1) * (n := nbytes_of(grad._indices()) + grad._values().nbytes)
        self._record(group, "all_reduce_sparse", input_nbytes=n, output_nbytes=n, ring_nbytes=ring)
        with torch.profiler.record_function("megabuf::all_reduce_sparse"):
            HELD.hold(grad)
            work = dist.all_reduce(grad, group=group, async_op=True)
        return self._pending("all_reduce_sparse", work, None, None, 1)

    def all_reduce_max(self, tensor: Tensor, group: Group, *, op: str = "all_reduce") -> None:
        """Synchronous elementwise max across the group (found-inf flags, FP8 amaxes: `op`)."""
        self._record_all_reduce(tensor, dist.get_world_size(group), group, op=op)
        HELD.hold(tensor)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)

    def notify_join(self, joinable: Any) -> Any:
        """torch's Join: "not joined yet" (async all-reduce, uncounted): [Note: uneven inputs]."""
        return Join.notify_join_context(joinable)

    def barrier(self, group: Group) -> None:
        """Synchronous: return once every rank of the group has called it (checkpoint I/O)."""
        self._record(group, "barrier", input_nbytes=0, output_nbytes=0, ring_nbytes=0)
        with torch.profiler.record_function("megabuf::barrier"):
            dist.barrier(group=group)

    def all_gather_object(self, obj: Any, group: Group) -> list[Any]:
        """Every rank's `obj`, in group-rank order (pickled; for set-up checks, not hot paths)."""
        # torch pickles `obj` itself; its pickle is the closest count of what is handed over
        size, nbytes = dist.get_world_size(group), len(pickle.dumps(obj))
        self._record(group,
            "all_gather_object", input_nbytes=nbytes, output_nbytes=0,
            ring_nbytes=(size - 1) * nbytes,
        )  # fmt: skip
        out: list[Any] = [None] * size
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: Any, src_group_rank: int, group: Group) -> Any:
        """Group rank `src_group_rank`'s `obj`, on every rank (pickled; one-time transfers: each
        rank receives the source's bytes only, where `all_gather_object` pads to the largest)."""
        src = self.global_rank(group, src_group_rank)
        sent = len(pickle.dumps(obj)) if dist.get_rank() == src else 0
        self._record(group, "broadcast_object", input_nbytes=sent, output_nbytes=0,
                     ring_nbytes=sent)  # fmt: skip
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    @staticmethod
    def _pending(op: str, work: Any, output: Tensor | None, scratch: Tensor | None, divide: int,
                 scale: float = 1.0) -> PendingCollective:  # fmt: skip
        handles = [work] if work is not None else []
        pending = PendingCollective(op, handles, output, scratch, divide, scale)
        if work is None:  # synchronous call: finish the epilogue now
            pending.wait()
        return pending
