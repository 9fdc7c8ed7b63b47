"""What one weight publish sends: the manifest of the buckets and the decision every rank of the
publishing group takes from the same headers (pure: no process group, unit-tested alone).

[Note: publish protocol]
A publish is collective over one group of trainer ranks (the dp ranks of one model replica, in
dp-rank order) and consumer ranks (inference workers that do not train):
1. headers: every rank contributes a small pickled header in one all-gather; trainers say which
   version they publish, the version they published last, and which of their bucket slices
   changed since; dp rank 0 adds the manifest (each bucket's padded numel and its params' names,
   shapes and offsets); consumers say which version they hold and, optionally, which they expect.
2. decision (`decide`): every rank computes the same `Transfer` from the same headers, so a
   mismatch (trainers disagreeing on the version, a version that does not increase, a consumer
   expecting another version) raises the same named error on every rank and nothing hangs.
   Buckets sent: all of them, or with `changed_only` the union of the trainers' changed slices
   when every consumer holds the previous version in this publish's layout ([Note: what a
   consumer holds]; a new, lagging or re-laid-out consumer gets everything).
3. data: bucket by bucket, trainer `r` of `n` sends elements [numel*r//n, numel*(r+1)//n) of the
   flat bucket (its own shard under the sharded strategies: nothing is gathered) to every
   consumer, one flat message each, in the publish dtype; consumers receive straight into their
   flat copy of the bucket and rebuild named tensors as views of it. With `delta` a slice
   may instead go as its changed elements, int32 indices then values ([Note: element deltas]
   in delta.py; the counts travel in the headers, so every message's size is known). A
   trainer holds at most one slice copy at a time (when it casts, packs a no_shard bucket or
   moves it to the host: the ledger's "weight_publish", whose peak is the largest such
   slice); a view of its own shard is sent as it is. Every wait is bounded by
   the group's timeout, and a missing message raises naming the bucket and the trainer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megabuf.weights.delta import WHOLE, delta_pays


@dataclass(frozen=True)
class ParamEntry:
    name: str
    shape: tuple[int, ...]
    offset: int  # start inside its flat bucket, in elements


@dataclass(frozen=True)
class BucketEntry:
    numel: int  # padded flat numel
    dtype: str  # the model's param dtype, e.g. "torch.bfloat16"
    params: tuple[ParamEntry, ...]


def send_range(numel: int, rank: int, size: int) -> tuple[int, int]:
    """Elements of a flat bucket trainer `rank` of `size` sends (the shard range when numel
    divides)."""
    return numel * rank // size, numel * (rank + 1) // size


@dataclass(frozen=True)
class TrainerHeader:
    dp_rank: int
    version: int
    previous: int | None  # the version this publisher sent last
    changed: tuple[bool, ...]  # per bucket: its slice differs from the one sent last
    manifest: tuple[BucketEntry, ...] | None  # dp rank 0 only
    dtype: str  # what goes on the wire; "": each bucket's own param dtype
    changed_only: bool  # send only the buckets that changed, where every consumer can take it
    counts: tuple[int, ...] = ()  # delta=True: per bucket, changed elements or WHOLE
    anchor_due: bool = False  # delta=True: this publish must be whole ([Note: element deltas])


@dataclass(frozen=True)
class ConsumerHeader:
    rank: int  # group rank, for messages
    have: int | None  # the version it holds
    expect: int | None  # the version it wants, or None for any
    holds: str | None = None  # `holding()` of its copy's layout; None: nothing held


@dataclass(frozen=True)
class Transfer:
    version: int
    manifest: tuple[BucketEntry, ...]
    send: tuple[int, ...]  # bucket indices sent, ascending
    dtype: str
    trainers: int
    deltas: tuple[tuple[int, ...], ...] = ()  # per bucket, per trainer: WHOLE or elements sent


def decide(headers: Sequence[TrainerHeader | ConsumerHeader]) -> Transfer:
    """See [Note: publish protocol], point 2. Raises ValueError (the same on every rank)."""
    trainers = sorted((h for h in headers if isinstance(h, TrainerHeader)), key=_dp)
    consumers = [h for h in headers if isinstance(h, ConsumerHeader)]
    if not trainers or [t.dp_rank for t in trainers] != list(range(len(trainers))):
        raise ValueError(
            f"megabuf: weight publish needs trainer dp ranks 0..n-1 in the group, got "
            f"{[t.dp_rank for t in trainers]}"
        )
    versions = {t.version for t in trainers}
    if len(versions) != 1:
        raise ValueError(
            f"megabuf: weight publish: trainers disagree on the version: {sorted(versions)}"
        )
    if (
        len({(t.changed_only, t.dtype, t.previous, bool(t.counts), t.anchor_due) for t in trainers})
        != 1
    ):
        raise ValueError(
            "megabuf: weight publish: trainers disagree on changed_only, delta, dtype or the "
            "last version sent; every trainer must call publish() with the same arguments"
        )
    version, lead = versions.pop(), trainers[0]
    if lead.previous is not None and version <= lead.previous:
        raise ValueError(
            f"megabuf: weight publish of version {version} after version {lead.previous}: "
            "versions must increase (the optimizer's applied updates, or your own counter)"
        )
    late = [c for c in consumers if c.expect is not None and c.expect != version]
    if late:
        raise ValueError(
            f"megabuf: weight publish: consumer rank {late[0].rank} expects version "
            f"{late[0].expect}, the trainers publish version {version}"
        )
    if lead.manifest is None:
        raise ValueError("megabuf: weight publish: dp rank 0 sent no manifest")
    every = tuple(range(len(lead.manifest)))
    send = every
    current = all(_current(c, lead) for c in consumers)
    if lead.changed_only and current:
        send = tuple(i for i in every if any(t.changed[i] for t in trainers))
    deltas: tuple[tuple[int, ...], ...] = ()
    if lead.counts and current and not lead.anchor_due:  # [Note: element deltas]
        deltas = tuple(_deltas(lead.manifest[i], i, lead.dtype, trainers) for i in every)
        send = tuple(i for i in send if any(k != 0 for k in deltas[i]))
    return Transfer(version, lead.manifest, send, lead.dtype, len(trainers), deltas)


def _deltas(
    entry: BucketEntry, index: int, dtype: str, trainers: Sequence[TrainerHeader]
) -> tuple[int, ...]:
    """Per trainer: the elements of its slice of bucket `index` sent as a delta, or WHOLE."""
    item = wire_dtype(dtype or entry.dtype).itemsize
    out = []
    for r, t in enumerate(trainers):
        lo, hi = send_range(entry.numel, r, len(trainers))
        k = t.counts[index]
        out.append(k if k == 0 or (k != WHOLE and delta_pays(k, hi - lo, item)) else WHOLE)
    return tuple(out)


def _dp(header: TrainerHeader) -> int:
    return header.dp_rank


def _current(consumer: ConsumerHeader, lead: TrainerHeader) -> bool:
    """`consumer` holds the version the trainers sent last, laid out as this publish sends it:
    only then may an unchanged bucket be skipped ([Note: what a consumer holds])."""
    if lead.manifest is None or consumer.have is None or consumer.have != lead.previous:
        return False
    return consumer.holds == holding(lead.manifest, lead.dtype)


def holding(manifest: Sequence[BucketEntry], dtype: str) -> str:
    """A digest of the flat copies a consumer keeps for `manifest` sent in `dtype` (each
    bucket's wire dtype, numel and params): equal digests, interchangeable copies.

    [Note: what a consumer holds]
    A changed-only publish skips a bucket whose slices did not change on any trainer, which is
    right only if every consumer's copy of that bucket *is* the last version sent, in the wire
    dtype and layout of this publish. A receiver reallocates its flat copies (zeros) whenever
    the digest of the transfer's manifest and wire dtypes differs from the one it holds, so
    after a dtype switch (fp32 then bf16) or a new manifest (a bucket re-plan) its copies hold
    nothing; comparing versions alone would skip the unchanged buckets and leave those zeros
    (issue 44: a frozen layer whose values bf16 represents exactly compared equal across the
    switch), and after a bucket re-plan (`Publisher._follow_layout`) the same holds for the new
    manifest. So each consumer says which digest it holds and `decide` skips only when every
    consumer holds the digest of this publish. That also keeps the trainers' host copies
    (`Publisher._changed`) honest: a switch sends, and so re-copies, every bucket, so a copy is
    never compared with a slice of another dtype when it matters. A receive that fails midway
    holds no version and no digest (its next publish is sent in full).
    """
    wire = tuple(str(wire_dtype(dtype or b.dtype)) for b in manifest)
    return hashlib.sha256(repr((wire, tuple(manifest))).encode()).hexdigest()[:32]


def wire_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"megabuf: weight publish: unknown dtype {name!r}")
    return dtype
