"""megabuf: Megatron-style contiguous param-and-grad buffers for data-parallel PyTorch training."""

from megabuf.bucket_group import BucketGroup, GradSyncState, ParamSyncState
from megabuf.buffer import _ParamAndGradBucket, _ParamAndGradBuffer
from megabuf.checkpoint import consolidated_optimizer_state, load_checkpoint, save_checkpoint
from megabuf.collectives import Collectives, CommStats
from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.finalize import check_scaling_invariant, finalize_model_grads
from megabuf.layout import BufferLayout, compute_layout
from megabuf.optimizer import (
    ConstantGradScaler,
    DistributedOptimizer,
    DynamicGradScaler,
    FP32Optimizer,
    MegabufOptimizer,
    MixedPrecisionOptimizer,
    OptimizerConfig,
    OptimizerMemoryReport,
    build_optimizer,
)
from megabuf.pipeline import (
    ScheduleHooks,
    default_schedule_hooks,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    wrap_model_chunks,
)
from megabuf.process_groups import ProcessGroups, init_distributed
from megabuf.replicas import is_expert_parallel, mark_expert_parallel

__all__ = [
    "BucketGroup",
    "BufferLayout",
    "Collectives",
    "CommStats",
    "ConstantGradScaler",
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "GradSyncState",
    "MegabufOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "OptimizerMemoryReport",
    "ParamSyncState",
    "ProcessGroups",
    "ScheduleHooks",
    "_ParamAndGradBucket",
    "_ParamAndGradBuffer",
    "build_optimizer",
    "check_scaling_invariant",
    "compute_layout",
    "consolidated_optimizer_state",
    "default_schedule_hooks",
    "finalize_model_grads",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "init_distributed",
    "is_expert_parallel",
    "load_checkpoint",
    "mark_expert_parallel",
    "save_checkpoint",
    "wrap_model_chunks",
]
