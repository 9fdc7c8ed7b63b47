"""`load_checkpoint`: read what this rank needs, verified, and reshard it in model space."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from megabuf.checkpoint.files import find_checkpoint, read_file, read_metadata
from megabuf.checkpoint.model_state import (
    check_model_entries,
    check_parallel_sizes,
    expected_model_entries,
)
from megabuf.checkpoint.save import AnyOptimizer, Chunks
from megabuf.checkpoint.torch_optim import (
    check_torch_common,
    load_torch_optimizer_state,
    needed_keys,
)
from megabuf.collectives import Collectives
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.model_space import check_common
from megabuf.optimizer.param_groups import as_chunks

T = TypeVar("T")


def _agreed(collectives: Collectives, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raised a ValueError anywhere, raise on every rank (this
    rank's own message, else the first failing rank's), so no rank is left waiting in the
    collectives of the model load."""
    try:
        result, error = fn(), None
    except ValueError as exc:
        result, error = None, str(exc)
    errors = collectives.all_gather_object(error, None)
    if error is not None:
        raise ValueError(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"megabuf: load_checkpoint failed on rank {rank}: {message}")
    return result  # type: ignore[return-value]


def _needed_optimizer_keys(
    chunks: Sequence[DistributedDataParallel], optimizer: AnyOptimizer | None
) -> set[str]:
    if optimizer is None:
        return set()
    if isinstance(optimizer, MegabufOptimizer):
        return {mp.key for mp in optimizer.main_params}
    return needed_keys(chunks, optimizer)


def _read(
    root: Path, chunks: Sequence[DistributedDataParallel], optimizer: AnyOptimizer | None
) -> dict[str, Any]:
    """Everything this rank loads, verified; raises ValueError naming what does not fit."""
    root = find_checkpoint(root)
    meta = read_metadata(root)
    check_parallel_sizes(root, meta, chunks)
    expected = expected_model_entries(chunks)
    saved = {k: (v, rec) for rec in meta["files"] for k, v in rec["model"].items()}
    check_model_entries(root, expected, {k: v for k, (v, _) in saved.items()})
    needed_opt = _needed_optimizer_keys(chunks, optimizer)
    records = {saved[k][1]["file"]: saved[k][1] for k in expected}
    records |= {r["file"]: r for r in meta["files"] if needed_opt & set(r["optimizer_keys"])}
    loaded = {name: read_file(root, rec) for name, rec in sorted(records.items())}
    model = [
        {local: loaded[saved[key][1]["file"]]["model"][key]
         for key, (ci, local, _) in expected.items() if ci == i}
        for i in range(len(chunks))
    ]  # fmt: skip
    pieces = [p for f in loaded.values() for p in f["optimizer"] if p["key"] in needed_opt]
    common = read_file(root, meta["common"]) if optimizer is not None else None
    if optimizer is not None and common is None:  # (saved without one)
        raise ValueError(f"megabuf: checkpoint {root} was saved without an optimizer")
    if isinstance(optimizer, MegabufOptimizer) and common is not None:  # before loading
        check_common(optimizer.parts(), common)
    elif optimizer is not None:
        check_torch_common(optimizer, common)
    extra = None
    if meta.get("extra") is not None:  # the caller's own objects: unpickled in full
        extra = read_file(root, meta["extra"], weights_only=False)
    return {"model": model, "common": common, "pieces": pieces, "extra": extra}


def load_checkpoint(
    path: str | os.PathLike[str], model: Chunks, optimizer: AnyOptimizer | None = None
) -> Any:
    """Collective. Load into a freshly built model (and optimizer) at any dp size, bucket size
    and overlap setting, all-reduce or distributed optimizer alike; returns the `extra` given to
    `save_checkpoint` (None if none). Which directory is read when a save was interrupted: see
    [Note: checkpoint crash safety]. Raises a ValueError on every rank naming what does not fit
    (entries, optimizer params, pp / ep sizes) or which file is damaged and which rank wrote it.
    `extra` is unpickled in full: load only checkpoints you trust."""
    with torch.profiler.record_function("megabuf::load_checkpoint"):
        chunks = as_chunks(model)
        data = _agreed(chunks[0].collectives, lambda: _read(Path(path), chunks, optimizer))
        for chunk, entries in zip(chunks, data["model"], strict=True):
            chunk.load_state_dict(entries, strict=True)  # the model before the optimizer
        if isinstance(optimizer, MegabufOptimizer):
            optimizer.load_state_dict({"common": data["common"], "pieces": data["pieces"]})
        elif optimizer is not None:
            load_torch_optimizer_state(chunks, optimizer, data["common"], data["pieces"])
        return data["extra"]
