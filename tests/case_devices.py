"""Rank side: the device a test case runs on, and the race windows the GPU tier widens.

A case dict may carry `"device": "cpu" | "cuda"` (default "cpu"). "cuda" means this rank's
current CUDA device: cuda:r on an NCCL pool (DistPool binds rank r to it), cuda:0 for every rank
of a gloo pool (several ranks share one GPU). The case builds its model, its batches and its
single-process reference on that device, so a comparison that is bitwise on CPU (same kernels on
the same bits) stays bitwise on CUDA; cross-device comparisons use tolerances.

[Note: race windows]
On CUDA, kernels run behind the host: a missing stream dependency (a collective reading a grad
buffer before the backward's kernels wrote it, a forward reading params before the all-gather
landed) only shows when the compute stream lags. `race_window(case, where)` queues a
`torch.cuda._sleep(cycles)` on the current stream at `where` ("finish_grad_sync": just before
`finish_grad_sync()`; "step": just before `optimizer.step()`), so everything issued after it
starts late, and the GPU tier compares those runs with `CUDA_LAUNCH_BLOCKING=1` runs (every
kernel synchronous: no window at all); they must be equal. On CPU the window is a host sleep of
cycles / 1e9 s: gloo's threads progress meanwhile; the path runs, nothing can lag.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def case_device(case: dict[str, Any]) -> torch.device:
    """The device of the case's model, batches and reference on this rank."""
    kind = case.get("device", "cpu")
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"case device must be 'cpu' or 'cuda', got {kind!r}")
    if not torch.cuda.is_available():
        raise RuntimeError("case asks for device 'cuda' but CUDA is not available on this rank")
    # cuBLAS may otherwise reduce bf16 GEMMs in bf16 (split-K), looser than the CPU kernels'
    # fp32 accumulation that [Note: bf16 grad bound] assumes.
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", torch.cuda.current_device())


def to_device(case: dict[str, Any], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    device = case_device(case)
    return tuple(t.to(device) for t in tensors)


def race_window(case: dict[str, Any], where: str) -> bool:
    """Delay the current stream (CUDA) or the host (CPU) by `case["sleep_cycles"][where]`
    cycles; [Note: race windows]. Returns whether it waited."""
    cycles = int(case.get("sleep_cycles", {}).get(where, 0))
    if cycles <= 0:
        return False
    if case_device(case).type == "cuda":
        torch.cuda._sleep(cycles)
    else:
        time.sleep(cycles / 1e9)
    return True


def params_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's first param (CPU for a model without params)."""
    first = next(iter(model.parameters()), None)
    return first.device if first is not None else torch.device("cpu")
