"""Communication hooks on megabuf's buckets ([Note: comm hook contract] in contract.py).

Register with `DistributedDataParallel.register_comm_hook(hook, buffers=...)` or the config's
`comm_hook` table. Built-ins: `Reduce`, `Noop`, `Compress`, `Quantize`, `LocalSGD` (with its
`PeriodicAverager`), `PowerSGD`, `BatchedPowerSGD`,
`CompressWrapper`; torch DDP hooks run through `from_torch` ([Note: torch hooks on megabuf
buckets]);
`Deterministic` (what `deterministic_reduction=True` installs: [Note: deterministic reduction]).
Wire bytes per hook and bucket: `hook_report(model)` ([Note: hook wire bytes] in
telemetry.py).
"""

from megabuf.comm_hooks.batched_powersgd import BatchedPowerSGD
from megabuf.comm_hooks.builtin import Compress, CompressDtypeError, Noop, Reduce
from megabuf.comm_hooks.contract import (
    CommHook,
    CommHookError,
    CommHookHybridError,
    CommHookModeError,
    CommHookRegistrationError,
    CommHookResultError,
    CommHookTimeoutError,
    GradBucket,
    HookTally,
    HookWork,
)
from megabuf.comm_hooks.factory import build
from megabuf.comm_hooks.fixed_order import (
    Deterministic,
    DeterministicReductionError,
    fixed_order_sum,
)
from megabuf.comm_hooks.local_sgd import LocalSGD, LocalSGDError, PeriodicAverager
from megabuf.comm_hooks.powersgd import PowerSGD
from megabuf.comm_hooks.quantize import Quantize, QuantizeError
from megabuf.comm_hooks.telemetry import BucketWire, HookReport, hook_report, wire_formula
from megabuf.comm_hooks.torch_adapter import (
    CommHookGroupError,
    CommHookScalingError,
    TorchGradBucket,
    TorchHook,
    from_torch,
)
from megabuf.comm_hooks.wrappers import CompressWrapper

__all__ = [
    "BatchedPowerSGD",
    "BucketWire",
    "CommHook",
    "CommHookError",
    "CommHookGroupError",
    "CommHookHybridError",
    "CommHookModeError",
    "CommHookRegistrationError",
    "CommHookResultError",
    "CommHookScalingError",
    "CommHookTimeoutError",
    "Compress",
    "CompressDtypeError",
    "CompressWrapper",
    "Deterministic",
    "DeterministicReductionError",
    "GradBucket",
    "HookReport",
    "HookTally",
    "HookWork",
    "LocalSGD",
    "LocalSGDError",
    "Noop",
    "PeriodicAverager",
    "PowerSGD",
    "Quantize",
    "QuantizeError",
    "Reduce",
    "TorchGradBucket",
    "TorchHook",
    "build",
    "fixed_order_sum",
    "from_torch",
    "hook_report",
    "wire_formula",
]
