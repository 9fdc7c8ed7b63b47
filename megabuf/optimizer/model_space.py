"""Optimizer state in model space: independent of dp size and bucket layout.

[Note: model-space optimizer state]
`state_dict()` of a megabuf optimizer is {"common": ..., "pieces": [...]}:
- "common" holds nothing rank-specific: optimizer class (information only: a load checks the
  state layout instead, [Note: optimizer state layout]), each param group's hyperparameters,
  the grad scaler's state.
- "pieces" are the ranges this rank owns: {"key": param name, "start", "end": range of the
  flattened param, "numel", "shape": of the whole param, "state": {"main": fp32 values,
  <optimizer state name>: values}}. Elementwise state is stored flat (1-D, end - start
  elements); per-tensor scalars (Adam's `step`) are stored as they are.
`load_state_dict` accepts pieces saved by any number of ranks with any bucket layout: every main
param of this rank is filled from the saved ranges overlapping it, and must be covered exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megabuf.optimizer.main_params import MainParam
from megabuf.optimizer.records import OptimizerParts
from megabuf.optimizer.state_layout import (
    Layout,
    conform_scalars,
    expected_layout,
    group_problems,
    probe_state,
    restorable,
)
from megabuf.transport.collectives import Collectives, Group

FORMAT = "megabuf-optimizer-v1"
MAIN = "main"


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def common_state(parts: OptimizerParts) -> dict[str, Any]:
    first = parts.domains[0].optimizer.param_groups if parts.domains else []
    return {
        "format": FORMAT,
        "optimizer_class": class_name(parts.optimizer_cls),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in first],
        "grad_scaler": parts.grad_scaler.state_dict() if parts.grad_scaler is not None else None,
    }


def owned_pieces(parts: OptimizerParts) -> list[dict[str, Any]]:
    """This rank's pieces (copies, so saving them does not serialise whole buffers)."""
    pieces = []
    for domain in parts.domains:
        for mp in domain.main_params:
            if not mp.owner:
                continue
            state: dict[str, Any] = {MAIN: mp.main.detach().flatten().clone()}
            for name, value in domain.optimizer.state.get(mp.main, {}).items():
                state[name] = _flat_state(mp, name, value)
            param = mp.model_param
            pieces.append(
                {
                    "key": mp.key,
                    "start": mp.param_start,
                    "end": mp.param_end,
                    "numel": param.numel(),
                    "shape": list(param.shape),
                    "state": state,
                }
            )
    return pieces


def _flat_state(mp: MainParam, name: str, value: Any) -> Any:
    if not isinstance(value, Tensor):
        return value
    if value.shape == mp.main.shape and value.numel() == mp.numel:
        return value.detach().flatten().clone()
    if value.numel() == 1:
        return value.detach().clone()
    raise ValueError(
        f"megabuf: optimizer state {name!r} of {mp.key!r} has shape {tuple(value.shape)}, neither "
        f"elementwise (shape {tuple(mp.main.shape)}) nor a scalar; only pointwise optimizers can "
        "be sharded"
    )


@torch.no_grad()  # a main param may be the model param itself (fp32 params, non-sharded)
def load_model_space_state(parts: OptimizerParts, state: dict[str, Any]) -> None:
    """See [Note: model-space optimizer state]."""
    common = state["common"]
    check_common(parts, common)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for piece in state["pieces"]:
        by_key.setdefault(piece["key"], []).append(piece)
    check_keys(parts, by_key)
    for domain in parts.domains:
        inner_state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for gi, group in enumerate(domain.optimizer.param_groups):
            ids = []
            probe = probe_state(domain.optimizer, group)
            for main in group["params"]:
                mp = _main_param_of(domain.main_params, main)
                values = assemble(mp, by_key[mp.key])
                mp.main.view(-1).copy_(values.pop(MAIN))
                if values:
                    unflat = {k: _unflatten(mp, v) for k, v in values.items()}
                    inner_state[index] = conform_scalars(unflat, probe)
                ids.append(index)
                index += 1
            groups.append({**group, **restorable(common["param_groups"][gi]), "params": ids})
        domain.optimizer.load_state_dict({"state": inner_state, "param_groups": groups})
    if parts.grad_scaler is not None and common.get("grad_scaler") is not None:
        parts.grad_scaler.load_state_dict(common["grad_scaler"])


def _main_param_of(mains: list[MainParam], main: Tensor) -> MainParam:
    for mp in mains:
        if mp.main is main:
            return mp
    raise RuntimeError("megabuf: inner optimizer holds a tensor that is no main param")


def _unflatten(mp: MainParam, value: Any) -> Any:
    if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == mp.numel:
        return value.view(mp.main.shape)
    return value


