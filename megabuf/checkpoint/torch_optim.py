"""A plain torch optimizer's state in model space (all-reduce path: every rank steps whole
params, so the replicas hold identical state).

[Note: torch optimizer state in checkpoints]
`save_checkpoint(path, model, torch.optim.AdamW(model.parameters()))` stores
- one common file per (pipeline stage, ep rank) coordinate, written by the coordinate's first
  replica (expt_dp rank 0 of the stage: the ranks of one stage with one ep rank hold the same
  params, dense and expert, so the same param groups; ranks of another stage or ep rank hold
  other keys): {"format": TORCH_FORMAT, "optimizer_class", "param_groups": [each group's
  hyperparameters and its "param_keys", the model-space keys of its params in order],
  "keys_with_state": the keys that had optimizer state}. Rank 0's coordinate (stage 0, ep rank
  0) is common.pt, the others `common-pp<p>-ep<e>.pt`; metadata.json's "torch_commons" maps
  each coordinate ("pp<p>-ep<e>") to its file. Keying by coordinate, not by dp rank, matters
  once expt_dp != dp: every dp rank of a stage holds the stage's dense params, only the ranks
  of one ep rank hold its experts;
- in the rank files: one piece per param with state, written by the param's first replica (dp
  rank 0, expt_dp rank 0 for expert params): {"key", "start": 0, "end": numel, "numel",
  "shape", "state": torch's per-param state as it is (param-shaped tensors, `step`)}.
Loading maps keys back to this optimizer's params, so it works at any dp size and bucket layout,
and requires the same param groups holding the same params and the same state layout, not the
same class ([Note: optimizer state layout]): torch's fused, foreach and for-loop kernels load
each other's checkpoints. A rank whose coordinate has no common file (a checkpoint saved before
every coordinate was kept held rank 0's only), or whose keys_with_state lack their pieces, is
refused naming the coordinate, the params and the rank, unless the load passes
`strict_optimizer=False`: then a warning names them; without its coordinate's common file a
rank keeps the hyperparameters its optimizer was built with and loads the pieces that are
there (every stage's were saved even when only rank 0's common was), and params whose pieces
are missing start with fresh state.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
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
from megabuf.planning.replicas import is_expert_parallel
from megabuf.transport.collectives import Collectives

TORCH_FORMAT = "megabuf-torch-optimizer-v1"
RANK0_COMMON = "common.pt"


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
                    f"(rank {Collectives.rank()}); build the optimizer from the wrapped model"
                )
            pairs.append((p, keys[p]))
        groups.append(pairs)
    return groups


def _writes(chunks: Sequence[DistributedDataParallel], param: nn.Parameter) -> bool:
    pgs = chunks[0].process_groups
    return pgs.topology.data_parallel(is_expert_parallel(param))[0] == 0


def coordinate(chunks: Sequence[DistributedDataParallel]) -> str:
    """This rank's (pipeline stage, ep rank): the ranks that share it hold the same params."""
    pgs = chunks[0].process_groups
    return f"pp{pgs.pp_rank}-ep{pgs.topology.ep_rank}"


def common_file(chunks: Sequence[DistributedDataParallel]) -> str | None:
    """The common file this rank writes for a torch optimizer (None: another replica does)."""
    if chunks[0].process_groups.topology.expt_dp_rank != 0:
        return None
    coord = coordinate(chunks)
    return RANK0_COMMON if coord == "pp0-ep0" else f"common-{coord}.pt"


