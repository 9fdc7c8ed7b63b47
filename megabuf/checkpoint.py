"""`save_checkpoint` / `load_checkpoint`: model and optimizer state in model space, one file per
rank plus metadata, resumable at another data-parallel size or bucket size.

[Note: checkpoint layout]
    <path>/metadata.json   index: which file holds which model entries and optimizer pieces
    <path>/common.pt       rank-independent optimizer state (class, param groups, loss scale)
    <path>/rank00000.pt    {"model": {key: tensor}, "optimizer": [pieces]} for each global rank
Model entries (params, frozen params, module buffers) are written once per replica set: dense
entries by dp rank 0 of each pipeline stage, expert entries by expt_dp rank 0. Optimizer pieces
are ranges of flattened params (see [Note: model-space optimizer state]), so any dp size and any
bucket layout can load them. Keys carry the pipeline stage / ep rank when those are > 1 (see
`model_space_keys`), so pp and ep sizes must match between save and load.

Atomicity: every rank writes into `<path>.tmp/`; after all ranks are done, rank 0 writes the
metadata and swaps the directory into place, so `<path>` is either the old complete checkpoint or
the new complete one. All ranks must see one shared filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.model_space import assemble_range
from megabuf.optimizer.param_groups import as_chunks, scope_prefix
from megabuf.replicas import is_expert_parallel

FORMAT = "megabuf-checkpoint-v1"
Chunks = DistributedDataParallel | Sequence[DistributedDataParallel]


def save_checkpoint(
    path: str | os.PathLike[str], model: Chunks, optimizer: MegabufOptimizer | None = None
) -> None:
    """Collective: every rank calls it with the same path. See [Note: checkpoint layout]."""
    with torch.profiler.record_function("megabuf::save_checkpoint"):
        chunks = as_chunks(model)
        collectives = chunks[0].collectives
        final = Path(path)
        tmp = final.with_name(final.name + ".tmp")
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        collectives.barrier(None)
        model_state = _owned_model_state(chunks)
        opt_state = optimizer.state_dict() if optimizer is not None else None
        pieces = opt_state["pieces"] if opt_state is not None else []
        fname = f"rank{rank:05d}.pt"
        _atomic_save({"model": model_state, "optimizer": pieces}, tmp / fname)
        index = {
            "file": fname,
            "model": {k: [list(v.shape), str(v.dtype)] for k, v in model_state.items()},
            "optimizer_keys": sorted({p["key"] for p in pieces}),
        }
        everyone = collectives.all_gather_object(index, None)  # also: every file is written
        if rank == 0:
            common = opt_state["common"] if opt_state is not None else None
            _atomic_save(common, tmp / "common.pt")
            meta = {"format": FORMAT, "world_size": dist.get_world_size(), "files": everyone}
            (tmp / "metadata.json").write_text(json.dumps(meta, indent=1))
            _swap_into_place(tmp, final)
        collectives.barrier(None)


def load_checkpoint(
    path: str | os.PathLike[str], model: Chunks, optimizer: MegabufOptimizer | None = None
) -> None:
    """Load into a freshly built model (and optimizer) at any dp size / bucket size. Raises a
    ValueError naming every model entry or optimizer param that does not match."""
    with torch.profiler.record_function("megabuf::load_checkpoint"):
        root = Path(path)
        meta = _read_metadata(root)
        chunks = as_chunks(model)
        expected = _expected_model_entries(chunks)
        saved = {k: (v, f["file"]) for f in meta["files"] for k, v in f["model"].items()}
        _check_model_entries(root, expected, {k: v for k, (v, _) in saved.items()})
        needed_opt = {mp.key for mp in optimizer.main_params} if optimizer is not None else set()
        files = sorted(
            {saved[k][1] for k in expected}
            | {f["file"] for f in meta["files"] if needed_opt & set(f["optimizer_keys"])}
        )
        loaded = {f: torch.load(root / f, mmap=True, weights_only=True) for f in files}
        for i, chunk in enumerate(chunks):
            entries = {
                local: loaded[saved[key][1]]["model"][key]
                for key, (ci, local, _) in expected.items()
                if ci == i
            }
            chunk.load_state_dict(entries, strict=True)
        if optimizer is not None:
            common = torch.load(root / "common.pt", weights_only=True)
            if common is None:
                raise ValueError(f"megabuf: checkpoint {root} was saved without an optimizer")
            pieces = [p for f in files for p in loaded[f]["optimizer"] if p["key"] in needed_opt]
            optimizer.load_state_dict({"common": common, "pieces": pieces})


def consolidated_optimizer_state(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Offline, no process group needed: every param's main param (`"main"`) and optimizer
    state, reassembled from all ranks' pieces into param-shaped tensors, keyed by the
    checkpoint's param keys. For inspection, export, or conversion to another framework."""
    root = Path(path)
    meta = _read_metadata(root)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for entry in meta["files"]:
        for piece in torch.load(root / entry["file"], weights_only=True)["optimizer"]:
            by_key.setdefault(piece["key"], []).append(piece)
    out: dict[str, dict[str, Any]] = {}
    for key, pieces in by_key.items():
        numel, shape = pieces[0]["numel"], pieces[0]["shape"]
        state = assemble_range(key, 0, numel, pieces)
        out[key] = {
            name: v.view(shape) if isinstance(v, Tensor) and v.numel() == numel else v
            for name, v in state.items()
        }
    return out


