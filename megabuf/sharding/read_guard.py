"""`StrayReadGuard`: the first forward of each kind checks every read of a sharded param.

[Note: stray reads]
Under optim_grads_params a param is readable only between its unit's gather and release
([Note: who gathers when] in units_runtime.py). A module that reads a param its enclosing units
do not own (a parent reading a child unit's weight through `F.linear`, a `ParameterList` chosen
as a unit but read by its parent, a sibling reading another unit's weight) reads a 0-byte
storage: some kernels raise torch's "out of bounds for storage of size 0", others (elementwise
CPU kernels) dereference a null pointer and crash the process. So the first forward with grad
on and the first without run under this TorchFunctionMode: before any torch function runs, a
sharded param among its arguments whose unit is not gathered raises a RuntimeError naming the
param, its unit and the unit running; reads of metadata only (`.dtype`, `.shape`, `.size()`,
..., `METADATA_READS`) are allowed, a released param keeps them. Later forwards run unguarded
(no per-op cost); a read that only a later forward makes, or a read outside forward (use
`model.summon_full_params()`), is not caught. `verify_param_access=True` keeps released storage
NaN-filled instead, so such reads give NaN rather than a crash.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from megabuf.sharding.params import ParamShardState, ShardedParams

_METADATA_PROPERTIES = (
    "dtype", "shape", "device", "requires_grad", "is_leaf", "ndim", "layout", "is_cuda",
    "is_meta", "is_sparse", "is_quantized", "names", "grad_fn", "itemsize",
)  # fmt: skip
_METADATA_METHODS = (
    "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "nelement",
    "get_device", "is_contiguous", "stride",
)  # fmt: skip
METADATA_READS = frozenset(
    [getattr(torch.Tensor, n).__get__ for n in _METADATA_PROPERTIES if hasattr(torch.Tensor, n)]
    + [getattr(torch.Tensor, n) for n in _METADATA_METHODS]
)
"""Torch functions that read a tensor's metadata, never its storage: a released param keeps its
shape, dtype and device, so `x.to(self.fc.weight.dtype)` in another unit is not a stray read."""


class StrayReadGuard(TorchFunctionMode):
    """See [Note: stray reads]. `owners`: every sharded param -> (name, unit name, storage);
    `running`: the name of the innermost unit whose forward is running."""

    def __init__(
        self,
        owners: Mapping[nn.Parameter, tuple[str, str, ShardedParams]],
        running: Callable[[], str],
        rank: int,
    ) -> None:
        super().__init__()
        self.owners = owners
        self.running = running
        self.rank = rank

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA_READS:
            return func(*args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        for arg in flat:
            if isinstance(arg, nn.Parameter):
                owner = self.owners.get(arg)
                if owner is not None and owner[2].state is not ParamShardState.UNSHARDED:
                    self._raise(*owner)
        return func(*args, **kwargs)

    def _raise(self, name: str, unit: str, storage: ShardedParams) -> None:
        raise RuntimeError(
            f"megabuf: {name} (shard unit {unit or '<root>'}) is read while its unit's params "
            f"are released ({storage.state.name}), inside the forward of unit "
            f"{self.running() or '<root>'} (rank {self.rank}). Under optim_grads_params a param "
            "is gathered only around its own unit's forward and backward: choose "
            "DistributedDataParallelConfig.shard_units so that the module reading it encloses "
            "it (e.g. drop its module from the units), and read params outside forward inside "
            "model.summon_full_params()"
        )
