"""`save_checkpoint`: every rank hands what it owns to torch.distributed.checkpoint (DCP), into
`<path>.tmp/`; then each rank records its files' checksums and rank 0 commits.

[Note: asynchronous checkpoint saves]
`save_checkpoint(..., async_save=True)` returns once the state is copied (DCP stages it into CPU
memory) and DCP writes it from a background thread over a gloo group of its own (made once per
process group, so it never shares a communicator with training's collectives); each rank's files
are hashed in that thread once written. The save is committed (records gathered, metadata.json
written, directory swapped into place) by `handle.wait()`, which every rank must call; the next
`save_checkpoint` or `load_checkpoint` in the process calls it first, and so does
`megabuf.checkpoint.wait_for_pending_save()`, and at exit ([Note: a save in flight at exit]).
Until then `<path>` still holds the previous checkpoint ([Note: checkpoint crash safety]). A
synchronous save returns a handle already done.

[Note: a save in flight at exit]
A script that ends without waiting for its last asynchronous save (nanoGPT's loop saves, trains
on and ends) would lose it: DCP's thread finishes writing into `<path>.tmp/`, but nothing
commits it. So `finish_at_exit` runs at exit (`atexit`: after the interpreter joined DCP's
thread, before teardown, the interpreter whole): while torch.distributed is still initialised it
commits every save in flight (collective, as `handle.wait()`: every rank ends its script the
same way); after `destroy_process_group()` it can only say on stderr that the save was not
committed and `<path>` keeps the previous checkpoint. Either way the side gloo group is released
then, not in teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megabuf.checkpoint.dcp_state import (
    optimizer_dcp_state,
    partial_ranges,
    quiet_sharded_tensor,
    ranges_from,
)
from megabuf.checkpoint.files import (
    FileRecord,
    commit,
    hash_written,
    prepare_tmp,
    sibling,
    write_file,
    write_metadata,
)
from megabuf.checkpoint.hook_state import HookIndex, agreed_hook_index, gathered_hook_state
from megabuf.checkpoint.model_state import owned_model_state, parallel_sizes
from megabuf.checkpoint.torch_optim import (
    RANK0_COMMON,
    common_file,
    coordinate,
    torch_optimizer_state,
)
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.param_groups import as_chunks
from megabuf.transport.collectives import Collectives

Chunks = DistributedDataParallel | Sequence[DistributedDataParallel]
AnyOptimizer = MegabufOptimizer | torch.optim.Optimizer


class SaveHandle:
    """A save in flight; `wait()` (collective) finishes and commits it. See
    [Note: asynchronous checkpoint saves]."""

    def __init__(
        self,
        finish: Callable[[], None] | None,
        path: Path | None = None,
        written: Callable[[], object] | None = None,
    ) -> None:
        self._finish = finish
        self.path = path  # where the save commits
        self._written = written  # waits for this rank's writing, commits nothing

    def written(self) -> None:
        """Wait for this rank's files (DCP's thread done), without committing (not collective)."""
        if self._written is not None:
            with contextlib.suppress(Exception):  # the write's error is the commit's to raise
                self._written()

    @property
    def done(self) -> bool:
        return self._finish is None

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


# model chunk 0 -> its save in flight (weak: dies with the model); id of the default process
# group -> the gloo group asynchronous saves use (one per process group, made at first use)
_PENDING: weakref.WeakKeyDictionary[DistributedDataParallel, SaveHandle] = (
    weakref.WeakKeyDictionary()
)
_GROUPS: dict[int, Any] = {}


def finish_at_exit() -> None:
    """Run by `atexit`: [Note: a save in flight at exit]."""
    if dist.is_initialized():
        try:
            wait_for_pending_save()
        except Exception as exc:  # atexit: say it and let the process end
            print(f"megabuf: the asynchronous checkpoint save in flight at exit failed: {exc}",
                  file=sys.stderr)  # fmt: skip
    for chunk in list(_PENDING):
        handle = _PENDING.pop(chunk, None)
        if handle is not None and not handle.done:
            handle.written()
            print(f"megabuf: the asynchronous checkpoint save to {handle.path} was written but "
                  "not committed: torch.distributed was shut down before handle.wait() (or "
                  "megabuf.checkpoint.wait_for_pending_save()); that path keeps the previous "
                  "checkpoint. Wait for the save before destroy_process_group()",
                  file=sys.stderr)  # fmt: skip
    _GROUPS.clear()


atexit.register(finish_at_exit)


def wait_for_pending_save() -> None:
    """Collective: finish every asynchronous save in flight in this process (save_checkpoint
    and load_checkpoint call it first)."""
    for chunk in list(_PENDING):
        handle = _PENDING.pop(chunk, None)
        if handle is not None:
            handle.wait()


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
    async_save: bool = False,
) -> SaveHandle:
    """Collective: every rank calls it with the same path (on one shared filesystem).

    `optimizer`: a megabuf optimizer, a plain torch optimizer over the model's params (the
    all-reduce path), or None. `extra`: any picklable object of the training script (iteration,
    best loss, config, RNG states), stored with the rest and returned by `load_checkpoint`; rank
    0's is kept. `async_save`: see [Note: asynchronous checkpoint saves]. Layout, guarantees:
    [Note: checkpoint layout], [Note: checkpoint crash safety]. The state of every registered
    comm hook with `state_dict()` is saved too, in param space ([Note: comm hook state in
    checkpoints]); a hook state holding anything but tensors, numbers and strings, or replicated
    values that differ across ranks, raises a ValueError on every rank, before DCP writes
    (the checkpoint already at `path` stays).
    """
    with torch.profiler.record_function("megabuf::save_checkpoint"):
        chunks = as_chunks(model)
        wait_for_pending_save()
        collectives, rank = chunks[0].engine.collectives, Collectives.rank()
        final = Path(path)
        tmp = sibling(final, ".tmp")
        if rank == 0:
            prepare_tmp(final)
        model_state = owned_model_state(chunks)  # collective with the distributed optimizer
        common, pieces = optimizer_state(chunks, optimizer)
        if chunks[0].process_groups.topology.dp_replicate_rank != 0:
            pieces = []  # replica 0 saves the same shards ([Note: hybrid checkpoints])
        hook_entries, hook_record = gathered_hook_state(chunks)
        own: list[FileRecord] = []
        if rank == 0:  # rank 0's own files first: `extra` as it is now
            own.append(write_file(common, tmp / RANK0_COMMON, 0))
            if extra is not None:
                own.append(write_file(extra, tmp / "extra.pt", 0))
        # a plain torch optimizer's common state differs by stage and ep rank
        coord = _torch_common(chunks, optimizer)
        # also: rank 0 has made tmp before any rank writes into it (here and DCP, below)
        everyone = collectives.all_gather_object(
            _rank_index(model_state, pieces, hook_record, coord), None
        )
        if coord is not None and coord[1] != RANK0_COMMON:
            own.append(write_file(common, tmp / coord[1], rank))
        hooks = agreed_hook_index([index["comm_hooks"] for index in everyone])
        ranges = ranges_from([index["ranges"] for index in everyone])
        state = {"model": model_state, "optimizer": optimizer_dcp_state(pieces, ranges)}
        if hook_entries:  # [Note: comm hook state in checkpoints]
            state["comm_hooks"] = hook_entries
        writer = dcp.FileSystemWriter(tmp)
        with quiet_sharded_tensor():
            if not async_save:
                dcp.save(state, storage_writer=writer)
                _commit(chunks, final, tmp, everyone, hooks, own + hash_written(tmp, rank))
                return SaveHandle(None)  # done
            saving = dcp.async_save(state, storage_writer=writer, process_group=_checkpoint_group())
        written = saving if isinstance(saving, Future) else saving.upload_completion
        hashed = _hash_when_written(written, tmp, rank)
        handle = SaveHandle(
            lambda: _commit(chunks, final, tmp, everyone, hooks, own + hashed.result()),
            final, hashed.result,
        )  # fmt: skip
        _PENDING[chunks[0]] = handle
        return handle


def _torch_common(
    chunks: Sequence[DistributedDataParallel], optimizer: AnyOptimizer | None
) -> tuple[str, str] | None:
    """(coordinate, file) of the torch optimizer common state this rank writes, if it does:
    [Note: torch optimizer state in checkpoints]."""
    if optimizer is None or isinstance(optimizer, MegabufOptimizer):
        return None
    name = common_file(chunks)
    return None if name is None else (coordinate(chunks), name)


def _rank_index(
    model_state: dict[str, Any],
    pieces: list[dict[str, Any]],
    hooks: dict[str, Any],
    torch_common: tuple[str, str] | None,
) -> dict[str, Any]:
    """What this rank saves, for metadata.json and for the ShardedTensors' shard lists."""
    return {
        "ranges": partial_ranges(pieces),
        "model": {k: [list(v.shape), str(v.dtype)] for k, v in model_state.items()},
        "optimizer": {p["key"]: [p["numel"], p["shape"]] for p in pieces},
        "comm_hooks": hooks,
        "torch_common": torch_common,
    }


