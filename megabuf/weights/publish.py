"""`Publisher` / `WeightReceiver`: trainers send fresh weights to consumer ranks that do not train,
every trainer its own slice of every bucket; see [Note: publish protocol] in transfer.py.

    group = publish_group(trainer_ranks=[0, 1], consumer_ranks=[2], timeout_s=60)  # all 3 ranks
    # trainers                                   # consumers
    publisher = Publisher(model, group)           receiver = WeightReceiver(group)
    publisher.publish(optimizer=opt)              weights = receiver.receive()  # name -> tensor
"""

from __future__ import annotations

import torch
from torch import Tensor

from megabuf.buckets.buffer import _ParamAndGradBucket, _ParamAndGradBuffer
from megabuf.ddp import DistributedDataParallel
from megabuf.fp8 import refuse_fp8_params
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.transport.collectives import Collectives
from megabuf.weights import delta as deltas
from megabuf.weights.channel import (
    PUBLISH_CATEGORY,
    PendingPublish,
    PublishGroup,
    Sending,
    publish_group,
    wait_all,
)
from megabuf.weights.export import NameMap, resolve_version
from megabuf.weights.transfer import (
    BucketEntry,
    ConsumerHeader,
    ParamEntry,
    TrainerHeader,
    Transfer,
    decide,
    holding,
    send_range,
    wire_dtype,
)

__all__ = ["PUBLISH_CATEGORY", "PendingPublish", "PublishGroup", "Publisher", "WeightReceiver",
           "publish_group"]  # fmt: skip


