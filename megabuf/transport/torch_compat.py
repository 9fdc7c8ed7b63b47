"""torch DDP's constructor arguments, mapped onto megabuf's (docs/porting-from-torch-ddp.md).

[Note: torch DDP arguments]
A torch-DDP script should run with only the import changed, so `DistributedDataParallel`
accepts every argument of `torch.nn.parallel.DistributedDataParallel`. Each one is honoured
(`process_group`, `device_mesh`, `broadcast_buffers`/`forward_sync_buffers`, `init_sync`,
`bucket_cap_mb`), checked and accepted because megabuf already behaves that way (`device_ids`,
`output_device`, `dim`, `find_unused_parameters`, `gradient_as_bucket_view`, `static_graph`,
`check_reduction`, `skip_all_reduce_unused_params`, `batched_grad_copy`), or rejected with the
megabuf way to get it (`mixed_precision`, `delay_all_reduce_named_params`,
`param_to_hook_all_reduce`, `bucket_cap_mb_list`). Never a bare TypeError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.transport.process_groups import ProcessGroups

MIB = 1 << 20
GRAD_ELEMENT_NBYTES = 4  # bucket_cap_mb counts bytes; megabuf's bucket_size counts fp32 elements

# Accepted with no effect: megabuf already behaves as the argument asks, whatever its value.
ALREADY_SO = {
    "find_unused_parameters": "unused params are always handled (zero-filled and reduced)",
    "gradient_as_bucket_view": "same-dtype grads are always views into the grad buffer",
    "static_graph": "per-param grad arrivals are always learned in the first iteration",
    "check_reduction": "deprecated in torch; megabuf checks reductions itself",
    "skip_all_reduce_unused_params": "whole buckets are reduced; unused params are zeros",
    "batched_grad_copy": "grads are copied into the buffer by per-param hooks",
}
REJECTED = {
    "mixed_precision": "wrap a bf16 model and use build_optimizer(OptimizerConfig(bf16=True)) "
    "(fp32 main params); DistributedDataParallelConfig(grad_reduce_in_fp32=True) reduces in fp32",
    "delay_all_reduce_named_params": "megabuf has no per-param reduction delay; "
    "DistributedDataParallelConfig(overlap_grad_reduce=False) reduces everything after backward",
    "param_to_hook_all_reduce": "megabuf has no per-param reduction delay; "
    "DistributedDataParallelConfig(overlap_grad_reduce=False) reduces everything after backward",
    "bucket_cap_mb_list": "use DistributedDataParallelConfig(bucket_size=<elements>) or "
    "bucket_cap_mb (one size for every bucket)",
}
HONOURED = (
    "device_ids", "output_device", "dim", "broadcast_buffers", "forward_sync_buffers",
    "init_sync", "process_group", "device_mesh", "bucket_cap_mb",
)  # fmt: skip
TORCH_DDP_ARGS = (*HONOURED, *ALREADY_SO, *REJECTED)


@dataclass(frozen=True)
class WrapOptions:
    """What the constructor needs once torch's arguments are resolved."""

    ddp_config: DistributedDataParallelConfig
    process_groups: ProcessGroups | None
    sync_buffers_in_forward: bool
    init_sync: bool


