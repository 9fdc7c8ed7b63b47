"""`Residency`: whether an engine's memory is on its device, and the guard its entry points ask.

[Note: offloaded engine]
`megabuf.weights.offload` releases every storage an engine holds on its device (params, grads,
the optimizer's main params and state: see megabuf/weights/offload.py) and `restore` refills
the same storage objects in place, so every view (`param.data`, `param.main_grad`, tensors
autograd saved in a forward) is valid again afterwards. In between, those tensors keep their
shapes but hold no bytes: a kernel reading one fails, or on some CPU kernels crashes the process.
Offload and restore are the engine's own acts: the weights package asks `engine.offload(record)`
/ `engine.restore()` / `engine.offloaded`, it never writes this object's state. So every way into
the engine asks its `Residency` first and raises `EngineOffloadedError`
naming the entry point and saying to restore: the wrapper's forward, a backward (a hook on the
forward's outputs, which runs before any node reads a saved param, and every param's grad
hook), the grad sync, the param sync, `state_dict` / `load_state_dict` /
`summon_full_params`, and the optimizer's `step`, `state_dict` and `load_state_dict`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class EngineOffloadedError(RuntimeError):
    """An offloaded engine was used: restore it first (`megabuf.weights.restore`)."""


class Residency:
    """One engine's residency: `offloaded` is the record of the offload in force, or None."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.offloaded: Any = None  # megabuf.weights.offload.Offloaded while offloaded

    def enter(self, record: Any) -> None:
        """The engine is offloaded; `record` is the offload in force (`Engine.offload`)."""
        self.offloaded = record

    def leave(self) -> Any:
        """The engine is back; returns the offload's record (`Engine.restore`)."""
        record, self.offloaded = self.offloaded, None
        return record

    def check(self, entry: str) -> None:
        """Raise `EngineOffloadedError` naming `entry` while offloaded (hot path: one test)."""
        if self.offloaded is not None:
            raise EngineOffloadedError(
                f"megabuf: {entry} on rank {self.rank} while the engine is offloaded (its "
                "params, grads and optimizer state hold no device memory); call "
                "megabuf.weights.restore(model) first ([Note: offloaded engine])"
            )

    def watch(self, output: Any) -> None:
        """Check at the start of the backward of a forward's outputs (before any autograd node
        reads a saved param)."""
        leaves, _ = tree_flatten(output)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaf.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self.check("backward")
