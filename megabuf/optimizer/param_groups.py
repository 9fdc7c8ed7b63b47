"""Model-space names of params and the mapping of torch-style param groups onto them.

[Note: param groups survive sharding]
The user gives param groups as torch does (an iterable of params, or of dicts with "params" and
per-group hyperparameters). Group i of every inner optimizer holds the main params of exactly the
model params of user group i, with group i's hyperparameters; an inner group may be empty on a
rank that owns none of them. So per-group lr / weight decay apply to every piece of a param.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.ddp import DistributedDataParallel, as_model_chunks
from megabuf.planning.replicas import is_expert_parallel

ParamGroupsArg = Iterable[nn.Parameter] | Iterable[dict[str, Any]] | None


def as_chunks(
    model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
) -> list[DistributedDataParallel]:
    return as_model_chunks(model_chunks, "the optimizer")


def grad_buffers(chunk: DistributedDataParallel, expert: bool) -> list[_ParamAndGradBuffer]:
    """The chunk's dense (or expert-parallel) grad buffers."""
    if expert:
        return list(chunk.engine.expert_parallel_buffers)
    return list(chunk.engine.dense_buffers)  # the current ones (a sharded re-plan renews them)


def model_space_keys(chunks: Sequence[DistributedDataParallel]) -> dict[nn.Parameter, str]:
    """Checkpoint key of every trainable param: its name, prefixed by the chunk index when
    there are several chunks, the pipeline stage with pp > 1, and the ep rank for expert params
    with ep > 1 (those differ between ranks of one checkpoint)."""
    keys: dict[nn.Parameter, str] = {}
    for i, chunk in enumerate(chunks):
        named = [(n, p) for p, n in chunk.engine.param_to_name.items()]
        # a torch optimizer's checkpoint holds the sparse-grad params too ([Note: sparse grads
        # outside the buffer] in megabuf/sync/sparse_grads.py)
        for name, param in named + chunk.engine.sparse_grads.named:
            keys[param] = scope_prefix(chunk, i, len(chunks), is_expert_parallel(param)) + name
    return keys


def scope_prefix(chunk: DistributedDataParallel, index: int, n_chunks: int, expert: bool) -> str:
    pgs = chunk.process_groups
    prefix = f"stage{pgs.pp_rank}/" if pgs.pp_size > 1 else ""
    if n_chunks > 1:
        prefix += f"chunk{index}/"
    if expert and pgs.topology.ep_size > 1:
        prefix += f"ep{pgs.topology.ep_rank}/"
    return prefix


def resolve_param_groups(
    chunks: Sequence[DistributedDataParallel], param_groups: ParamGroupsArg
) -> tuple[list[dict[str, Any]], dict[nn.Parameter, int]]:
    """(hyperparameters of each group without "params", group index of every trainable param);
    see [Note: param groups survive sharding]."""
    names = {p: n for chunk in chunks for p, n in chunk.engine.param_to_name.items()}
    if param_groups is None:
        return [{}], dict.fromkeys(names, 0)
    groups = list(param_groups)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    hparams: list[dict[str, Any]] = []
    group_of: dict[nn.Parameter, int] = {}
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(f"megabuf: param group {i} must be a dict with a 'params' entry")
        hparams.append({k: v for k, v in group.items() if k != "params"})
        params = group["params"]
        for param in [params] if isinstance(params, nn.Parameter) else list(params):
            _assign(param, i, group_of, names)
    missing = [n for p, n in names.items() if p not in group_of]
    if missing:
        raise ValueError(
            f"megabuf: trainable params {missing[:10]} are in no param group; add them to a "
            "group or freeze them (requires_grad=False) before wrapping the model"
        )
    return hparams, group_of


def _assign(
    param: nn.Parameter, index: int, group_of: dict[nn.Parameter, int], names: dict[Any, str]
) -> None:
    if not isinstance(param, torch.Tensor):
        raise ValueError(
            f"megabuf: param group {index} holds a {type(param).__name__}, not a param; give "
            "param groups as torch does: an iterable of params, or of dicts like "
            "{'params': [p, ...], 'lr': 1e-3} (a list of lists is neither)"
        )
    if param not in names:
        raise ValueError(
            f"megabuf: param group {index} holds a param of shape {tuple(param.shape)} that is "
            "not a trainable param of the model chunks; build the groups from the wrapped model"
        )
    if param in group_of:
        raise ValueError(
            f"megabuf: param {names[param]!r} is in param groups {group_of[param]} and {index}"
        )
    group_of[param] = index
