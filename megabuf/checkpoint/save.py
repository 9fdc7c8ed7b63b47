"""`save_checkpoint`: every rank writes what it owns into `<path>.tmp/`; rank 0 commits."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megabuf.checkpoint.files import commit, prepare_tmp, sibling, write_file, write_metadata
from megabuf.checkpoint.model_state import owned_model_state, parallel_sizes
from megabuf.checkpoint.torch_optim import torch_optimizer_state
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.param_groups import as_chunks

Chunks = DistributedDataParallel | Sequence[DistributedDataParallel]
AnyOptimizer = MegabufOptimizer | torch.optim.Optimizer


def optimizer_state(
    chunks: Sequence[DistributedDataParallel], optimizer: AnyOptimizer | None
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(common state, this rank's pieces) of a megabuf or plain torch optimizer, in model space."""
    if optimizer is None:
        return None, []
    if isinstance(optimizer, MegabufOptimizer):
        state = optimizer.state_dict()
        return state["common"], state["pieces"]
    return torch_optimizer_state(chunks, optimizer)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: Chunks,
    optimizer: AnyOptimizer | None = None,
    *,
    extra: Any = None,
) -> None:
    """Collective: every rank calls it with the same path (on one shared filesystem).

    `optimizer`: a megabuf optimizer, or a plain torch optimizer over the model's params (the
    all-reduce path), or None. `extra`: any picklable object of the training script (iteration,
    best loss, config, RNG states), stored with the rest and returned by `load_checkpoint`; rank
    0's is kept. See [Note: checkpoint layout] and [Note: checkpoint crash safety].
    """
    with torch.profiler.record_function("megabuf::save_checkpoint"):
        chunks = as_chunks(model)
        collectives = chunks[0].collectives
        final = Path(path)
        rank = dist.get_rank()
        if rank == 0:
            prepare_tmp(final)
        collectives.barrier(None)
        tmp = sibling(final, ".tmp")
        model_state = owned_model_state(chunks)
        common, pieces = optimizer_state(chunks, optimizer)
        record = write_file(
            {"model": model_state, "optimizer": pieces}, tmp / f"rank{rank:05d}.pt", rank
        )
        record["model"] = {k: [list(v.shape), str(v.dtype)] for k, v in model_state.items()}
        record["optimizer_keys"] = sorted({p["key"] for p in pieces})
        everyone = collectives.all_gather_object(record, None)  # also: every file is written
        if rank == 0:
            meta = {
                "world_size": dist.get_world_size(), **parallel_sizes(chunks), "files": everyone,
                "common": write_file(common, tmp / "common.pt", 0),
                "extra": write_file(extra, tmp / "extra.pt", 0) if extra is not None else None,
            }  # fmt: skip
            write_metadata(tmp, meta)
            commit(tmp, final)
        collectives.barrier(None)
