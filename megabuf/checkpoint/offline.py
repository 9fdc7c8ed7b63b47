"""Reading a checkpoint without a process group: consolidated model and optimizer state."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from megabuf.checkpoint.dcp_state import quiet_sharded_tensor, saved_optimizer_entries
from megabuf.checkpoint.files import find_checkpoint, read_metadata, verify_file
from megabuf.checkpoint.hook_state import holders


def _verified(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any], Any]:
    root = find_checkpoint(Path(path))
    meta = read_metadata(root)
    for record in meta["files"]:
        verify_file(root, record)
    return root, meta, dcp.FileSystemReader(root).read_metadata()


def _empty(md: Any) -> Any:
    size = getattr(md, "size", None)
    return None if size is None else torch.empty(list(size), dtype=md.properties.dtype)


def _load(root: Path, state: dict[str, Any]) -> None:
    with quiet_sharded_tensor(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(root), no_dist=True)


def consolidated_model_state(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Offline: every model entry (params, buffers) of the checkpoint by its key, verified. With
    pp = ep = 1 and one model chunk the keys are the module's own state_dict names, so the
    result loads into the unwrapped module (`module.load_state_dict(...)`)."""
    root, _, dcp_meta = _verified(path)
    model = {
        p[1]: _empty(dcp_meta.state_dict_metadata[fqn])
        for fqn, p in dcp_meta.planner_data.items()
        if len(p) == 2 and p[0] == "model"
    }
    _load(root, {"model": model})
    return model


def consolidated_optimizer_state(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Offline, no process group needed: every param's optimizer state from all ranks' pieces
    as param-shaped tensors, keyed by the checkpoint's param keys; with a megabuf optimizer also
    its fp32 main param (`"main"`). For inspection, export, or conversion."""
    root, meta, dcp_meta = _verified(path)
    saved = saved_optimizer_entries(dcp_meta)
    state = {key: {name: _empty(md) for name, md in names.items()} for key, names in saved.items()}
    _load(root, {"optimizer": state})
    out: dict[str, dict[str, Any]] = {}
    for key, values in state.items():
        numel, shape = meta["optimizer"][key]
        out[key] = {
            name: v.view(shape) if isinstance(v, Tensor) and v.numel() == numel else v
            for name, v in values.items()
        }
    return out


def consolidated_comm_hook_state(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Offline: the communication-hook state of the checkpoint ([Note: comm hook state in
    checkpoints]), verified, per slot (chunk scope + "dense" / "expert" / "all"):
    `{"class", "hook", "layout", "replicated": {key: value}, "per_rank": {key: {rank: tensor}}}`
    with the keys as stored (param names as checkpoint keys). {} if it holds no hook state."""
    root, meta, _ = _verified(path)
    saved = meta.get("comm_hooks", {})
    tensors: dict[str, Tensor] = {}
    for name, slot in saved.items():
        for key, entry in slot["replicated"].items():
            if "value" not in entry:
                tensors[f"{name}/replicated/{key}"] = _hook_empty(entry)
        for key, entry in slot["per_rank"].items():
            for rank in holders(slot, entry):
                tensors[f"{name}/per_rank/{rank}/{key}"] = _hook_empty(entry)
    if tensors:
        _load(root, {"comm_hooks": tensors})
    out: dict[str, dict[str, Any]] = {}
    for name, slot in saved.items():
        replicated = {
            key: entry["value"] if "value" in entry else tensors[f"{name}/replicated/{key}"]
            for key, entry in slot["replicated"].items()
        }
        per_rank = {
            key: {r: tensors[f"{name}/per_rank/{r}/{key}"] for r in holders(slot, entry)}
            for key, entry in slot["per_rank"].items()
        }
        out[name] = {
            "class": slot["class"], "hook": slot["hook"], "layout": slot["layout"],
            "replicated": replicated, "per_rank": per_rank,
        }  # fmt: skip
    return out


def _hook_empty(entry: dict[str, Any]) -> Tensor:
    return torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
