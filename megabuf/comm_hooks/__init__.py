"""Communication hooks on megabuf's buckets ([Note: comm hook contract] in contract.py).

Register with `DistributedDataParallel.register_comm_hook(hook, buffers=...)` or the config's
`comm_hook` table. Built-ins: `Reduce`, `Noop`, `Compress`. Wire bytes per hook and bucket:
`hook_report(model)` ([Note: hook wire bytes] in telemetry.py).
"""

from megabuf.comm_hooks.builtin import Compress, CompressDtypeError, Noop, Reduce, build
from megabuf.comm_hooks.contract import (
    CommHook,
    CommHookError,
    CommHookModeError,
    CommHookRegistrationError,
    CommHookResultError,
    GradBucket,
    HookTally,
    HookWork,
)
from megabuf.comm_hooks.telemetry import BucketWire, HookReport, hook_report, wire_formula

__all__ = [
    "BucketWire",
    "CommHook",
    "CommHookError",
    "CommHookModeError",
    "CommHookRegistrationError",
    "CommHookResultError",
    "Compress",
    "CompressDtypeError",
    "GradBucket",
    "HookReport",
    "HookTally",
    "HookWork",
    "Noop",
    "Reduce",
    "build",
    "hook_report",
    "wire_formula",
]
