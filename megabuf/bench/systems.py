"""How each benchmarked system is built and stepped: torch DDP, FSDP2, ZeRO + DDP, a run without
communication (the floor), and megabuf (all-reduce and distributed optimizer, overlap on/off).

Every builder takes the same freshly built module (same seed on every rank) and returns an
`Engine`: the callable to run forward on, the optimizer, the hooks of megabuf's per-step contract
(`zero_grad`, `finish_sync`, `after_step`) and how to read full params back for the check.
`theoretical_nbytes` is the ring figure for the model's params, for every system; for megabuf
systems the collective layer also counts the tensors each call handed to torch.distributed and
the ring figure for those calls (padding included).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups

FSDP_MAX_GROUPS = 8  # the main layer list is wrapped in at most this many FSDP2 units


@dataclass
class Engine:
    """One system ready to train; see the module docstring."""

    model: nn.Module  # call forward on this
    inner: nn.Module  # the unwrapped module (param names)
    optimizer: Any  # torch.optim.Optimizer or a wrapper with .step()
    theoretical_nbytes: int  # ring-optimal bytes this rank sends per step
    zero_grad: Callable[[], None]
    finish_sync: Callable[[], None] = lambda: None
    after_step: Callable[[], None] = lambda: None
    publish: Callable[[], None] = lambda: None  # make params readable (distributed optimizer)
    collectives: Collectives | None = None  # megabuf's byte counter
    ddp: DistributedDataParallel | None = None
    notes: list[str] = field(default_factory=list)


class NotAvailable(RuntimeError):
    """The system cannot run in this installation (e.g. an unmerged megabuf feature)."""


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, **OPTIMIZER_KWARGS)  # type: ignore[arg-type]


def param_nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


def _ring(nbytes: int, dp: int, halves: int) -> int:
    """`halves` ring passes of (dp-1)/dp of the bytes: all-reduce is 2, RS or AG is 1."""
    return halves * (dp - 1) * nbytes // dp


def build_no_comm(module: nn.Module, pgs: ProcessGroups) -> Engine:
    opt = _adamw(module.parameters())
    return Engine(module, module, opt, 0, opt.zero_grad)


def _torch_ddp(
    module: nn.Module, pgs: ProcessGroups, bucket_view: bool, bucket_cap_mb: float | None = None
) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    wrapped = TorchDDP(
        module,
        process_group=pgs.dp,
        gradient_as_bucket_view=bucket_view,
        bucket_cap_mb=bucket_cap_mb,  # None: torch's default
    )
    opt = _adamw(wrapped.parameters())
    nbytes = _ring(param_nbytes(module), pgs.dp_size, 2)
    return Engine(wrapped, module, opt, nbytes, opt.zero_grad)


def build_torch_ddp(module: nn.Module, pgs: ProcessGroups) -> Engine:
    return _torch_ddp(module, pgs, bucket_view=False)


def build_torch_ddp_gabv(
    module: nn.Module, pgs: ProcessGroups, bucket_cap_mb: float | None = None
) -> Engine:
    return _torch_ddp(module, pgs, bucket_view=True, bucket_cap_mb=bucket_cap_mb)


def _main_layers(module: nn.Module) -> list[nn.Module]:
    """The largest ModuleList child (GPT blocks, MLP layers, the many small Linears)."""
    lists: list[list[nn.Module]] = [
        list(m) for m in module.children() if isinstance(m, nn.ModuleList)
    ]
    return max(lists, key=len) if lists else []


def _fsdp2(module: nn.Module, pgs: ProcessGroups, reshard: bool) -> Engine:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pgs.dp, next(module.parameters()).device.type)
    layers = _main_layers(module)
    per_unit = max(1, -(-len(layers) // FSDP_MAX_GROUPS))
    unit_nbytes = 0
    for i in range(0, len(layers), per_unit):
        unit = layers[i : i + per_unit]
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=reshard)
        unit_nbytes += sum(param_nbytes(m) for m in unit)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    opt = _adamw(module.parameters())
    # forward all-gather + reduce-scatter of everything, plus a backward re-gather of the
    # resharded units (FSDP2 never reshards the root after forward)
    total = param_nbytes(module)
    nbytes = _ring(2 * total + (unit_nbytes if reshard else 0), pgs.dp_size, 1)
    engine = Engine(module, module, opt, nbytes, opt.zero_grad)
    engine.notes.append(f"{len(range(0, len(layers), per_unit))} FSDP units + root")
    return engine


def build_fsdp2_reshard(module: nn.Module, pgs: ProcessGroups) -> Engine:
    return _fsdp2(module, pgs, reshard=True)


def build_fsdp2_no_reshard(module: nn.Module, pgs: ProcessGroups) -> Engine:
    return _fsdp2(module, pgs, reshard=False)


def build_zero_ddp(module: nn.Module, pgs: ProcessGroups) -> Engine:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    wrapped = TorchDDP(module, process_group=pgs.dp)
    opt = ZeroRedundancyOptimizer(
        wrapped.parameters(),
        torch.optim.AdamW,
        process_group=pgs.dp,
        **OPTIMIZER_KWARGS,  # type: ignore[arg-type]
    )
    # grad all-reduce, then each rank sends its updated partition to the others
    nbytes = _ring(param_nbytes(module), pgs.dp_size, 3)
    return Engine(wrapped, module, opt, nbytes, opt.zero_grad)


def _megabuf(
    module: nn.Module, pgs: ProcessGroups, config: DistributedDataParallelConfig
) -> Engine:
    model = DistributedDataParallel(module, config, process_groups=pgs)
    nbytes = _ring(param_nbytes(module), pgs.dp_size, 2)
    if config.sharding.shards_params:
        return _zero3(model, module, pgs.dp_size)
    if config.sharding.shards_optimizer:
        return _with_distributed_optimizer(model, module, nbytes)
    opt = _adamw(model.parameters())
    return Engine(
        model, module, opt, nbytes, model.zero_grad_buffer, model.finish_grad_sync,
        collectives=model.engine.collectives, ddp=model,
    )  # fmt: skip


def _with_distributed_optimizer(
    model: DistributedDataParallel, module: nn.Module, nbytes: int
) -> Engine:
    try:
        from megabuf.optimizer import OptimizerConfig, build_optimizer
    except ImportError as exc:
        raise NotAvailable(f"megabuf's distributed optimizer does not import: {exc}") from exc
    config = OptimizerConfig(
        optimizer="adamw",
        lr=OPTIMIZER_KWARGS["lr"],
        weight_decay=OPTIMIZER_KWARGS["weight_decay"],
        adam_eps=OPTIMIZER_KWARGS["eps"],
    )
    opt = build_optimizer(model, config)
    # opt.zero_grad() zeroes the grad buffers and, with overlap_param_gather, dispatches the
    # first bucket group's param all-gather; step() publishes the updated shards.
    return Engine(
        model, module, opt, nbytes, opt.zero_grad, model.finish_grad_sync,
        publish=model.publish_params, collectives=model.engine.collectives, ddp=model,
    )  # fmt: skip


def _zero3(model: DistributedDataParallel, module: nn.Module, dp_size: int) -> Engine:
    """optim_grads_params: a forward all-gather and a reduce-scatter of everything, plus a
    backward re-gather of every unit but the root when resharding after forward."""
    total = param_nbytes(module)
    regather = 0
    units = getattr(model.engine.param_side, "units", None)  # UnitParams under optim_grads_params
    if model.ddp_config.sharding.reshards_after_forward and units is not None:
        root = {id(p) for p in units.runtime.units[0].params}
        regather = total - sum(
            p.numel() * p.element_size()
            for g in model.engine.all_bucket_groups
            if id(g.sharded_params) in root
            for p in g.params_list
        )
    engine = _with_distributed_optimizer(model, module, _ring(2 * total + regather, dp_size, 1))
    if units is not None:
        engine.publish = units.runtime.gather_all  # released again by the next step
    return engine


MEGABUF_CONFIGS: dict[str, dict[str, Any]] = {
    "megabuf_ar_overlap": {"overlap_grad_reduce": True},
    # re-planned in the last warm-up step (the worker sets auto_bucket_warmup_steps = warm-up
    # steps - 1, at least 2)
    "megabuf_ar_auto": {
        "overlap_grad_reduce": True,
        "bucket_size": "auto",
        "auto_bucket_warmup_steps": 2,
    },
    "megabuf_ar_sync": {},
    "megabuf_distopt_overlap": {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
    "megabuf_distopt_auto": {  # the distributed optimizer on the auto plan (issue 30)
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
        "bucket_size": "auto",
        "auto_bucket_warmup_steps": 2,
    },
    "megabuf_distopt_sync": {"use_distributed_optimizer": True},
    "megabuf_zero3": {  # ZeRO-3: units gathered in forward and again in backward
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
    },
    "megabuf_zero3_noreshard": {  # ZeRO-3, units kept gathered from forward to backward
        "data_parallel_sharding_strategy": "optim_grads_params",
        "overlap_grad_reduce": True,
        "reshard_after_forward": False,
    },
    "megabuf_zero2": {  # ZeRO-2: the full grad buckets exist only while they reduce
        "data_parallel_sharding_strategy": "optim_grads",
        "overlap_grad_reduce": True,
        "overlap_param_gather": True,
    },
}
MEGABUF_CONFIGS |= {  # the verify mode's cost, level by level ([Note: verify mode])
    f"megabuf_distopt_verify_{level}": {
        **MEGABUF_CONFIGS["megabuf_distopt_overlap"],
        "verify": level,
    }
    for level in ("collectives", "replicas", "norms", "all")
}
"""DistributedDataParallelConfig fields of each megabuf system (the rest are defaults)."""


def build_megabuf(
    name: str, module: nn.Module, pgs: ProcessGroups, overrides: dict[str, Any] | None = None
) -> Engine:
    """megabuf system `name` (see MEGABUF_CONFIGS), with config fields overridden if given;
    `python_hooks` (not a config field): never count arrivals ([Note: counted arrivals])."""
    values = {**MEGABUF_CONFIGS[name], **(overrides or {})}
    python_hooks = values.pop("python_hooks", False)
    engine = _megabuf(module, pgs, DistributedDataParallelConfig(**values))
    if python_hooks and engine.ddp is not None:
        engine.ddp.engine.sync.drop_first_sync()  # before the first sync: never swapped in
    return engine


BUILDERS: dict[str, Callable[[nn.Module, ProcessGroups], Engine]] = {
    "no_comm": build_no_comm,
    "torch_ddp": build_torch_ddp,
    "torch_ddp_gabv": build_torch_ddp_gabv,
    "fsdp2_reshard": build_fsdp2_reshard,
    "fsdp2_no_reshard": build_fsdp2_no_reshard,
    "zero_ddp": build_zero_ddp,
}
"""Builders of the peers; megabuf systems are built by `build_megabuf`."""


def full_params(engine: Engine) -> Iterator[tuple[str, Tensor]]:
    """(name, full param) for every param of the unwrapped module. Collective for FSDP2's
    DTensors: every rank must iterate to the end."""
    engine.publish()
    for name, p in engine.inner.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        yield name, full


def _local_nbytes(t: Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.numel() * local.element_size())


def optimizer_state_nbytes(optimizer: Any) -> int:
    """Bytes of tensors this rank's optimizer keeps (states, and sharded fp32 copies if any)."""
    report = getattr(optimizer, "memory_report", None)  # megabuf's optimizers
    if callable(report):
        return int(report().optimizer_nbytes)
    chained = getattr(optimizer, "chained_optimizers", None)  # megatron-core's ChainedOptimizer
    if chained is not None:
        return sum(optimizer_state_nbytes(o) for o in chained)
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer's local optimizer
    state = (inner if inner is not None else optimizer).state
    total = 0
    for per_param in state.values():
        total += sum(_local_nbytes(v) for v in per_param.values() if isinstance(v, Tensor))
    return total


def world_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
