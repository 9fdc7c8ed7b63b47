"""megabuf: Megatron-style contiguous param-and-grad buffers for data-parallel PyTorch training."""

from megabuf.bucket_group import BucketGroup, GradSyncState, ParamSyncState, partition_buckets
from megabuf.buffer import _ParamAndGradBucket, _ParamAndGradBuffer
from megabuf.checkpoint import load_checkpoint, save_checkpoint
from megabuf.collectives import Collectives, CommStats
from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
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
    "_ParamAndGradBucket",
    "_ParamAndGradBuffer",
    "build_optimizer",
    "compute_layout",
    "init_distributed",
    "is_expert_parallel",
    "load_checkpoint",
    "mark_expert_parallel",
    "partition_buckets",
    "save_checkpoint",
]
