"""Which adapter a float8 weight belongs to ([Note: FP8 params] in megabuf/fp8/__init__.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from megabuf.fp8.spec import Fp8Adapter
from megabuf.fp8.te_adapter import te_adapter
from megabuf.fp8.torchao_adapter import torchao_adapter


def installed_adapters() -> list[Fp8Adapter]:
    """The adapters whose library is imported (nothing is imported here: a weight of a library
    that was never imported cannot be in the model)."""
    return [a for a in (torchao_adapter(), te_adapter()) if a is not None]


def adapter_for(param: Tensor) -> Fp8Adapter | None:
    """The adapter of a float8 weight (the user's or the engine's FP8 param), or None."""
    for adapter in installed_adapters():
        if adapter.claims(param) or adapter.is_converted(param):
            return adapter
    return None


def is_fp8_param(param: Tensor) -> bool:
    """A float8 training weight (as the user's model holds it, or as the engine made it)."""
    return adapter_for(param) is not None


def is_converted_fp8(param: Tensor) -> bool:
    """An engine FP8 param (its bytes live in a uint8 param buffer)."""
    return any(a.is_converted(param) for a in installed_adapters())


def broadcast_tensors(param: Tensor) -> list[Tensor]:
    """What broadcasting a param moves: its data, or an FP8 param's bytes and scale."""
    adapter = adapter_for(param) if is_converted_fp8(param) else None
    if adapter is None:
        return [param.data]
    data, scale = adapter.parts(param)
    return [data.view(torch.uint8), scale]