class Publisher:
    """The trainer side for one model (dp ranks only, no pp / ep).

    [Note: publishing from replicas]
    Under a hybrid split ([Note: hybrid rank order]) every replica holds the same params, laid
    out and sharded over its shard group of S ranks: the R shard groups hold R identical copies
    of every slice. So the trainers of a publish are the S ranks of replicate rank 0's shard
    group, trainer r its shard rank r, each sending its shard of every bucket, exactly the
    protocol of a flat model at dp S; the other replicas take no part (no Publisher, not in the
    publish group) and go on training. Sending from every replica would move R times the bytes
    for nothing, and a consumer would have to pick one copy of each slice anyway.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        group: PublishGroup,
        *,
        track_changes: bool = False,
        anchor_every: int = 16,
        collectives: Collectives | None = None,
    ) -> None:
        """`track_changes`: keep a host copy of every slice sent (this rank's share of the
        model, in the publish dtype), which `publish(changed_only=True)` and
        `publish(delta=True)` compare against. `anchor_every`: with deltas, every
        `anchor_every`-th publish is whole ([Note: element deltas] in delta.py)."""
        if anchor_every < 1:
            raise ValueError(f"megabuf: Publisher(anchor_every={anchor_every}) must be >= 1")
        topo = model.engine.process_groups.topology
        if topo.pp_size > 1 or topo.ep_size > 1:
            raise ValueError(
                f"megabuf: Publisher supports dp-only models (pp_size={topo.pp_size}, "
                f"ep_size={topo.ep_size}); publish each stage's model with its own group"
            )
        replicas = topo.dp_replicate_size
        if replicas > 1 and topo.dp_replicate_rank != 0:  # [Note: publishing from replicas]
            raise ValueError(
                f"megabuf: Publisher on rank {topo.rank}: the model is hybrid-sharded ({replicas} "
                f"replicas x {topo.dp_shard_size}) and this rank is in replica "
                f"{topo.dp_replicate_rank}; the replicas hold the same shards, so only "
                "replicate rank 0's shard group publishes: build the Publisher (and the publish "
                "group's trainers) on those ranks only ([Note: publishing from replicas])"
            )
        # a trainer's index: its shard rank under hybrid (the buffers are laid out over the
        # shard group), else its dp rank
        self.trainer_rank, count = (
            (topo.dp_shard_rank, topo.dp_shard_size)
            if replicas > 1
            else (topo.dp_rank, topo.dp_size)
        )
        if len(group.trainers) != count or group.trainers[self.trainer_rank] != topo.rank:
            which = "replicate rank 0's shard group" if replicas > 1 else "the model's dp ranks"
            raise ValueError(
                f"megabuf: Publisher on rank {topo.rank} (trainer index {self.trainer_rank}): "
                f"the group's trainers {list(group.trainers)} must be {which}, {count} ranks "
                "in order"
            )
        refuse_fp8_params(model, "Publisher")  # [Note: FP8 params]
        self.model = model
        self.group = group
        self.collectives = collectives if collectives is not None else model.engine.collectives
        self.buckets: list[tuple[_ParamAndGradBuffer, _ParamAndGradBucket]] = []
        self.manifest: tuple[BucketEntry, ...] = ()
        self._sent: list[Tensor | None] = []  # host copies, last sent, one per bucket
        self._follow_layout()
        self.previous: int | None = None
        self.track_changes = track_changes
        self.anchor_every = anchor_every
        self._in_flight: PendingPublish | None = None
        self._since_anchor = 0  # delta publishes since the last whole one
        self.sent_nbytes = 0  # payload bytes this rank sent in the last publish

    def _follow_layout(self) -> None:
        """Read the engine's buckets again if they are not the ones last read: a bucket re-plan
        (bucket_size="auto" after its warm-up, `engine.rebucket`) makes new bucket objects, and
        under the sharded strategies new buffers, the old ones retired. The host copies of the
        old layout are dropped, and the new manifest makes every consumer's copy another layout,
        sent in full ([Note: what a consumer holds] in transfer.py)."""
        buckets = [(buf, b) for buf in _buffers(self.model) for b in buf.buckets]
        if len(buckets) == len(self.buckets) and all(
            new is old for (_, new), (_, old) in zip(buckets, self.buckets)
        ):
            return
        self.buckets = buckets
        self.manifest = tuple(_entry(self.model, buf, b) for buf, b in buckets)
        self._sent = [None] * len(buckets)

    def use_group(self, group: PublishGroup) -> None:
        """Publish to `group`'s consumers from the next publish on: a consumer joins (or
        leaves) a running loop through a new publish group with the same trainers (every rank
        makes it, `publish_group`), which the trainers and the consumers that stay move to
        (`WeightReceiver.use_group`). The host copies stay: the joiner holds nothing, so the
        next publish is whole for every consumer, deltas after it ([Note: element deltas])."""
        if group.trainers != self.group.trainers:
            raise ValueError(
                f"megabuf: Publisher.use_group: the new group's trainers {list(group.trainers)} "
                f"must be this publisher's {list(self.group.trainers)}, in order; build a new "
                "Publisher for other trainers"
            )
        self._refuse_in_flight("use_group")
        self.group = group

    def _refuse_in_flight(self, what: str) -> None:
        if self._in_flight is not None and not self._in_flight.finished:
            raise RuntimeError(
                f"megabuf: {what} on rank {self.model.engine.process_groups.topology.rank} "
                "while the previous start_publish() is in flight: wait() its PendingPublish first"
            )

    def publish(
        self,
        *,
        optimizer: MegabufOptimizer | None = None,
        version: int | None = None,
        dtype: torch.dtype | None = None,
        changed_only: bool = False,
        delta: bool = False,
    ) -> Transfer:
        """Send the weights of the last completed step (gathers in flight are waited for).
        Collective over the publish group. Returns what was sent. `delta`: changed elements
        only, where that is smaller ([Note: element deltas] in delta.py). One slice copy at a
        time; `start_publish` is the asynchronous form."""
        transfer, scans = self._decide(optimizer, version, dtype, changed_only, delta)
        for index in transfer.send:  # one bucket's slice materialised at a time
            self._start_send(index, transfer, dtype, scans[index][2], snapshot=False).wait()
        return transfer

    def start_publish(
        self,
        *,
        optimizer: MegabufOptimizer | None = None,
        version: int | None = None,
        dtype: torch.dtype | None = None,
        changed_only: bool = False,
        delta: bool = False,
    ) -> PendingPublish:
        """`publish` whose sends go on while training continues ([Note: asynchronous
        publish]): the headers are exchanged now, every slice sent is copied to the host now
        (a snapshot of this version), and the returned record's `wait()` ends the sends."""
        transfer, scans = self._decide(optimizer, version, dtype, changed_only, delta)
        sends = [
            self._start_send(index, transfer, dtype, scans[index][2], snapshot=True)
            for index in transfer.send
        ]
        self._in_flight = PendingPublish(transfer, sends)
        return self._in_flight

    def _decide(
        self,
        optimizer: MegabufOptimizer | None,
        version: int | None,
        dtype: torch.dtype | None,
        changed_only: bool,
        delta: bool,
    ) -> tuple[Transfer, list[tuple[bool, int, Tensor | None]]]:
        """Phases 1 and 2 of [Note: publish protocol]: the headers, and what is sent."""
        model = self.model
        self._refuse_in_flight("publish")
        model.engine.check_resident("publish()")
        if (changed_only or delta) and not self.track_changes:
            raise ValueError(
                f"megabuf: publish(changed_only={changed_only}, delta={delta}) needs "
                "Publisher(..., track_changes=True) (host copies of what was sent, to compare "
                "against)"
            )
        model.engine.param_side.publish()
        self._follow_layout()
        number = resolve_version(optimizer, version)
        scans = [self._scan(i, dtype, delta) for i in range(len(self.buckets))]
        header = TrainerHeader(
            self.trainer_rank, number, self.previous, tuple(c for c, _, _ in scans),
            self.manifest if self.trainer_rank == 0 else None,
            str(dtype) if dtype is not None else "", changed_only,
            tuple(k for _, k, _ in scans) if delta else (),
            delta and self._since_anchor >= self.anchor_every - 1,
        )  # fmt: skip
        transfer = decide(self.collectives.all_gather_object(header, self.group.group))
        self.sent_nbytes = 0
        self._since_anchor = self._since_anchor + 1 if transfer.deltas else 0
        self.previous = number
        return transfer, scans

    def _start_send(
        self,
        index: int,
        transfer: Transfer,
        dtype: torch.dtype | None,
        at: Tensor | None,
        *,
        snapshot: bool,
    ) -> Sending:
        """This trainer's slice of bucket `index` to every consumer: whole, or its changed
        elements at `at` (int32 indices, then values; [Note: element deltas]). `snapshot`: a
        view of the model's memory is copied first (the next step may overwrite it)."""
        count = transfer.deltas[index][self.trainer_rank] if transfer.deltas else deltas.WHOLE
        engine = self.model.engine
        if count == 0:  # nothing changed in this slice
            return Sending(index, [], engine.memory_ledger, 0)
        buf, bucket = self.buckets[index]
        piece = self._slice(buf, bucket, dtype)
        viewed = _views_model(piece, buf, bucket)
        if snapshot and viewed:
            piece, viewed = piece.clone(), False
        copied = 0 if viewed else _nbytes(piece)
        engine.memory_ledger.alloc(PUBLISH_CATEGORY, copied)
        messages = [(piece, index)]
        if count != deltas.WHOLE and at is not None:
            messages = [(at, len(self.buckets) + index), (piece[at.to(torch.int64)], index)]
        consumers = [self.group.group_rank(c) for c in self.group.consumers]
        works = [
            self.collectives.send(t, c, self.group.group, tag=tag)
            for c in consumers
            for t, tag in messages
        ]
        self.sent_nbytes += sum(_nbytes(t) for t, _ in messages) * len(consumers)
        if self.track_changes:
            self._sent[index] = piece if not viewed else piece.clone()
        sending = Sending(index, works, engine.memory_ledger, copied, self.group)
        sending.rank = engine.process_groups.topology.rank
        return sending

    def _scan(
        self, index: int, dtype: torch.dtype | None, delta: bool
    ) -> tuple[bool, int, Tensor | None]:
        """(changed, the header's delta count, the changed indices kept for the send) of this
        rank's slice of bucket `index`; indices only where a delta is smaller."""
        if not delta:
            return self._changed(index, dtype), deltas.WHOLE, None
        now = self._slice(*self.buckets[index], dtype)
        at = deltas.changed_indices(self._sent[index], now)
        count = deltas.count(at, now.numel(), now.element_size())
        return count != 0, count, at if count not in (0, deltas.WHOLE) else None

    def _changed(self, index: int, dtype: torch.dtype | None) -> bool:
        """This rank's slice of bucket `index` differs from the one it sent last (True when
        not tracked). `torch.equal` compares across dtypes by value, so after a dtype switch
        this may say False: `decide` then sends every bucket anyway, which refills the copies
        ([Note: what a consumer holds])."""
        previous = self._sent[index]
        if previous is None:
            return True
        return not torch.equal(previous, self._slice(*self.buckets[index], dtype))

    def _slice(
        self, buf: _ParamAndGradBuffer, bucket: _ParamAndGradBucket, dtype: torch.dtype | None
    ) -> Tensor:
        """This trainer's part of the flat bucket ([Note: publish protocol], point 3)."""
        lo, hi = send_range(bucket.numel, buf.dp_rank, buf.dp_size)
        if buf.param_data is not None or buf.bucket_params is not None:
            piece = buf.param_shard_view(bucket.offset + lo, bucket.offset + hi)
        else:  # no_shard: the params live in their own storages; pack this bucket
            piece = _pack(buf, bucket)[lo:hi].clone()  # the packed bucket is freed here
        if dtype is not None and dtype != piece.dtype:
            piece = piece.to(dtype)
        return piece.cpu()  # the publish group is gloo's: messages leave from host memory