def assemble(mp: MainParam, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Values of every state entry over [param_start, param_end) from overlapping saved pieces."""
    return assemble_range(mp.key, mp.param_start, mp.param_end, pieces)


def assemble_range(key: str, start: int, end: int, pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Every state entry of param `key` over flat elements [start, end), from saved pieces."""
    out: dict[str, Any] = {}
    covered: dict[str, int] = {}
    for piece in pieces:
        lo, hi = max(piece["start"], start), min(piece["end"], end)
        if lo >= hi:
            continue
        width = piece["end"] - piece["start"]
        for name, value in piece["state"].items():
            if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == width:
                dst = out.setdefault(name, torch.empty(end - start, dtype=value.dtype))
                dst[lo - start : hi - start] = value[lo - piece["start"] : hi - piece["start"]]
                covered[name] = covered.get(name, 0) + hi - lo
            else:
                out.setdefault(name, value)
    short = {name: n for name, n in covered.items() if n != end - start}
    if MAIN not in covered or short:
        raise ValueError(
            f"megabuf: checkpoint does not cover elements [{start}, {end}) of {key!r}: covered "
            f"{short or {MAIN: covered.get(MAIN, 0)}} of {end - start}; pieces overlap or are "
            "missing (was the checkpoint written completely?)"
        )
    return out


def check_common(parts: OptimizerParts, common: dict[str, Any]) -> None:
    if common.get("format") != FORMAT:
        raise ValueError(
            f"megabuf: optimizer state has format {common.get('format')!r}, expected {FORMAT!r}"
        )
    problems = []
    if len(common["param_groups"]) != parts.num_param_groups:
        problems.append(
            f"{len(common['param_groups'])} param groups were saved, this optimizer has "
            f"{parts.num_param_groups}"
        )
    if parts.domains:  # every domain's inner optimizer has the same groups
        problems += group_problems(common["param_groups"], parts.domains[0].optimizer.param_groups)
    if (common.get("grad_scaler") is None) != (parts.grad_scaler is None):
        problems.append("grad scaler present in only one of checkpoint and optimizer")
    if problems:
        raise ValueError(
            f"megabuf: optimizer state (saved by {common.get('optimizer_class')}) does not fit: "
            + "; ".join(problems)
        )


def expected_layouts(parts: OptimizerParts) -> dict[str, Layout]:
    """The state layout each main param of this rank takes; see [Note: optimizer state layout]."""
    out = {}
    for domain in parts.domains:
        for group in domain.optimizer.param_groups:
            probe = probe_state(domain.optimizer, group)
            for main in group["params"]:
                mp = _main_param_of(domain.main_params, main)
                out[mp.key] = expected_layout(probe, mp.model_param.numel())
    return out


def check_keys(parts: OptimizerParts, by_key: dict[str, list[dict[str, Any]]]) -> None:
    """Every param this rank steps must be in the state with the same numel; nothing saved may
    be unknown to the model."""
    expected = {key: p for p, key in parts.keys.items()}
    needed = {mp.key for mp in parts.main_params}
    missing = sorted(needed - set(by_key))
    unexpected = sorted(set(by_key) - set(expected))
    wrong = [
        f"{key} saved with shape {by_key[key][0]['shape']}, model has {list(p.shape)}"
        for key, p in expected.items()
        if key in by_key and by_key[key][0]["numel"] != p.numel()
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            "megabuf: optimizer state does not fit the model: "
            f"missing params {missing[:10]}, unexpected params {unexpected[:10]}, "
            f"shape mismatches {wrong[:10]}"
        )


def own_pieces_on_host(parts: OptimizerParts) -> list[dict[str, Any]]:
    """Step 1 of [Note: sharded auto bucket re-plan] in megabuf/replan/sharded_replan.py: this
    rank's pieces (fp32 main values and state of the ranges it steps), copied to the host."""
    return [{**p, "state": _to_cpu(p["state"])} for p in owned_pieces(parts)]


def exchanged_state(
    parts: OptimizerParts,
    mine: list[dict[str, Any]],
    common: dict[str, Any],
    collectives: Collectives,
    group: Group,
) -> dict[str, Any]:
    """Step 3 of [Note: sharded auto bucket re-plan]: every dp rank's old pieces (`mine`, taken
    before the rebuild) are broadcast one rank at a time, and each rank keeps only their overlap
    with the ranges it steps now (`parts`, after the rebuild), as `load_model_space_state` takes
    them. A rank's host holds its old pieces, one rank's in transit and the state of its new
    ranges, never the whole optimizer state. Replicas' copies are kept once. Collective over
    `group`."""
    wanted: dict[str, list[tuple[int, int]]] = {}
    for mp in parts.main_params:
        wanted.setdefault(mp.key, []).append((mp.param_start, mp.param_end))
    kept: dict[tuple[str, int, int], dict[str, Any]] = {}
    size, me = collectives.size(group), collectives.rank(group)
    for src in range(size):
        theirs = mine if size == 1 else collectives.broadcast_object(
            mine if src == me else None, src, group
        )  # fmt: skip
        for piece in theirs:
            for start, end in wanted.get(piece["key"], []):
                lo, hi = max(piece["start"], start), min(piece["end"], end)
                if lo < hi and (piece["key"], lo, hi) not in kept:
                    kept[(piece["key"], lo, hi)] = trimmed(piece, lo, hi)
    return {"common": common, "pieces": list(kept.values())}


def trimmed(piece: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """`piece` cut to flat elements [lo, hi) of its param (elementwise entries sliced and
    copied; scalars kept)."""
    width, offset = piece["end"] - piece["start"], lo - piece["start"]
    state = {
        name: value[offset : offset + hi - lo].clone()
        if isinstance(value, Tensor) and value.dim() == 1 and value.numel() == width
        else value
        for name, value in piece["state"].items()
    }
    return {**piece, "start": lo, "end": hi, "state": state}


def _to_cpu(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.cpu() if isinstance(v, Tensor) else v for k, v in state.items()}
