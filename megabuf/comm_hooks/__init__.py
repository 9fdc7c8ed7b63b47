"""Communication hooks on megabuf's buckets ([Note: comm hook contract] in contract.py).

Register with `DistributedDataParallel.register_comm_hook(hook, buffers=...)` or the config's
`comm_hook` table. Built-ins: `Reduce`, `Noop`, `Compress`, `Deterministic` (what
`deterministic_reduction=True` installs: [Note: deterministic reduction]).
"""

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
from megabuf.comm_hooks.fixed_order import (
    Deterministic,
    DeterministicReductionError,
    fixed_order_sum,
)

__all__ = [
    "CommHook",
    "CommHookError",
    "CommHookModeError",
    "CommHookRegistrationError",
    "CommHookResultError",
    "Compress",
    "CompressDtypeError",
    "Deterministic",
    "DeterministicReductionError",
    "GradBucket",
    "HookWork",
    "Noop",
    "Reduce",
    "build",
    "fixed_order_sum",
]
