"""megabuf: Megatron-style contiguous param-and-grad buffers for data-parallel PyTorch training.

The top level holds what a training script calls; internals stay importable from their modules
(`megabuf.buckets.bucket_group`, `megabuf.pure.layout`, `megabuf.planning.plan`,
`megabuf.transport.collectives`, `megabuf.optimizer`, `megabuf.pipeline`, `megabuf.checkpoint`,
...).
"""

from megabuf.checkpoint import full_state_dict, load_checkpoint, save_checkpoint
from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer import (
    DistributedOptimizer,
    FP32Optimizer,
    MegabufOptimizer,
    MixedPrecisionOptimizer,
    OptimizerConfig,
    build_optimizer,
)
from megabuf.pipeline import default_schedule_hooks, get_forward_backward_func, wrap_model_chunks
from megabuf.planning.replicas import mark_expert_parallel
from megabuf.training.budget import plan_for_budget
from megabuf.training.finalize import finalize_model_grads
from megabuf.training.reproducible import verify_reproducible
from megabuf.transport.distributed_init import init_distributed
from megabuf.transport.process_groups import ProcessGroups

__all__ = [
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DistributedOptimizer",
    "FP32Optimizer",
    "MegabufOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "ProcessGroups",
    "build_optimizer",
    "default_schedule_hooks",
    "finalize_model_grads",
    "full_state_dict",
    "get_forward_backward_func",
    "init_distributed",
    "load_checkpoint",
    "mark_expert_parallel",
    "plan_for_budget",
    "save_checkpoint",
    "verify_reproducible",
    "wrap_model_chunks",
]
