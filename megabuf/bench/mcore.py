"""Optional GPU peers: megatron-core's DistributedDataParallel and DistributedOptimizer.

[Note: megatron-core peers]
megatron-core is what megabuf's users compare against, so `--device cuda` adds two rows when
`megatron.core` imports (it is never a dependency):
- `mcore_ddp_overlap`: its DistributedDataParallel with `overlap_grad_reduce` and its
  FP32Optimizer (the all-reduce path; megabuf's peer row: `megabuf_ar_overlap`);
- `mcore_distopt_overlap`: the same with `use_distributed_optimizer` and its
  DistributedOptimizer (reduce-scatter, then the param all-gather after the step;
  `overlap_param_gather` is left off so the params are whole when the step returns).
Both train the bench's fp32 model with Adam at the bench's settings (weight decay on every
param, as the other systems' torch AdamW; megatron-core's default exempts biases and norms, so
the groups are set after building), no clipping. They are built only through megatron-core's
public API (`parallel_state.initialize_model_parallel`, `DistributedDataParallel(config,
ddp_config, module)`, `get_megatron_optimizer(config, model_chunks)`); its parallel state is
initialised once per process with tensor and pipeline parallel size 1, so every rank is a data
parallel rank (world size 1 included). Absent, or on the CPU, the rows are skipped with the
reason printed (`unavailable_reason`), before any rank starts.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist
from torch import nn

from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.bench.systems import Engine, NotAvailable, param_nbytes
from megabuf.transport.process_groups import ProcessGroups

MCORE_SYSTEMS: tuple[str, ...] = ("mcore_ddp_overlap", "mcore_distopt_overlap")
MCORE_MODULES = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.transformer",
)


def unavailable_reason(device: str) -> str | None:
    """Why the megatron-core rows cannot run here, or None when they can."""
    if device != "cuda":
        return "megatron-core peers run with --device cuda only (its buffers and NCCL)"
    for name in MCORE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a broken install raising anything
            return (
                f"{name} does not import ({type(exc).__name__}: {exc}); install megatron-core "
                "to compare with it"
            )
    return None


def build_mcore(name: str, module: nn.Module, pgs: ProcessGroups) -> Engine:
    """megatron-core system `name` (one of MCORE_SYSTEMS) around `module`; see the Note."""
    device = next(module.parameters()).device.type
    reason = unavailable_reason(device)
    if reason is not None:
        raise NotAvailable(reason)
    if pgs.dp_size != dist.get_world_size():
        raise NotAvailable(
            f"megatron-core peers need data parallelism over the whole world (dp_size "
            f"{pgs.dp_size}, world {dist.get_world_size()})"
        )
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as McoreDDP
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()  # tensor = pipeline = 1: all data parallel
    distopt = name == "mcore_distopt_overlap"
    ddp_config = McoreDDPConfig(overlap_grad_reduce=True, use_distributed_optimizer=distopt)
    # the DDP wrapper reads only a few generic fields of the transformer config
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1)
    model = McoreDDP(config=config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(_optimizer_config(McoreOptimizerConfig, distopt), [model])
    for group in optimizer.param_groups:  # decay every param, as the torch AdamW peers do
        group["weight_decay"] = OPTIMIZER_KWARGS["weight_decay"]

    def zero_grad() -> None:
        model.zero_grad_buffer()
        optimizer.zero_grad()

    # all-reduce: 2 ring halves; reduce-scatter + all-gather: 1 + 1
    nbytes = 2 * (pgs.dp_size - 1) * param_nbytes(module) // pgs.dp_size
    return Engine(
        model, module, optimizer, nbytes, zero_grad, finish_sync=model.finish_grad_sync,
        notes=[f"megatron-core {_version()}"],
    )  # fmt: skip


def _optimizer_config(cls: Any, distopt: bool) -> Any:
    return cls(
        optimizer="adam", lr=OPTIMIZER_KWARGS["lr"], weight_decay=OPTIMIZER_KWARGS["weight_decay"],
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=OPTIMIZER_KWARGS["eps"], clip_grad=0.0,
        use_distributed_optimizer=distopt, bf16=False, fp16=False,
    )  # fmt: skip


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # not installed as a distribution (a source checkout on the path)
        return "(version unknown)"
