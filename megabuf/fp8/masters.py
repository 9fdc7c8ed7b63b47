"""FP8 params in checkpoints: the full fp32 masters out, the masters in, then the cast.

[Note: FP8 params in checkpoints]
A checkpoint holds no float8 bytes and no scales: the model-state entry of an FP8 weight is its
fp32 master (put together from every rank's shard, `gather_full_masters`) in the weight's
original dtype, the entry a model without FP8 (torchao casting in forward, or no torchao) saves
and loads for the same weight. The optimizer's pieces hold the fp32 masters themselves (its main
params view them). Loading writes this rank's shard of each loaded weight into its master
(`load_masters`), the optimizer then overwrites them with its fp32 pieces, and `recast` runs the
one amax agreement and cast a step ends with ([Note: FP8 params] in megabuf/fp8/__init__.py):
the bytes are then those the uninterrupted run held, and so is every later step. Nothing here
depends on the dp size: a checkpoint reshards like any other.

The bucket_size="auto" re-plan rebuilds the buffers ([Note: sharded auto bucket re-plan] in
megabuf/replan/sharded_replan.py) the same way: `reseeded` gives the new buffers each FP8
param's full master (in the weight's dtype) as the seed they cast from, as at construction; the
scale of the whole seed is the agreed scale, so the new bytes equal the old, and the optimizer's
restore then copies the fp32 masters exactly into the new buffers' masters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from megabuf.fp8.agree import agree_and_cast_by_kind
from megabuf.fp8.convert import Fp8Params
from megabuf.fp8.shards import Fp8BufferPart
from megabuf.pure.layout import shard_pieces
from megabuf.transport.collectives import Collectives, Group


def gather_full_masters(
    parts: Sequence[Fp8BufferPart], collectives: Collectives, group: Group
) -> dict[nn.Parameter, Tensor]:
    """Collective over `group` (the group the buffers are sharded over): every FP8 param's
    full master, param-shaped, in the weight's dtype ([Note: FP8 params in checkpoints])."""
    if not parts:
        return {}
    size = parts[0].dp_size
    with torch.no_grad():
        mine = torch.cat([m for part in parts for m in part.masters])  # 1-D fp32
        everyone = torch.empty(mine.numel() * size, dtype=mine.dtype, device=mine.device)
        collectives.all_gather(everyone, mine, group, async_op=True).wait()
        per_rank = everyone.view(size, -1)
        full: dict[nn.Parameter, Tensor] = {}
        for rank in range(size):
            _unpack(parts, per_rank[rank], rank, size, full)
    dtypes = {p: spec.hp_dtype for part in parts for p, spec in zip(part.params, part.specs)}
    return {p: t.view(p.shape).to(dtypes[p]) for p, t in full.items()}


def _unpack(
    parts: Sequence[Fp8BufferPart],
    shards: Tensor,
    rank: int,
    size: int,
    full: dict[nn.Parameter, Tensor],
) -> None:
    """Copy `rank`'s concatenated master shards (`shards`, 1-D fp32) into the full masters."""
    offset = 0
    for part in parts:
        starts = [b.shard_range(rank, size)[0] for b in part.layout.buckets]
        bucket_offsets = [
            offset + sum(m.numel() for m in part.masters[:i]) for i in range(len(starts))
        ]
        for piece in shard_pieces(part.layout, rank, size):
            param = part.params[piece.param_id]
            out = full.setdefault(
                param, torch.empty(param.numel(), dtype=shards.dtype, device=shards.device)
            )
            b = piece.bucket_id
            lo = bucket_offsets[b] + piece.buffer_start - starts[b]
            out[piece.param_start : piece.param_end] = shards[lo : lo + piece.numel]
        offset += sum(m.numel() for m in part.masters)


def load_masters(parts: Sequence[Fp8BufferPart], values: dict[nn.Parameter, Tensor]) -> None:
    """Write this rank's shard of each loaded FP8 weight (`values`: param-shaped, any float
    dtype) into its fp32 master; `recast` makes the bytes follow."""
    with torch.no_grad():
        for part in parts:
            for piece in part.pieces:
                value = values.get(part.params[piece.param_id])
                if value is not None:
                    flat = value.reshape(-1)[piece.param_start : piece.param_end]
                    part.master_view_of(piece).copy_(flat)


def recast(
    parts: Sequence[Fp8BufferPart], collectives: Collectives, shard_group: Callable[[bool], Group]
) -> None:
    """After the masters were loaded: the amax agreement and cast a step ends with (collective
    over each kind's shard group); the caller then gathers the params."""
    agree_and_cast_by_kind(parts, collectives, shard_group)


def gather_by_kind(
    parts: Sequence[Fp8BufferPart], collectives: Collectives, shard_group: Callable[[bool], Group]
) -> dict[nn.Parameter, Tensor]:
    """`gather_full_masters` of the dense parts over `shard_group(False)` and of the expert
    parts over `shard_group(True)`."""
    out: dict[nn.Parameter, Tensor] = {}
    for expert in (False, True):
        mine = [part for part in parts if part.expert == expert]
        if mine:
            out |= gather_full_masters(mine, collectives, shard_group(expert))
    return out


def reseeded(
    parts: Sequence[Fp8BufferPart], collectives: Collectives, shard_group: Callable[[bool], Group]
) -> Fp8Params | None:
    """Before a rebuild of the buffers (the bucket_size="auto" re-plan): the engine's FP8 params
    with every one's full master as its seed (collective over each kind's shard group); None
    without FP8 params. The caller drops the seeds once the new buffers are built."""
    if not parts:
        return None
    fp8 = parts[0].fp8
    fp8.seeds.update(gather_by_kind(parts, collectives, shard_group))
    return fp8
