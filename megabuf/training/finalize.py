"""`finalize_model_grads`: everything that must happen to grads between the last backward of a
step and the optimizer step, for one or more model chunks (pipeline stages / virtual chunks).

1. Finish every chunk's data-parallel grad sync (dense over `dp`, experts over `expt_dp`).
2. All-reduce tied word-embedding grads between the first and last pipeline stage (`embd`).
3. With a per-token loss, sum the token count over dp and rescale every grad by it.

[Note: gradient scaling]
Let L = (1/D) sum_r L_r be the loss of the global batch, D = dp_size, L_r the local loss of dp rank
r (each rank's batch is the same size). The grad every optimizer must see is dL/dθ.
- Dense param θ (replicated on all D ranks): rank r holds dL_r/dθ. Summing over `dp` and scaling
  by 1/D gives dL/dθ. So the dense buffers use factor 1/D (or an AVG collective over D ranks).
- Expert param θ_e lives on one rank of each `ep` group (E = ep_size ranks); token dispatch sends
  it the tokens of all E ranks of its group, so that rank holds sum_{r in ep group} dL_r/dθ_e.
  The D/E replicas of θ_e (the `expt_dp` group) cover the D/E ep groups, so summing over
  `expt_dp` yields sum_{all r} dL_r/dθ_e, and the factor must again be 1/D, *not* 1/(D/E).
  With an AVG collective over expt_dp (which divides by D/E) the pre-factor is therefore
  (D/E)/D = 1/E.
Invariant, per buffer: gradient_scaling_factor / (group size if AVG else 1) == 1/D, and
D == E * |expt_dp|. `check_scaling_invariant` asserts it for every buffer of a model.
With a per-token loss (`num_tokens` given) each L_r is a *sum* over its tokens, so the wanted
grad is (1/N) sum_r dL_r/dθ with N the global token count: every grad (already scaled by 1/D as
above) is multiplied by D/N.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor, nn

from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.ddp import DistributedDataParallel, as_model_chunks
from megabuf.transport.devices import params_device


def finalize_model_grads(
    model_chunks: Sequence[DistributedDataParallel], num_tokens: Tensor | None = None
) -> None:
    """Make every chunk's grads final for the optimizer step (see module docstring).

    `num_tokens`: this rank's token count for a per-token (summed) loss, or None for a mean loss.
    With pipelining only the last stage's value counts (it is broadcast over `pp`); pass a tensor
    on every rank or on none.
    """
    chunks = as_model_chunks(model_chunks, "finalize_model_grads()")
    with torch.profiler.record_function("megabuf::finalize_model_grads"):
        for chunk in chunks:
            check_scaling_invariant(chunk)
            chunk.finish_grad_sync()
        allreduce_embedding_grads(chunks)
        if num_tokens is not None:
            scale_by_num_tokens(chunks, num_tokens)


def check_scaling_invariant(model: DistributedDataParallel) -> None:
    """Raise unless every buffer's grads end up averaged over the dense dp group (1/dp_size);
    see [Note: gradient scaling]."""
    pgs = model.process_groups
    dp_size = pgs.dp_size
    ep_size, expt_dp_size = pgs.topology.ep_size, pgs.topology.expt_dp_size
    if model.engine.expert_parallel_buffers and ep_size * expt_dp_size != dp_size:
        raise RuntimeError(
            f"megabuf: ep_size {ep_size} x expt_dp size {expt_dp_size} != dp_size {dp_size} on "
            f"rank {model.engine.rank}; build the groups with ProcessGroups.build(ep_size=...)"
        )
    average = model.ddp_config.average_in_collective
    for buf in _dense_buffers(model) + model.engine.expert_parallel_buffers:
        # averaged over the shard group, then (hybrid) over the replicas too
        reduced_over = buf.dp_size * pgs.topology.dp_replicate_size
        effective = buf.gradient_scaling_factor / (reduced_over if average else 1)
        factors = {b.gradient_scaling_factor for b in buf.buckets} | {buf.gradient_scaling_factor}
        if len(factors) != 1 or not math.isclose(effective, 1.0 / dp_size, rel_tol=1e-12):
            raise RuntimeError(
                f"megabuf: {buf.describe()} on rank {model.engine.rank} scales grads by "
                f"{sorted(factors)} (average_in_collective={average}, reduced over "
                f"{buf.dp_size} ranks): effective {effective:.6g} != 1/dp_size = "
                f"{1.0 / dp_size:.6g}; see [Note: gradient scaling] in megabuf/training/finalize.py"
            )


def _dense_buffers(model: DistributedDataParallel) -> list[_ParamAndGradBuffer]:
    # DistributedDataParallel.buffers (Megatron's name) shadows nn.Module.buffers() for mypy.
    return cast(list[_ParamAndGradBuffer], model.buffers)


def shared_embedding_params(
    chunks: Sequence[DistributedDataParallel],
) -> list[tuple[DistributedDataParallel, nn.Parameter]]:
    """(chunk, param) for every trainable param marked `shared_embedding=True`, chunk order."""
    return [
        (chunk, p)
        for chunk in chunks
        for p in chunk.engine.param_to_name
        if getattr(p, "shared_embedding", False)
    ]


def allreduce_embedding_grads(chunks: Sequence[DistributedDataParallel]) -> None:
    """Sum the grads of tied word embeddings over `embd` (first + last pipeline stage).

    Without the distributed optimizer the whole `main_grad` is summed. With it only this rank's
    shard of the param's bucket holds the dp-reduced grad, so only that slice is summed: the
    param has a bucket of its own (layout `own_bucket`), so the two stages' buckets have the same
    size and padding and dp rank d's shard covers the same elements of the param on both.
    """
    pgs = chunks[0].process_groups
    if pgs.embd is None or pgs.topology.embd_size == 1:
        return
    collectives = chunks[0].engine.collectives
    with torch.profiler.record_function("megabuf::embedding_grad_all_reduce"):
        slices = [_embedding_grad_slice(chunk, p) for chunk, p in shared_embedding_params(chunks)]
        # An empty slice is empty on both stages (same bucket shape), so skipping it is symmetric.
        pending = [collectives.all_reduce(s, pgs.embd) for s in slices if s.numel() > 0]
        for work in pending:
            work.wait()


def _embedding_grad_slice(chunk: DistributedDataParallel, param: nn.Parameter) -> Tensor:
    """The part of `param`'s grad that is meaningful on this rank after finish_grad_sync."""
    if not chunk.ddp_config.sharding.shards_optimizer:
        return param.main_grad  # type: ignore[attr-defined,no-any-return]
    for buf in _dense_buffers(chunk):
        if param not in buf.param_index_map:
            continue
        slot = buf.param_index_map[param]
        start, end, bucket_id = slot.start, slot.end, slot.bucket_id
        bucket = buf.layout.buckets[bucket_id]
        if bucket.start != start or len(bucket.param_ids) != 1:
            raise RuntimeError(
                f"megabuf: shared embedding {chunk.engine.param_to_name[param]!r} does not own its "
                f"bucket on rank {chunk.engine.rank}; its shard would not line up with the other "
                "pipeline stage's. Keep `shared_embedding=True` set before wrapping"
            )
        lo, hi = buf.shard_range(bucket_id)
        return buf.reduced_grad(max(lo, start), max(min(hi, end), max(lo, start)))
    raise RuntimeError(
        f"megabuf: shared embedding {chunk.engine.param_to_name[param]!r} is in no dense buffer "
        f"on rank {chunk.engine.rank}; tied embeddings must not be marked expert-parallel"
    )


def scale_by_num_tokens(chunks: Sequence[DistributedDataParallel], num_tokens: Tensor) -> None:
    """Broadcast the last stage's token count over `pp`, sum it over `dp`, and scale all grads
    by dp_size / total (see [Note: gradient scaling])."""
    pgs = chunks[0].process_groups
    collectives = chunks[0].engine.collectives
    if num_tokens.numel() != 1:
        raise ValueError(f"megabuf: num_tokens must hold one number, got shape {num_tokens.shape}")
    params = (p for chunk in chunks for p in chunk.engine.param_to_name)
    device = params_device(params, pgs.dp)  # [Note: allocation device]
    total = num_tokens.detach().reshape(1).to(device=device, dtype=torch.float64, copy=True)
    if pgs.pp_size > 1:
        collectives.broadcast(total, pgs.pp_size - 1, pgs.pp)
    collectives.all_reduce(total, pgs.dp, async_op=False)
    count = float(total.item())
    if count <= 0:
        raise ValueError(
            f"megabuf: finalize_model_grads() got {count} tokens in total over dp on rank "
            f"{pgs.topology.rank}; a per-token loss needs at least one token"
        )
    for chunk in chunks:
        chunk.scale_gradients(pgs.dp_size / count)