class WeightReceiver:
    """The consumer side: flat copies of every bucket, rebuilt into named tensors."""

    def __init__(
        self,
        group: PublishGroup,
        *,
        name_map: NameMap | None = None,
        collectives: Collectives | None = None,
    ) -> None:
        self.group = group
        self.name_map = name_map
        self.collectives = collectives if collectives is not None else Collectives()
        self.rank = self.collectives.rank(None)
        self.version: int | None = None
        self.holds: str | None = None  # `holding()` of `flats` ([Note: what a consumer holds])
        self.flats: list[Tensor] = []  # one per bucket, the publish dtype
        self.transfer: Transfer | None = None

    def use_group(self, group: PublishGroup) -> None:
        """Receive on `group` from the next receive on, keeping this copy (a consumer joining a
        running loop: see `Publisher.use_group`)."""
        if self.rank not in group.consumers:
            raise ValueError(
                f"megabuf: WeightReceiver.use_group on rank {self.rank}: not among the group's "
                f"consumers {list(group.consumers)}"
            )
        self.group = group

    def receive(self, *, expect_version: int | None = None) -> dict[str, Tensor]:
        """Join one publish (collective over the publish group); returns every weight under its
        consumer name, as views of this receiver's buffers (overwritten by the next receive)."""
        me = self.group.group_rank(self.rank)
        header = ConsumerHeader(me, self.version, expect_version, self.holds)
        transfer = decide(self.collectives.all_gather_object(header, self.group.group))
        holds = holding(transfer.manifest, transfer.dtype)
        if holds != self.holds:  # [Note: what a consumer holds]
            dtypes = [wire_dtype(transfer.dtype or b.dtype) for b in transfer.manifest]
            self.flats = [
                torch.zeros(b.numel, dtype=d, device="cpu")
                for b, d in zip(transfer.manifest, dtypes)
            ]
        # until every bucket arrived the copy is no version: a failed receive is sent in full
        self.version, self.holds = None, None
        for index in transfer.send:
            self._receive(index, transfer)
        self.transfer, self.version, self.holds = transfer, transfer.version, holds
        return self.named()

    def _receive(self, index: int, transfer: Transfer) -> None:
        """Bucket `index` from every trainer: its slice whole, or (indices, values) written
        into this copy ([Note: element deltas] in delta.py)."""
        trainers = [self.group.group_rank(t) for t in self.group.trainers]
        flat, pending, patches = self.flats[index], [], []
        for r, peer in enumerate(trainers):
            lo, hi = send_range(flat.numel(), r, len(trainers))
            count = transfer.deltas[index][r] if transfer.deltas else deltas.WHOLE
            if count == deltas.WHOLE:
                pending.append(
                    self.collectives.recv(flat[lo:hi], peer, self.group.group, tag=index)
                )
            elif count > 0:
                at = torch.empty(count, dtype=deltas.INDEX_DTYPE, device=flat.device)
                values = torch.empty(count, dtype=flat.dtype, device=flat.device)
                tag = len(transfer.manifest) + index
                pending.append(self.collectives.recv(at, peer, self.group.group, tag=tag))
                pending.append(self.collectives.recv(values, peer, self.group.group, tag=index))
                patches.append((flat[lo:hi], at, values))
        wait_all(
            pending, self.group, f"receiving bucket {index} from trainers {trainers}", self.rank
        )
        for target, at, values in patches:
            deltas.apply(target, at, values)

    def named(self) -> dict[str, Tensor]:
        if self.transfer is None:
            return {}
        out: dict[str, Tensor] = {}
        for flat, entry in zip(self.flats, self.transfer.manifest, strict=True):
            for p in entry.params:
                numel = int(torch.Size(p.shape).numel())
                tensor = flat[p.offset : p.offset + numel].view(p.shape)
                out.update(self.name_map(p.name, tensor) if self.name_map else [(p.name, tensor)])
        return out


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _views_model(piece: Tensor, buf: _ParamAndGradBuffer, bucket: _ParamAndGradBucket) -> bool:
    """`piece` is a view of the model's own param memory (no copy was made for it)."""
    homes = [t for t in (bucket.param_data, bucket.param_shard) if t is not None]
    ptr = piece.untyped_storage().data_ptr()
    return any(ptr == t.untyped_storage().data_ptr() for t in homes)


def _buffers(model: DistributedDataParallel) -> list[_ParamAndGradBuffer]:
    """Every buffer, plan order: at ep_size 1 the expert buffers' dp group is the dp group."""
    return list(model.engine.buffers)


def _entry(
    model: DistributedDataParallel, buf: _ParamAndGradBuffer, bucket: _ParamAndGradBucket
) -> BucketEntry:
    params = tuple(
        ParamEntry(
            model.engine.param_to_name[p],
            tuple(p.shape),
            buf.param_index_map[p].start - bucket.offset,
        )
        for p in bucket.params_list
    )
    return BucketEntry(bucket.numel, str(buf.param_dtype), params)


def _pack(buf: _ParamAndGradBuffer, bucket: _ParamAndGradBucket) -> Tensor:
    flat = torch.zeros(bucket.numel, dtype=buf.param_dtype, device=buf.device)
    for p in bucket.params_list:
        slot = buf.param_index_map[p]
        flat[slot.start - bucket.offset : slot.end - bucket.offset].copy_(p.detach().view(-1))
    return flat