def _hash_when_written(written: Future[Any], tmp: Path, rank: int) -> Future[list[FileRecord]]:
    """This rank's file records, hashed in DCP's background thread once its write is done (the
    result re-raises the write's error)."""
    hashed: Future[list[FileRecord]] = Future()

    def on_written(done: Future[Any]) -> None:
        try:
            done.result()
            hashed.set_result(hash_written(tmp, rank))
        except BaseException as exc:  # handed to whoever waits for the save
            hashed.set_exception(exc)

    written.add_done_callback(on_written)
    return hashed


def _checkpoint_group() -> Any:
    world = id(dist.group.WORLD)
    if world not in _GROUPS:
        _GROUPS[world] = dist.new_group(backend="gloo")  # collective: every rank saves
    return _GROUPS[world]


def _commit(
    chunks: Sequence[DistributedDataParallel],
    final: Path,
    tmp: Path,
    everyone: list[dict[str, Any]],
    hooks: HookIndex,
    records: list[FileRecord],
) -> None:
    """Complete a save once DCP has written: gather every rank's file records, rank 0 writes
    metadata.json and swaps the directory into place ([Note: checkpoint crash safety])."""
    collectives, rank = chunks[0].engine.collectives, Collectives.rank()
    everyone_records = collectives.all_gather_object(records, None)
    if rank == 0:
        write_metadata(tmp, {**_index(chunks, everyone, everyone_records), "comm_hooks": hooks})
        commit(tmp, final)
    collectives.barrier(None)


def _index(
    chunks: Sequence[DistributedDataParallel],
    everyone: list[dict[str, Any]],
    records: list[list[FileRecord]],
) -> dict[str, Any]:
    files = [r for per_rank in records for r in per_rank]
    names = {r["file"] for r in files}
    torch_commons = dict(index["torch_common"] for index in everyone if index["torch_common"])
    return {
        "world_size": Collectives.size(), **parallel_sizes(chunks), "files": files,
        "model": {k: v for index in everyone for k, v in index["model"].items()},
        "optimizer": {k: v for index in everyone for k, v in index["optimizer"].items()},
        "common": RANK0_COMMON, "extra": "extra.pt" if "extra.pt" in names else None,
        **({"torch_commons": torch_commons} if torch_commons else {}),
    }  # fmt: skip