def resolve(
    module: nn.Module,
    ddp_config: Any,
    process_groups: ProcessGroups | None,
    torch_args: Mapping[str, Any],
) -> WrapOptions:
    """Map torch DDP's arguments; see [Note: torch DDP arguments]."""
    args = dict(torch_args)
    if ddp_config is not None and not isinstance(ddp_config, DistributedDataParallelConfig):
        if "device_ids" in args or not _looks_like_device_ids(ddp_config):
            raise TypeError(
                "megabuf: DistributedDataParallel's second argument is a "
                f"DistributedDataParallelConfig, got {ddp_config!r}"
            )
        args["device_ids"], ddp_config = ddp_config, None  # torch's second positional
    unknown = sorted(set(args) - set(TORCH_DDP_ARGS))
    if unknown:
        raise TypeError(
            f"megabuf: DistributedDataParallel got unexpected argument(s) {unknown}; it takes "
            "module, ddp_config, process_groups, disable_bucketing, collectives and torch DDP's "
            f"arguments {list(TORCH_DDP_ARGS)}"
        )
    for name in sorted(set(args) & set(REJECTED)):
        if args[name] not in (None, [], ()):
            raise ValueError(f"megabuf: torch DDP's {name} is not supported: {REJECTED[name]}")
    _check_devices(module, args.get("device_ids"), args.get("output_device"), args.get("dim", 0))
    config = _with_bucket_cap(ddp_config or DistributedDataParallelConfig(), args)
    return WrapOptions(
        ddp_config=config,
        process_groups=_groups(process_groups, args.get("process_group"), args.get("device_mesh")),
        sync_buffers_in_forward=_sync_buffers(args),
        init_sync=bool(args.get("init_sync", True)),
    )


def _looks_like_device_ids(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return all(isinstance(v, (int, str, torch.device)) for v in items)


def _check_devices(module: nn.Module, device_ids: Any, output_device: Any, dim: int) -> None:
    """megabuf runs the module where its params are: device_ids / output_device may only name
    that device (torch's single-device-module use), and inputs are never scattered (dim 0)."""
    if dim != 0:
        raise ValueError(f"megabuf: torch DDP's dim={dim} is not supported; inputs are never "
                         "scattered (one device per process), leave dim=0")  # fmt: skip
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    named = list(device_ids) if isinstance(device_ids, (list, tuple)) else [device_ids]
    named += [output_device]
    for value in named:
        if value is None:
            continue
        wanted = _as_device(value)
        if wanted != device:
            raise ValueError(
                f"megabuf: device_ids/output_device name {wanted} but the module's params are "
                f"on {device}; move the model there before wrapping (model.to({str(wanted)!r}))"
                ", or pass device_ids=None (megabuf runs the module where its params are)"
            )
    if isinstance(device_ids, (list, tuple)) and len(device_ids) > 1:
        raise ValueError(f"megabuf: device_ids={list(device_ids)}: one device per process only")


def _as_device(value: Any) -> torch.device:
    if isinstance(value, int):
        return torch.device("cuda", value)
    device = torch.device(value)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _with_bucket_cap(
    config: DistributedDataParallelConfig, args: Mapping[str, Any]
) -> DistributedDataParallelConfig:
    cap_mb = args.get("bucket_cap_mb")
    if cap_mb is None:
        return config
    numel = max(1, int(cap_mb * MIB) // GRAD_ELEMENT_NBYTES)
    if config.bucket_size is not None and config.bucket_size != numel:
        raise ValueError(
            f"megabuf: bucket_cap_mb={cap_mb} ({numel} fp32 elements) conflicts with "
            f"DistributedDataParallelConfig.bucket_size={config.bucket_size}; pass one of them"
        )
    return dataclasses.replace(config, bucket_size=numel)


def _groups(
    process_groups: ProcessGroups | None, process_group: Any, device_mesh: Any
) -> ProcessGroups | None:
    given = [n for n, v in (("process_groups", process_groups), ("process_group", process_group),
                            ("device_mesh", device_mesh)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise ValueError(f"megabuf: pass only one of {given}")
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"megabuf: device_mesh must be 1-D for data parallelism, got {device_mesh.ndim}-D;"
                " pass process_groups=ProcessGroups.build(pp_size=, ep_size=) instead"
            )
        process_group = device_mesh.get_group()
    if process_group is None:
        return process_groups
    return ProcessGroups.for_dp_group(process_group)


def _sync_buffers(args: Mapping[str, Any]) -> bool:
    forward = args.get("forward_sync_buffers")
    if forward is not None:
        return bool(forward)
    legacy = args.get("broadcast_buffers")
    return True if legacy is None else bool(legacy)
