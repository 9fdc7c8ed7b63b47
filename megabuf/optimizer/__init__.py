"""megabuf optimizers: distributed (ZeRO-1) and non-distributed, with one `step()` contract."""

from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.builder import build_optimizer
from megabuf.optimizer.config import OptimizerConfig
from megabuf.optimizer.distributed import DistributedOptimizer
from megabuf.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megabuf.optimizer.memory import OptimizerMemoryReport
from megabuf.optimizer.mixed_precision import FP32Optimizer, MixedPrecisionOptimizer
from megabuf.optimizer.muon import MatrixOptimizerError, MuonAdamW, muon_param_groups
from megabuf.optimizer.records import StepResult

__all__ = [
    "ConstantGradScaler",
    "DistributedOptimizer",
    "DynamicGradScaler",
    "FP32Optimizer",
    "GradScaler",
    "MatrixOptimizerError",
    "MegabufOptimizer",
    "MixedPrecisionOptimizer",
    "MuonAdamW",
    "OptimizerConfig",
    "OptimizerMemoryReport",
    "StepResult",
    "build_optimizer",
    "muon_param_groups",
]
