"""Reading a checkpoint without a process group: consolidated model and optimizer state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import Tensor

from megabuf.checkpoint.files import find_checkpoint, read_file, read_metadata
from megabuf.optimizer.model_space import assemble_range


def consolidated_model_state(path: str | os.PathLike[str]) -> dict[str, Tensor]:
    """Offline: every model entry (params, buffers) of the checkpoint by its key, verified. With
    pp = ep = 1 and one model chunk the keys are the module's own state_dict names, so the
    result loads into the unwrapped module (`module.load_state_dict(...)`)."""
    root = find_checkpoint(Path(path))
    meta = read_metadata(root)
    out: dict[str, Tensor] = {}
    for record in meta["files"]:
        if record["model"]:
            out |= read_file(root, record)["model"]
    return out


def consolidated_optimizer_state(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Offline, no process group needed: every param's optimizer state, reassembled from all
    ranks' pieces into param-shaped tensors, keyed by the checkpoint's param keys; with a megabuf
    optimizer also its fp32 main param (`"main"`). For inspection, export, or conversion."""
    root = find_checkpoint(Path(path))
    meta = read_metadata(root)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for record in meta["files"]:
        if record["optimizer_keys"]:
            for piece in read_file(root, record)["optimizer"]:
                by_key.setdefault(piece["key"], []).append(piece)
    out: dict[str, dict[str, Any]] = {}
    for key, pieces in by_key.items():
        numel, shape = pieces[0]["numel"], pieces[0]["shape"]
        if len(pieces) == 1 and (pieces[0]["start"], pieces[0]["end"]) == (0, numel):
            state = dict(pieces[0]["state"])  # a whole param (torch optimizer, non-sharded)
        else:
            state = assemble_range(key, 0, numel, pieces)
        out[key] = {
            name: v.view(shape) if isinstance(v, Tensor) and v.numel() == numel else v
            for name, v in state.items()
        }
    return out
