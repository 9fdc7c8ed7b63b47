"""`build`: a built-in comm hook from a config table (`DistributedDataParallelConfig.comm_hook`).

Its own module, above every hook it can build: the hooks import `builtin`, never this."""

from __future__ import annotations

from typing import Any

import torch

from megabuf.comm_hooks.batched_powersgd import BatchedPowerSGD
from megabuf.comm_hooks.builtin import Compress, Noop, Reduce
from megabuf.comm_hooks.fixed_order import Deterministic
from megabuf.comm_hooks.local_sgd import LocalSGD
from megabuf.comm_hooks.powersgd import PowerSGD
from megabuf.comm_hooks.quantize import Quantize
from megabuf.comm_hooks.wrappers import CompressWrapper


def build(spec: dict[str, Any]) -> Any:
    """A built-in hook from a config table: {"name": "reduce"|"noop"|"compress"|
    "compress_wrapper"|"deterministic"|"quantize"|"local_sgd"|"powersgd"|"batched_powersgd",
    options...};
    `dtype` and `factor_dtype` may be strings ("bfloat16"); compress_wrapper's `inner` is a hook
    name ("reduce") or a table of its own."""
    options = dict(spec)
    name = str(options.pop("name", "")).lower()
    factories: dict[str, Any] = {"reduce": Reduce, "noop": Noop, "compress": Compress}
    factories |= {"deterministic": Deterministic}
    factories |= {"compress_wrapper": CompressWrapper, "quantize": Quantize, "local_sgd": LocalSGD}
    factories |= {"powersgd": PowerSGD, "batched_powersgd": BatchedPowerSGD}
    if name == "compress_wrapper" and "inner" in options:
        inner = options["inner"]
        options["inner"] = build({"name": inner} if isinstance(inner, str) else dict(inner))
    if name not in factories:
        raise ValueError(
            f"megabuf: unknown comm_hook name {name!r}; built-ins: {sorted(factories)}"
        )
    for key in ("dtype", "factor_dtype"):
        if isinstance(options.get(key), str):
            dtype = getattr(torch, options[key].removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"megabuf: comm_hook {key} {options[key]!r} is not a torch dtype")
            options[key] = dtype
    try:
        return factories[name](**options)
    except TypeError as exc:
        raise ValueError(f"megabuf: bad options for comm_hook {name!r}: {exc}") from exc
