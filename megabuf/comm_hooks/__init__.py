"""Communication hooks on megabuf's buckets ([Note: comm hook contract] in contract.py).

Register with `DistributedDataParallel.register_comm_hook(hook, buffers=...)` or the config's
`comm_hook` table. Built-ins: `Reduce`, `Noop`, `Compress`, `Quantize`, `LocalSGD` (with its
`PeriodicAverager`), `PowerSGD`, `BatchedPowerSGD`.
"""

from megabuf.comm_hooks.batched_powersgd import BatchedPowerSGD
from megabuf.comm_hooks.builtin import Compress, CompressDtypeError, Noop, Reduce, build
from megabuf.comm_hooks.contract import (
    CommHook,
    CommHookError,
    CommHookModeError,
    CommHookRegistrationError,
    CommHookResultError,
    GradBucket,
    HookWork,
)
from megabuf.comm_hooks.local_sgd import LocalSGD, LocalSGDError, PeriodicAverager
from megabuf.comm_hooks.quantize import Quantize, QuantizeError
from megabuf.comm_hooks.powersgd import PowerSGD

__all__ = [
    "BatchedPowerSGD",
    "CommHook",
    "CommHookError",
    "CommHookModeError",
    "CommHookRegistrationError",
    "CommHookResultError",
    "Compress",
    "CompressDtypeError",
    "GradBucket",
    "HookWork",
    "LocalSGD",
    "LocalSGDError",
    "Noop",
    "PeriodicAverager",
    "Quantize",
    "QuantizeError",
    "PowerSGD",
    "Reduce",
    "build",
]
