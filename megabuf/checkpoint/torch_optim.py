"""A plain torch optimizer's state in model space (all-reduce path: every rank steps whole
params, so the replicas hold identical state).

[Note: torch optimizer state in checkpoints]
`save_checkpoint(path, model, torch.optim.AdamW(model.parameters()))` stores
- in common.pt: {"format": TORCH_FORMAT, "optimizer_class", "param_groups": [each group's
  hyperparameters and its "param_keys", the model-space keys of its params in order]};
- in the rank files: one piece per param with state, written by the param's first replica (dp
  rank 0, expt_dp rank 0 for expert params): {"key", "start": 0, "end": numel, "numel",
  "shape", "state": torch's per-param state as it is (param-shaped tensors, `step`)}.
Loading maps keys back to this optimizer's params, so it works at any dp size and bucket layout,
and requires the same param groups holding the same params and the same state layout, not the
same class ([Note: optimizer state layout]): torch's fused, foreach and for-loop kernels load
each other's checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.model_space import class_name
from megabuf.optimizer.param_groups import model_space_keys
from megabuf.optimizer.state_layout import (
    Layout,
    conform_scalars,
    expected_layout,
    group_problems,
    probe_state,
    restorable,
)
from megabuf.replicas import is_expert_parallel

TORCH_FORMAT = "megabuf-torch-optimizer-v1"


def _group_keys(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> list[list[tuple[nn.Parameter, str]]]:
    keys = model_space_keys(chunks)
    groups = []
    for gi, group in enumerate(optimizer.param_groups):
        pairs = []
        for p in group["params"]:
            if p not in keys:
                raise ValueError(
                    f"megabuf: {type(optimizer).__name__} param group {gi} holds a param of "
                    f"shape {tuple(p.shape)} that is not a trainable param of the model chunks "
                    f"(rank {dist.get_rank()}); build the optimizer from the wrapped model"
                )
            pairs.append((p, keys[p]))
        groups.append(pairs)
    return groups


def _writes(chunks: Sequence[DistributedDataParallel], param: nn.Parameter) -> bool:
    pgs = chunks[0].process_groups
    return dist.get_rank(pgs.expt_dp if is_expert_parallel(param) else pgs.dp) == 0


def torch_optimizer_state(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(common, this rank's pieces); see [Note: torch optimizer state in checkpoints]."""
    groups = _group_keys(chunks, optimizer)
    common = {
        "format": TORCH_FORMAT,
        "optimizer_class": class_name(type(optimizer)),
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "param_keys": [k for _, k in keys]}
            for g, keys in zip(optimizer.param_groups, groups, strict=True)
        ],
    }
    pieces = []
    for p, key in (pair for keys in groups for pair in keys):
        state = optimizer.state.get(p)
        if state and _writes(chunks, p):
            values = {n: _copy(v) for n, v in state.items()}
            pieces.append(
                {"key": key, "start": 0, "end": p.numel(), "numel": p.numel(),
                 "shape": list(p.shape), "state": values}
            )  # fmt: skip
    return common, pieces


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def wanted_torch(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> list[tuple[str, int, int, int]]:
    """(key, 0, numel, numel) of every param the torch optimizer holds: whole params."""
    pairs = [pair for keys in _group_keys(chunks, optimizer) for pair in keys]
    return [(key, 0, p.numel(), p.numel()) for p, key in pairs]


def load_torch_optimizer_state(
    chunks: Sequence[DistributedDataParallel],
    optimizer: torch.optim.Optimizer,
    common: dict[str, Any],
    pieces: list[dict[str, Any]],
) -> None:
    """Fill a torch optimizer from a checkpoint saved with one (any dp size / bucket layout)."""
    check_torch_common(optimizer, common)
    groups = _group_keys(chunks, optimizer)
    by_key = {piece["key"]: piece for piece in pieces}
    saved_groups = common["param_groups"]
    problems = [
        f"param group {gi}: saved params {saved['param_keys'][:5]}..., this optimizer has "
        f"{[k for _, k in keys][:5]}..."
        for gi, (saved, keys) in enumerate(zip(saved_groups, groups, strict=False))
        if saved["param_keys"] != [k for _, k in keys]
    ]
    if len(saved_groups) != len(groups):
        problems.append(f"{len(saved_groups)} param groups saved, this optimizer has {len(groups)}")
    if problems:
        raise ValueError(
            "megabuf: torch optimizer state does not fit: " + "; ".join(problems) + ". Build "
            "the optimizer with the same param groups as when it was saved"
        )
    state: dict[int, dict[str, Any]] = {}
    torch_groups = []
    index = 0
    for saved, keys, group in zip(saved_groups, groups, optimizer.param_groups, strict=True):
        ids = []
        probe = probe_state(optimizer, group)
        for _, key in keys:
            if key in by_key:
                state[index] = conform_scalars(by_key[key]["state"], probe)
            ids.append(index)
            index += 1
        torch_groups.append({**group, **restorable(saved), "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": torch_groups})


def check_torch_common(optimizer: torch.optim.Optimizer, common: dict[str, Any] | None) -> None:
    if common is None or common.get("format") != TORCH_FORMAT:
        saved = "no optimizer" if common is None else f"a megabuf optimizer ({common['format']})"
        raise ValueError(
            f"megabuf: checkpoint was saved with {saved}; it cannot fill the torch optimizer "
            f"{type(optimizer).__name__}"
        )
    problems = group_problems(common["param_groups"], optimizer.param_groups)
    if problems:
        raise ValueError(
            f"megabuf: the {type(optimizer).__name__} optimizer does not fit the checkpoint "
            f"(saved by {common.get('optimizer_class')}): " + "; ".join(problems)
        )


def expected_torch_layouts(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> dict[str, Layout]:
    """The state layout each param of a torch optimizer takes ([Note: optimizer state layout])."""
    out: dict[str, Layout] = {}
    for group, keys in zip(optimizer.param_groups, _group_keys(chunks, optimizer), strict=True):
        probe = probe_state(optimizer, group)
        out |= {key: expected_layout(probe, p.numel()) for p, key in keys}
    return out
