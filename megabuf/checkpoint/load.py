"""`load_checkpoint`: check that the model fits, verify the files, and let DCP fill exactly
the ranges this rank steps (see [Note: checkpoint state in DCP])."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp

from megabuf.checkpoint.dcp_state import (
    loaded_state,
    optimizer_template,
    quiet_sharded_tensor,
    ranges_from,
    replica_ranges,
    saved_layout,
    saved_optimizer_entries,
    wanted_ranges,
)
from megabuf.checkpoint.files import (
    DCP_METADATA,
    find_checkpoint,
    read_file,
    read_metadata,
    verify_file,
)
from megabuf.checkpoint.hook_load import hook_template, load_hook_states, plan_hook_load
from megabuf.checkpoint.model_state import (
    check_model_entries,
    check_parallel_sizes,
    expected_model_entries,
    model_template,
    recast_fp8,
    take_fp8_entries,
)
from megabuf.checkpoint.save import AnyOptimizer, Chunks, wait_for_pending_save
from megabuf.checkpoint.torch_optim import (
    expected_torch_layouts,
    load_torch_optimizer_state,
    plan_torch_load,
)
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.model_space import check_common, expected_layouts
from megabuf.optimizer.param_groups import as_chunks
from megabuf.optimizer.state_layout import describe_layout_problems, layout_problems
from megabuf.transport.collectives import Collectives

T = TypeVar("T")
Wanted = list[tuple[str, int, int, int]]  # (key, start, end, numel of the param)


def _agreed(collectives: Collectives, fn: Callable[[], T]) -> T:
    """Run `fn` on every rank; if it raised a ValueError anywhere, raise on every rank (this
    rank's own message, else the first failing rank's), so no rank is left waiting in the
    collectives of the load."""
    cause: Exception | None = None
    try:
        result, error = fn(), None
    except ValueError as exc:
        result, error, cause = None, str(exc), exc
    except Exception as exc:  # anything else too: the other ranks must not be left waiting
        result, cause = None, exc
        error = f"megabuf: rank {Collectives.rank()}: {type(exc).__name__}: {exc}"
    errors = collectives.all_gather_object(error, None)
    if error is not None:
        raise ValueError(error) from cause
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        raise ValueError(f"megabuf: load_checkpoint failed on rank {rank}: {message}")
    return result  # type: ignore[return-value]


def _wanted(optimizer: MegabufOptimizer) -> Wanted:
    return [
        (mp.key, mp.param_start, mp.param_end, mp.model_param.numel())
        for mp in optimizer.main_params
    ]


def _record(meta: dict[str, Any], name: str) -> dict[str, Any]:
    return next(r for r in meta["files"] if r["file"] == name)


def _check(
    root: Path,
    chunks: Sequence[DistributedDataParallel],
    optimizer: Any,
    strict_hooks: bool,
    strict_optimizer: bool,
) -> dict:
    """Everything that can be checked before DCP reads: raises ValueError naming the misfit."""
    root = find_checkpoint(root)
    meta = read_metadata(root)
    check_parallel_sizes(root, meta, chunks)
    check_model_entries(root, expected_model_entries(chunks), meta["model"])
    hooks = plan_hook_load(chunks, meta.get("comm_hooks", {}), root, strict_hooks)
    wanted: Wanted = []
    if isinstance(optimizer, MegabufOptimizer):
        wanted = _wanted(optimizer)
        missing = sorted({w[0] for w in wanted} - set(meta["optimizer"]))
        if missing:
            raise ValueError(
                f"megabuf: checkpoint {root} holds no optimizer state for params {missing[:10]} "
                f"(rank {Collectives.rank()}): saved without an optimizer, or for another model"
            )
    rank, world = Collectives.rank(), Collectives.size()
    for i, record in enumerate(meta["files"]):  # every file is verified by one rank
        if i % world == rank:
            verify_file(root, record)
    common = None
    if optimizer is not None:
        common = read_file(root, _record(meta, meta["common"]))  # rank 0's
        if common is None:
            raise ValueError(f"megabuf: checkpoint {root} was saved without an optimizer")
        if isinstance(optimizer, MegabufOptimizer):
            check_common(optimizer.parts(), common)
        else:  # [Note: torch optimizer state in checkpoints]
            rank0 = common

            def read(name: str) -> Any:
                return rank0 if name == meta["common"] else read_file(root, _record(meta, name))

            common, wanted = plan_torch_load(chunks, optimizer, meta, read, strict_optimizer)
    extra = None
    if meta.get("extra") is not None:  # the caller's own objects: unpickled in full
        extra = read_file(root, _record(meta, meta["extra"]), weights_only=False)
    verify_file(root, _record(meta, DCP_METADATA))  # every rank reads it next
    dcp_meta = dcp.FileSystemReader(root).read_metadata()
    if optimizer is not None:
        _check_layouts(chunks, optimizer, wanted, saved_optimizer_entries(dcp_meta), common)
    return {
        "root": root, "wanted": wanted, "common": common, "extra": extra, "dcp": dcp_meta,
        "hooks": hooks, "saved_hooks": bool(meta.get("comm_hooks")),
        "same_world": meta["world_size"] == Collectives.size(),
    }  # fmt: skip


def _check_layouts(
    chunks: Sequence[DistributedDataParallel],
    optimizer: AnyOptimizer,
    wanted: Wanted,
    saved: dict[str, dict[str, Any]],
    common: dict[str, Any] | None,
) -> None:
    """The saved state of every param this rank loads has the layout this optimizer keeps,
    whatever class saved it: [Note: optimizer state layout]."""
    if isinstance(optimizer, MegabufOptimizer):
        expected = expected_layouts(optimizer.parts())
    else:
        expected = expected_torch_layouts(chunks, optimizer)
    problems = {
        key: layout_problems(saved_layout(saved.get(key, {}), numel), expected[key])
        for key, _, _, numel in wanted
    }
    if any(problems.values()):
        saved_by = (common or {}).get("optimizer_class")
        raise ValueError(
            f"megabuf: the optimizer state saved by {saved_by} does not fit this optimizer "
            f"({type(optimizer).__name__}, rank {Collectives.rank()}): "
            f"{describe_layout_problems(problems)}. Build the optimizer the checkpoint was "
            "saved with (the implementation may differ, the math may not)"
        )


def load_checkpoint(
    path: str | os.PathLike[str],
    model: Chunks,
    optimizer: AnyOptimizer | None = None,
    *,
    strict_comm_hooks: bool = True,
    strict_optimizer: bool = True,
) -> Any:
    """Collective. Load into a freshly built model (and optimizer) at any dp size, bucket size
    and overlap setting, all-reduce or distributed optimizer alike (not across pp / ep sizes);
    returns the `extra` given to `save_checkpoint` (None if none). Which directory is read when a
    save was interrupted: [Note: checkpoint crash safety]. Raises a ValueError on every rank
    naming what does not fit (entries, optimizer params, pp / ep sizes) or which file is damaged
    and which rank wrote it. `extra` is unpickled in full: load only checkpoints you trust.

    Comm hook state ([Note: comm hook state in checkpoints]): register the model's hooks
    before calling it; each stateful hook gets its saved state. With `strict_comm_hooks`
    (default) it raises, naming the hook and its buffers, where the checkpoint holds hook state
    and the model has no stateful hook there, where the hook's class differs, and where the model
    has a stateful hook and the checkpoint no state for it (e.g. saved before the hook was
    added). `strict_comm_hooks=False` warns instead: saved state without a matching hook is
    dropped, and a hook without matching saved state keeps its initial state. A hook that
    refuses its state (a layout it is tied to changed, per-rank state it cannot merge at
    another dp size) raises either way.

    Plain torch optimizers ([Note: torch optimizer state in checkpoints]): with
    `strict_optimizer` (default; torch's `strict`, DCP's `allow_partial_load=False`) a rank
    whose params' optimizer state or param groups are missing from the checkpoint (a pipeline
    stage or ep rank it does not hold) raises naming the params, the stage / ep rank and the
    rank. `strict_optimizer=False` warns instead and those params start with fresh state (and
    the hyperparameters the optimizer was built with). A megabuf optimizer's state is always
    required in full."""
    with torch.profiler.record_function("megabuf::load_checkpoint"):
        chunks = as_chunks(model)
        wait_for_pending_save()
        collectives = chunks[0].engine.collectives
        found = _agreed(
            collectives,
            lambda: _check(Path(path), chunks, optimizer, strict_comm_hooks, strict_optimizer),
        )
        merged = False
        if found["saved_hooks"]:  # the same on every rank: one metadata.json
            own = found["same_world"] and all(p.own(Collectives.rank()) for p in found["hooks"])
            merged = not all(collectives.all_gather_object(own, None))
        hook_state = hook_template(found["hooks"], merged)
        wanted: Wanted = found["wanted"]
        replica = chunks[0].process_groups.topology.dp_replicate_rank
        everyone = collectives.all_gather_object((replica, wanted_ranges(wanted)), None)
        ranges = ranges_from(replica_ranges(everyone, replica))
        opt_template, locals_ = optimizer_template(
            wanted, saved_optimizer_entries(found["dcp"]), ranges
        )
        per_chunk, keyed = model_template(chunks)
        with quiet_sharded_tensor():
            state = {"model": keyed, "optimizer": opt_template}
            if hook_state:
                state["comm_hooks"] = hook_state
            dcp.load(state, storage_reader=dcp.FileSystemReader(found["root"]))
        # the hooks first: one refusing its state leaves the model as it was
        _agreed(collectives, lambda: load_hook_states(found["hooks"], hook_state, merged))
        for chunk, entries in zip(chunks, per_chunk, strict=True):
            fp8 = take_fp8_entries(chunk, entries)  # [Note: FP8 params in checkpoints]
            chunk.load_state_dict(entries, strict=not fp8)  # the model before the optimizer
        pieces = [
            {"key": key, "start": start, "end": end, "numel": numel, "shape": [numel],
             "state": loaded_state(opt_template, locals_, key)}
            for key, start, end, numel in wanted
        ]  # fmt: skip
        if isinstance(optimizer, MegabufOptimizer):
            optimizer.load_state_dict({"common": found["common"], "pieces": pieces})
        elif optimizer is not None:
            load_torch_optimizer_state(chunks, optimizer, found["common"], pieces)
        recast_fp8(chunks)  # [Note: FP8 params in checkpoints]
        return found["extra"]
