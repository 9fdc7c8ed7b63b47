"""What a healing replica group receives from a healthy one, rank i from rank i: collective-free.

[Note: replica state for healing]
torchft heals a group that restarted (or fell behind) by sending it, from one healthy group,
the state dicts registered with the Manager; group rank i receives group rank i's. Every group
has the same layout ([Note: layout fingerprint]), so rank i's state is exactly what rank i of the
healing group holds, tensor for tensor: no model-space conversion, no collective (each group's
ranks heal independently, and some may have nothing to do). Per rank, in layout order:
- "model": every bucket's persistent param memory (the param shard under optim_grads_params,
  else each param's data) and the module's buffers;
- "optimizer": each main param (fp32, or the buffer itself for fp32 params), its inner
  optimizer state (Adam's moments and step) and each param group's hyperparameters (an lr
  scheduler's current lr);
- "scaler": the loss scaler's state ({} without one).
No comm-hook state: megabuf.ft registers no comm hook. The loaded values are copied into the
existing tensors, so every view (param.data, main_grad, the inner optimizer's references)
stays valid. torchft applies it inside `should_commit` of the healing step, after its backward
(its grads were zeroed before crossing: it receives the others' average) and before its
optimizer step, so the healed group steps to the same values as the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer import MegabufOptimizer


def _model_tensors(model: DistributedDataParallel) -> list[Tensor]:
    out: list[Tensor] = []
    for buffer in model.engine.buffers:
        for bucket in buffer.buckets:
            if bucket.param_shard is not None:  # optim_grads_params: the only persistent copy
                out.append(bucket.param_shard)
            else:
                out.extend(p.data for p in bucket.params_list)
    out.extend(model.module.buffers())
    return out


def _optimizer_parts(optimizer: MegabufOptimizer) -> list[tuple[Tensor, dict[str, Any]]]:
    """(main param, its inner optimizer state) for every main param, in domain order."""
    return [
        (mp.main, domain.optimizer.state.setdefault(mp.main, {}))
        for domain in optimizer.domains
        for mp in domain.main_params
    ]


def _hyperparameters(optimizer: MegabufOptimizer) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in group.items() if k != "params"}
        for domain in optimizer.domains
        for group in domain.optimizer.param_groups
    ]


def replica_state(model: DistributedDataParallel, optimizer: MegabufOptimizer) -> dict[str, Any]:
    """This rank's state, for a healing group's rank of the same group rank; see [Note: replica
    state for healing]. Copies (the sender serves them while this group computes)."""
    scaler = optimizer.grad_scaler
    return {
        "model": [t.detach().clone() for t in _model_tensors(model)],
        "optimizer": {
            "main": [main.detach().clone() for main, _ in _optimizer_parts(optimizer)],
            "state": [
                {k: v.clone() if isinstance(v, Tensor) else v for k, v in state.items()}
                for _, state in _optimizer_parts(optimizer)
            ],
            "hyperparameters": _hyperparameters(optimizer),
        },
        "scaler": scaler.state_dict() if scaler is not None else {},
    }


def _copy_all(what: str, dst: list[Tensor], src: list[Tensor], rank: int) -> None:
    if len(dst) != len(src) or any(d.shape != s.shape for d, s in zip(dst, src, strict=False)):
        raise ValueError(
            f"megabuf: healing rank {rank}: the received {what} state does not match this "
            f"rank's ({len(src)} tensors received, {len(dst)} here): the source group has a "
            "different layout ([Note: layout fingerprint])"
        )
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


def load_replica_state(
    model: DistributedDataParallel, optimizer: MegabufOptimizer, state: dict[str, Any]
) -> None:
    """Copy `state` (from `replica_state` on the same group rank of a healthy group) into this
    rank's tensors; see [Note: replica state for healing]."""
    rank = model.engine.rank
    _copy_all("model", _model_tensors(model), state["model"], rank)
    parts = _optimizer_parts(optimizer)
    _copy_all("main param", [m for m, _ in parts], state["optimizer"]["main"], rank)
    for (main, inner), received in zip(parts, state["optimizer"]["state"], strict=True):
        inner.clear()
        inner.update({k: _placed(v, main) for k, v in received.items()})
    groups = [g for d in optimizer.domains for g in d.optimizer.param_groups]
    for group, hparams in zip(groups, state["optimizer"]["hyperparameters"], strict=True):
        group.update(hparams)
    if optimizer.grad_scaler is not None and state["scaler"]:
        optimizer.grad_scaler.load_state_dict(state["scaler"])


def _placed(value: Any, main: Tensor) -> Any:
    """Elementwise state on its main param's device; scalars (Adam's step) as received."""
    if isinstance(value, Tensor) and value.shape == main.shape:
        return value.to(main.device)
    return value