def torch_optimizer_state(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(this rank's coordinate's common state, this rank's pieces); see [Note: torch optimizer
    state in checkpoints]."""
    groups = _group_keys(chunks, optimizer)
    pairs = [pair for keys in groups for pair in keys]
    common = _common(optimizer, groups)
    pieces = []
    for p, key in pairs:
        state = optimizer.state.get(p)
        if state and _writes(chunks, p):
            values = {n: _copy(v) for n, v in state.items()}
            pieces.append(
                {"key": key, "start": 0, "end": p.numel(), "numel": p.numel(),
                 "shape": list(p.shape), "state": values}
            )  # fmt: skip
    return common, pieces


def _common(
    optimizer: torch.optim.Optimizer, groups: list[list[tuple[nn.Parameter, str]]]
) -> dict[str, Any]:
    return {
        "format": TORCH_FORMAT,
        "optimizer_class": class_name(type(optimizer)),
        "param_groups": [
            {**{k: v for k, v in g.items() if k != "params"}, "param_keys": [k for _, k in keys]}
            for g, keys in zip(optimizer.param_groups, groups, strict=True)
        ],
        "keys_with_state": [k for keys in groups for p, k in keys if optimizer.state.get(p)],
    }


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, Tensor) else value


def wanted_torch(
    chunks: Sequence[DistributedDataParallel], optimizer: torch.optim.Optimizer
) -> list[tuple[str, int, int, int]]:
    """(key, 0, numel, numel) of every param the torch optimizer holds: whole params."""
    pairs = [pair for keys in _group_keys(chunks, optimizer) for pair in keys]
    return [(key, 0, p.numel(), p.numel()) for p, key in pairs]


Wanted = list[tuple[str, int, int, int]]  # (key, start, end, numel of the param)


def plan_torch_load(
    chunks: Sequence[DistributedDataParallel],
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    read: Callable[[str], Any],
    strict: bool,
) -> tuple[dict[str, Any] | None, Wanted]:
    """(this rank's coordinate's common state, the params whose state to load); raises naming
    what is missing unless not `strict` ([Note: torch optimizer state in checkpoints]). `read`
    verifies and loads one file of the checkpoint."""
    check_torch_common(optimizer, read(meta["common"]), hyperparameters=False)  # its format
    wanted = wanted_torch(chunks, optimizer)
    coord, rank = coordinate(chunks), Collectives.rank()
    # before every coordinate was kept (format 1 of this note) only rank 0's common was saved
    files = meta.get("torch_commons") or {"pp0-ep0": meta["common"]}
    saved = set(meta["optimizer"])
    if coord not in files:
        _missing(
            f"no {type(optimizer).__name__} param groups for pipeline stage / ep rank {coord} "
            f"(rank {rank}: params {[w[0] for w in wanted][:8]}); it holds {sorted(files)} "
            "only: saved before megabuf kept every stage's and ep rank's torch optimizer state "
            "(rank 0's alone), or at other pp / ep sizes",
            "keep the hyperparameters this optimizer was built with, load the params' state "
            "where the checkpoint has it and start the others fresh",
            strict,
        )
        return None, [w for w in wanted if w[0] in saved]
    common = read(files[coord])
    check_torch_common(optimizer, common)
    if "keys_with_state" not in common:  # format 1: a key without a piece never had state
        return common, [w for w in wanted if w[0] in saved]
    stateful = set(common["keys_with_state"])
    lost = [w[0] for w in wanted if w[0] in stateful and w[0] not in saved]
    if lost:
        _missing(
            f"no state of params {lost[:8]} (pipeline stage / ep rank {coord}, rank {rank}), "
            f"which had {type(optimizer).__name__} state when it was saved: their rank file "
            "lost them, or a rank that holds them did not write them",
            "start these params' optimizer state fresh",
            strict,
        )
    return common, [w for w in wanted if w[0] in stateful and w[0] in saved]


def _missing(what: str, relaxed: str, strict: bool) -> None:
    """Refuse (strict) or warn about optimizer state the checkpoint lacks for this rank."""
    if strict:
        raise ValueError(
            f"megabuf: the checkpoint holds {what}. Load a checkpoint saved by this megabuf at "
            "the same pp / ep sizes, or pass load_checkpoint(..., strict_optimizer=False) to "
            f"{relaxed}"
        )
    warnings.warn(
        f"megabuf: load_checkpoint(strict_optimizer=False): the checkpoint holds {what}; "
        f"they {relaxed.replace('this optimizer', 'the optimizer')}",
        RuntimeWarning,
        stacklevel=4,
    )


def load_torch_optimizer_state(
    chunks: Sequence[DistributedDataParallel],
    optimizer: torch.optim.Optimizer,
    common: dict[str, Any] | None,
    pieces: list[dict[str, Any]],
) -> None:
    """Fill a torch optimizer from a checkpoint saved with one (any dp size / bucket layout);
    common None: no param groups saved for this rank's coordinate (strict_optimizer=False), the
    optimizer's own groups stand in for them."""
    groups = _group_keys(chunks, optimizer)
    if common is None:
        common = _common(optimizer, groups)
    check_torch_common(optimizer, common)
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


def check_torch_common(
    optimizer: torch.optim.Optimizer, common: dict[str, Any] | None, hyperparameters: bool = True
) -> None:
    if common is None or common.get("format") != TORCH_FORMAT:
        saved = "no optimizer" if common is None else f"a megabuf optimizer ({common['format']})"
        raise ValueError(
            f"megabuf: checkpoint was saved with {saved}; it cannot fill the torch optimizer "
            f"{type(optimizer).__name__}"
        )
    if not hyperparameters:
        return
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
