"""Model entries of a checkpoint: which rank writes which, and whether a model fits them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megabuf.ddp import DistributedDataParallel
from megabuf.fp8 import Fp8BufferPart, is_converted_fp8
from megabuf.fp8.masters import gather_by_kind, load_masters, recast
from megabuf.optimizer.param_groups import scope_prefix
from megabuf.planning.replicas import is_expert_parallel
from megabuf.transport.collectives import Collectives

Expected = dict[str, tuple[int, str, list[Any]]]  # key -> (chunk index, local name, [shape, dtype])


def parallel_sizes(chunks: Sequence[DistributedDataParallel]) -> dict[str, int]:
    """The sizes a checkpoint's keys depend on (see `model_space_keys`)."""
    pgs = chunks[0].process_groups
    return {"pp_size": pgs.pp_size, "ep_size": pgs.topology.ep_size}


def check_parallel_sizes(
    root: Path, meta: dict[str, Any], chunks: Sequence[DistributedDataParallel]
) -> None:
    mine = parallel_sizes(chunks)
    saved = {k: meta.get(k) for k in mine}
    if saved != mine:
        raise ValueError(
            f"megabuf: checkpoint {root} was saved at pipeline-parallel size "
            f"{saved['pp_size']} and expert-parallel size {saved['ep_size']}; this model runs "
            f"at pp_size {mine['pp_size']} and ep_size {mine['ep_size']} (rank "
            f"{Collectives.rank()}). Build the same pipeline / expert-parallel sizes as when it "
            "was saved (dp size and bucket size may differ)"
        )


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


def owned_model_state(chunks: Sequence[DistributedDataParallel]) -> dict[str, Tensor]:
    """Entries this rank writes (copies): dense ones on dp rank 0, expert ones on expt_dp rank 0.
    Collective with the distributed optimizer (publishes params)."""
    state: dict[str, Tensor] = {}
    for chunk, scoped in zip(chunks, _entry_scopes(chunks), strict=True):
        pgs = chunk.process_groups
        writes_dense, writes_expert = pgs.topology.dp_rank == 0, pgs.topology.expt_dp_rank == 0
        values = chunk.state_dict() | _fp8_entries(chunk)  # publishes params first
        for name, (key, expert) in scoped.items():
            if writes_expert if expert else writes_dense:
                state[key] = values[name].detach().clone()  # a view would save its whole buffer
    return state


def expected_model_entries(chunks: Sequence[DistributedDataParallel]) -> Expected:
    """checkpoint key -> (chunk index, local name, [shape, dtype]) for everything to load."""
    out = {}
    for i, (chunk, scoped) in enumerate(zip(chunks, _entry_scopes(chunks), strict=True)):
        values = chunk.module.state_dict(keep_vars=True)
        for name, (key, _) in scoped.items():
            out[key] = (i, name, [list(values[name].shape), str(values[name].dtype)])
    return out


def check_model_entries(root: Path, expected: Expected, saved: dict[str, list[Any]]) -> None:
    missing = sorted(set(expected) - set(saved))
    wrong = [
        f"{key}: saved {saved[key][0]} {saved[key][1]}, model has {want[0]} {want[1]}"
        for key, (_, _, want) in expected.items()
        if key in saved and saved[key] != want
    ]
    if missing or wrong:
        raise ValueError(
            f"megabuf: checkpoint {root} does not fit the model (rank {Collectives.rank()}): "
            f"missing entries {missing[:10]}, mismatched entries {wrong[:10]}. Build the same "
            "model (and the same pipeline / expert-parallel sizes) as when it was saved"
        )


def model_template(
    chunks: Sequence[DistributedDataParallel],
) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
    """Empty tensors for every entry to load: per chunk by local name, and the same tensors by
    checkpoint key (what DCP fills)."""
    per_chunk: list[dict[str, Tensor]] = []
    by_key: dict[str, Tensor] = {}
    for chunk, scoped in zip(chunks, _entry_scopes(chunks), strict=True):
        values = chunk.module.state_dict(keep_vars=True)
        entries = {name: _empty_like(values[name].detach()) for name in scoped}
        by_key |= {scoped[name][0]: t for name, t in entries.items()}
        per_chunk.append(entries)
    return per_chunk, by_key


def _empty_like(value: Tensor) -> Tensor:
    """An FP8 param's entry is a plain tensor of its dtype ([Note: FP8 params in checkpoints])."""
    if is_converted_fp8(value):
        return torch.empty(value.shape, dtype=value.dtype, device=value.device)
    return torch.empty_like(value)


def _fp8_parts(chunk: DistributedDataParallel) -> list[Fp8BufferPart]:
    return [b.fp8 for b in chunk.engine.buffers if b.fp8 is not None]


def _fp8_entries(chunk: DistributedDataParallel) -> dict[str, Tensor]:
    """Local name -> full master of every FP8 param (collective over the shard group):
    [Note: FP8 params in checkpoints]."""
    parts = _fp8_parts(chunk)
    if not parts:
        return {}
    masters = gather_by_kind(parts, chunk.engine.collectives, chunk.process_groups.shard_group)
    named = chunk.module.state_dict(keep_vars=True)
    return {name: masters[v] for name, v in named.items() if v in masters}


def take_fp8_entries(chunk: DistributedDataParallel, entries: dict[str, Tensor]) -> bool:
    """Pop the FP8 params' entries and write them into this rank's masters (the bytes follow in
    `recast_fp8`); whether there were any ([Note: FP8 params in checkpoints])."""
    parts = _fp8_parts(chunk)
    if not parts:
        return False
    named = chunk.module.state_dict(keep_vars=True)
    values = {v: entries.pop(n) for n, v in named.items() if n in entries and is_converted_fp8(v)}
    load_masters(parts, values)
    return True


def recast_fp8(chunks: Sequence[DistributedDataParallel]) -> None:
    """After a load: every chunk's FP8 bytes cast from its loaded masters, then the params
    gathered (collective; nothing without FP8 params)."""
    parts = [part for chunk in chunks for part in _fp8_parts(chunk)]
    if not parts:
        return
    for chunk in chunks:  # no gather may be in flight while the shard bytes change
        chunk.engine.param_side.before_step()
    recast(parts, chunks[0].engine.collectives, chunks[0].process_groups.shard_group)
    for chunk in chunks:
        chunk.engine.param_side.stepped()
