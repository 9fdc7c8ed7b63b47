"""The state dicts handed to torch.distributed.checkpoint (DCP), in model space.

[Note: checkpoint state in DCP]
What every rank hands to `dcp.save` holds only what it owns:
    {"model": {key: tensor},                      entries this rank writes (see model_state.py)
     "optimizer": {key: {name: value}}}           this rank's optimizer state per param key
`key` is the model-space key (the param's state_dict name, prefixed by stage / chunk / ep rank
when those exist: `model_space_keys`). An optimizer value is
- a piece of a flattened param ([start, end) of numel elements, the distributed optimizer's
  shard pieces): a 1-D ShardedTensor of global size [numel] whose one local shard is the piece.
  DCP records each piece as a chunk of that flat tensor and, at load, copies into each rank's
  requested chunk the overlapping parts of the saved chunks: DCP's own resharding;
- a whole param's state (non-sharded optimizers, plain torch optimizers, or a param that fell
  into one rank's shard): a plain tensor, 1-D [numel] for megabuf optimizers;
- a per-param scalar (Adam's `step`) or a non-elementwise tensor: a plain tensor, written once
  (DCP de-duplicates values that several ranks hand over under the same key);
- anything else (a Python number): pickled by DCP.
So `dcp_to_torch_save` turns the directory into one file holding `{"model": {name: param},
"optimizer": {name: {state: flat tensor}}}`. Each rank builds the ShardedTensor's global shard
list from every rank's (key, start, end), all-gathered once per save and once per load.
[Note: hybrid checkpoints]
Under a hybrid split ([Note: hybrid rank order] in megabuf/pure/hybrid.py) the R replicas hold the
same optimizer shards: only replica 0 hands its pieces to DCP at save, and at load each rank's
ShardedTensors list the ranges of its own replica's ranks (`replica_ranges`), which cover each
param once. The checkpoint is in model space as always, so it loads at any other split or
flat dp, and a flat one loads into a hybrid run.
megabuf's own range assembly (`assemble_range`) then only checks that the loaded ranges cover
each main param exactly; it moves no data across ranges.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from megabuf.optimizer.model_space import MAIN
from megabuf.optimizer.state_layout import Layout, entry_kind

Ranges = dict[str, list[tuple[int, int, int]]]  # key -> [(global rank, start, end)]


@contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """ShardedTensor is how DCP takes arbitrary 1-D chunks (DTensor shards only evenly); its
    deprecation warning says nothing to megabuf's users."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def is_range_state(value: Any, start: int, end: int) -> bool:
    """Elementwise state of a piece: stored flat, 1-D of the piece's length."""
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == end - start


def ranges_from(everyone: list[list[tuple[str, int, int]]]) -> Ranges:
    """Every rank's partial (not whole-param) ranges, as all-gathered, per key."""
    ranges: Ranges = {}
    for rank, items in enumerate(everyone):
        for key, start, end in items:
            ranges.setdefault(key, []).append((rank, start, end))
    return ranges


def replica_ranges(
    everyone: list[tuple[int, list[tuple[str, int, int]]]], replica: int
) -> list[list[tuple[str, int, int]]]:
    """[Note: hybrid checkpoints] Each rank's (replicate rank, ranges) as all-gathered -> the
    ranges of the ranks of `replica` only (the others' empty): the replicas of a hybrid split
    hold the same shards, and a ShardedTensor's shard list must not overlap. Flat: all ranks."""
    return [ranges if r == replica else [] for r, ranges in everyone]


def chunk_tensor(local: Tensor, key: str, start: int, numel: int, ranges: Ranges) -> Any:
    """A 1-D ShardedTensor of size [numel] whose local shard is `local` at offset `start`."""
    shards = [
        ShardMetadata(shard_offsets=[lo], shard_sizes=[hi - lo], placement=f"rank:{rank}/cpu")
        for rank, lo, hi in ranges[key]
    ]
    own = next(s for s in shards if s.shard_offsets[0] == start)
    meta = ShardedTensorMetadata(
        shards_metadata=shards, size=torch.Size([numel]),
        tensor_properties=TensorProperties(dtype=local.dtype),
    )  # fmt: skip
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(local, own)], meta)