# ---- model state ------------------------------------------------------------------------------
def _entry_scopes(chunks: Sequence[DistributedDataParallel]) -> list[dict[str, tuple[str, bool]]]:
    """Per chunk: local state_dict name -> (checkpoint key, expert?)."""
    result = []
    for i, chunk in enumerate(chunks):
        expert_names = {
            n for n, p in chunk.module.named_parameters(remove_duplicate=False)
            if is_expert_parallel(p)
        }  # fmt: skip
        scoped = {}
        for name in chunk.module.state_dict(keep_vars=True):
            expert = name in expert_names
            scoped[name] = (scope_prefix(chunk, i, len(chunks), expert) + name, expert)
        result.append(scoped)
    return result


def _owned_model_state(chunks: Sequence[DistributedDataParallel]) -> dict[str, Tensor]:
    """Entries this rank writes: dense ones on dp rank 0, expert ones on expt_dp rank 0."""
    state: dict[str, Tensor] = {}
    for chunk, scoped in zip(chunks, _entry_scopes(chunks), strict=True):
        pgs = chunk.process_groups
        writes_dense, writes_expert = dist.get_rank(pgs.dp) == 0, dist.get_rank(pgs.expt_dp) == 0
        values = chunk.state_dict()  # publishes params first
        for name, (key, expert) in scoped.items():
            if writes_expert if expert else writes_dense:
                state[key] = values[name].detach().clone()  # a view would save its whole buffer
    return state


def _expected_model_entries(
    chunks: Sequence[DistributedDataParallel],
) -> dict[str, tuple[int, str, list[Any]]]:
    """checkpoint key -> (chunk index, local name, [shape, dtype]) for everything to load."""
    out = {}
    for i, (chunk, scoped) in enumerate(zip(chunks, _entry_scopes(chunks), strict=True)):
        values = chunk.module.state_dict(keep_vars=True)
        for name, (key, _) in scoped.items():
            out[key] = (i, name, [list(values[name].shape), str(values[name].dtype)])
    return out


def _check_model_entries(
    root: Path, expected: dict[str, tuple[int, str, list[Any]]], saved: dict[str, list[Any]]
) -> None:
    missing = sorted(set(expected) - set(saved))
    wrong = [
        f"{key}: saved {saved[key][0]} {saved[key][1]}, model has {want[0]} {want[1]}"
        for key, (_, _, want) in expected.items()
        if key in saved and saved[key] != want
    ]
    if missing or wrong:
        raise ValueError(
            f"megabuf: checkpoint {root} does not fit the model (rank {dist.get_rank()}): "
            f"missing entries {missing[:10]}, mismatched entries {wrong[:10]}. Build the same "
            "model (and the same pipeline / expert-parallel sizes) as when it was saved"
        )


# ---- files ------------------------------------------------------------------------------------
def _atomic_save(obj: Any, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    torch.save(obj, partial)
    os.replace(partial, target)


def _swap_into_place(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def _read_metadata(root: Path) -> dict[str, Any]:
    meta_path = root / "metadata.json"
    if not meta_path.exists():
        raise ValueError(
            f"megabuf: {root} has no metadata.json: not a megabuf checkpoint, or its save was "
            "interrupted (a complete save is swapped into place only when finished)"
        )
    meta: dict[str, Any] = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"megabuf: {meta_path} has format {meta.get('format')!r}, not {FORMAT!r}")
    return meta
