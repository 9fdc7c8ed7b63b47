"""`init_distributed`: start torch.distributed from torchrun's environment and build the groups."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from megabuf.transport.collective_backends import backend_for_device
from megabuf.transport.process_groups import ProcessGroups

DEFAULT_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl"}
"""Device type of the model -> the backend `init_distributed` picks for it."""


def init_distributed(
    *,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    timeout_s: float = 600.0,
    pp_size: int = 1,
    ep_size: int = 1,
    dp_shard_size: int | str | None = None,
) -> ProcessGroups:
    """Start torch.distributed from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK) and return the groups.

    `device` is where the model and its batches live, which decides the backend (unless
    `backend` is given): "cpu" -> gloo, whatever accelerators the machine has; "cuda" -> NCCL,
    with this rank on GPU LOCAL_RANK, whatever index `device` names (`torch.cuda.set_device`,
    and `device_id` passed to `init_process_group`, which binds the communicator to that GPU
    eagerly). If torch.distributed is already initialised, its groups are used as they are,
    provided a backend of them serves `device`. `dp_shard_size`: see `ProcessGroups.build`."""
    device_type = torch.device(device).type
    if backend is None and device_type not in DEFAULT_BACKENDS:
        raise ValueError(
            f"megabuf: init_distributed(device={device!r}): known devices are "
            f"{sorted(DEFAULT_BACKENDS)}; pass backend= for another"
        )
    missing = [
        k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
    ]
    if missing and not dist.is_initialized():
        raise RuntimeError(
            f"megabuf: init_distributed() needs torchrun's environment; missing {missing}. "
            "Run under torchrun or megabuf.testing.launch.spawn"
        )
    if not dist.is_initialized():
        backend = backend or DEFAULT_BACKENDS[device_type]
        device_id = _bind_local_gpu() if device_type == "cuda" else None
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=timeout_s), device_id=device_id
        )
    if backend_for_device(dist.get_backend_config(), device_type) is None:
        raise ValueError(
            f"megabuf: init_distributed(device={device!r}): torch.distributed's backend "
            f"{dist.get_backend_config()!r} serves no {device_type} tensors"
        )
    return ProcessGroups.build(pp_size=pp_size, ep_size=ep_size, dp_shard_size=dp_shard_size)


def _bind_local_gpu() -> torch.device:
    """Make GPU LOCAL_RANK this process's current device and return it."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_rank >= count:
        raise RuntimeError(
            f"megabuf: init_distributed(device='cuda') on LOCAL_RANK {local_rank} needs "
            f"{local_rank + 1} CUDA devices; this machine shows {count} (run with "
            "device='cpu', or start one rank per GPU)"
        )
    gpu = torch.device("cuda", local_rank)
    torch.cuda.set_device(gpu)
    return gpu