def partial_ranges(pieces: list[dict[str, Any]]) -> list[tuple[str, int, int]]:
    return [(p["key"], p["start"], p["end"]) for p in pieces if p["end"] - p["start"] != p["numel"]]


def optimizer_dcp_state(pieces: list[dict[str, Any]], ranges: Ranges) -> dict[str, Any]:
    """This rank's pieces as DCP values; see [Note: checkpoint state in DCP]."""
    out: dict[str, dict[str, Any]] = {}
    for piece in pieces:
        key, start, end, numel = piece["key"], piece["start"], piece["end"], piece["numel"]
        whole = end - start == numel
        entry = out.setdefault(key, {})
        for name, value in piece["state"].items():
            if is_range_state(value, start, end) and not whole:  # shards are placed on CPU
                entry[name] = chunk_tensor(value.cpu(), key, start, numel, ranges)
            else:
                entry[name] = value
    return out


# ---- load templates: what each rank asks DCP to fill ------------------------------------------
Saved = dict[str, dict[str, Any]]  # key -> state name -> DCP storage metadata


def saved_optimizer_entries(dcp_meta: Any) -> Saved:
    """key -> {state name: DCP storage metadata} of the optimizer state in a checkpoint."""
    out: Saved = {}
    for fqn, path in dcp_meta.planner_data.items():
        if len(path) == 3 and path[0] == "optimizer":
            out.setdefault(path[1], {})[path[2]] = dcp_meta.state_dict_metadata[fqn]
    return out


def saved_layout(entries: dict[str, Any], numel: int) -> Layout:
    """One key's saved optimizer state layout, from its DCP storage metadata (a pickled Python
    number has no size: a scalar); see [Note: optimizer state layout]."""
    return {
        name: entry_kind(getattr(md, "size", None), _dtype(md), numel)
        for name, md in entries.items()
        if name != MAIN
    }


def _dtype(md: Any) -> torch.dtype | None:
    properties = getattr(md, "properties", None)
    return getattr(properties, "dtype", None)


def wanted_ranges(wanted: list[tuple[str, int, int, int]]) -> list[tuple[str, int, int]]:
    """The partial ranges among (key, start, end, numel) this rank will ask for."""
    return [(key, start, end) for key, start, end, numel in wanted if end - start != numel]


def optimizer_template(
    wanted: list[tuple[str, int, int, int]], saved: Saved, ranges: Ranges
) -> tuple[dict[str, Any], dict[tuple[str, str], Tensor]]:
    """(the "optimizer" part of the state dict to hand to dcp.load, the local tensors that DCP
    fills for each (key, state name) requested as a chunk)."""
    template: dict[str, dict[str, Any]] = {}
    chunks: dict[tuple[str, str], Tensor] = {}
    for key, start, end, numel in wanted:
        entry = template.setdefault(key, {})
        for name, md in saved[key].items():
            size = getattr(md, "size", None)
            if size is None:  # pickled by DCP: it puts the value here
                entry[name] = None
            elif list(size) == [numel] and end - start != numel:
                local = torch.empty(end - start, dtype=md.properties.dtype)
                entry[name] = chunk_tensor(local, key, start, numel, ranges)
                chunks[(key, name)] = local
            else:
                entry[name] = torch.empty(list(size), dtype=md.properties.dtype)
    return template, chunks


def loaded_state(
    template: dict[str, Any], chunks: dict[tuple[str, str], Tensor], key: str
) -> dict[str, Any]:
    """State values of `key` after dcp.load filled the template."""
    return {name: chunks.get((key, name), value) for name, value in template[key].items()}
