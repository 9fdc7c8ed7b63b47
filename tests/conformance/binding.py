"""Which `DistributedDataParallel` torch's own DDP tests construct: [Note: binding].

[Note: binding]
torch's test modules reach DDP by three names: `torch.nn.parallel.DistributedDataParallel`
(spelt `nn.parallel.DistributedDataParallel` or in full) and the module-level name each test
module imported when it was imported (`from torch.nn.parallel import DistributedDataParallel` in
distributed_test.py and ddp_under_dist_autograd_test.py). `bind()` points all of them at the
chosen class, in the runner process, after the test modules are imported and before any rank
starts. Ranks are forked from that process (suite.py), so every rank sees the binding; nothing
adapts megabuf: the tests call it as they would call torch DDP. `torch.nn.parallel.distributed.
DistributedDataParallel` (the defining module) is left alone, so torch's own internals keep
theirs.

The `torch-probe` binding is torch DDP itself, subclassed only to leave a marker file when a rank
constructs one (`--discover` uses it to see which tests build a DDP).
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any

import torch

IMPLS = ("megabuf", "torch", "torch-probe")
TEST_MODULES = (
    "torch.testing._internal.distributed.distributed_test",
    "torch.testing._internal.distributed.ddp_under_dist_autograd_test",
)
PROBE_ENV = "MEGABUF_CONFORMANCE_PROBE_FILE"
_TORCH_DDP = torch.nn.parallel.DistributedDataParallel


class _ProbeDDP(_TORCH_DDP):  # type: ignore[misc,valid-type]
    """torch DDP that leaves a marker file (named by PROBE_ENV) when constructed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        marker = os.environ.get(PROBE_ENV)
        if marker:
            pathlib.Path(marker).touch()
        super().__init__(*args, **kwargs)


def ddp_class(impl: str) -> type:
    if impl == "megabuf":
        import megabuf

        return megabuf.DistributedDataParallel
    if impl == "torch":
        return _TORCH_DDP
    if impl == "torch-probe":
        return _ProbeDDP
    raise ValueError(f"conformance: unknown DDP implementation {impl!r}; one of {IMPLS}")


def bind(impl: str) -> type:
    """Point every name the test modules use for DDP at `impl`'s class; returns that class."""
    cls = ddp_class(impl)
    torch.nn.parallel.DistributedDataParallel = cls  # type: ignore[misc]
    for name in TEST_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            module.DistributedDataParallel = cls  # type: ignore[attr-defined]
    return cls


def bound_classes() -> dict[str, type]:
    """What each name resolves to now (the runner checks it before starting ranks)."""
    names = {"torch.nn.parallel.DistributedDataParallel": torch.nn.parallel.DistributedDataParallel}
    for name in TEST_MODULES:
        module = sys.modules.get(name)
        if module is not None:
            names[f"{name}.DistributedDataParallel"] = module.DistributedDataParallel
    return names
