"""Where megabuf allocates the tensors it makes itself.

[Note: allocation device]
Every tensor megabuf allocates (grad buffers, pipeline receive buffers, token counts, flags and
norms it reduces, loss scales) lives on the device of the params it serves: one process, one
device. A rank with no such params (a pipeline stage whose params are all frozen, a model chunk
without trainable params) still joins the collectives of its groups, and its tensors must be
ones the backend moves alongside its peers': the current CUDA device when the group's backend
includes NCCL (its peers pass CUDA tensors), the CPU otherwise (gloo). `init_distributed` sets
the current CUDA device from LOCAL_RANK. tests/test_devices.py scans `megabuf/` for tensor
factories without a `device=` and for CPU fallbacks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megabuf.transport.collective_backends import backend_for_device


def comm_device(group: ProcessGroup | None) -> torch.device:
    """The device of tensors a rank without params hands to collectives over `group` (None:
    the default group); see [Note: allocation device]."""
    nccl = (
        dist.is_initialized()
        and backend_for_device(dist.get_backend_config(group), "cuda") == "nccl"
    )
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # gloo, or no process group at all


def params_device(params: Iterable[torch.Tensor], group: ProcessGroup | None) -> torch.device:
    """The device of the first of `params`, or `comm_device(group)` if there is none."""
    first = next(iter(params), None)
    return first.device if first is not None else comm_device(group)
