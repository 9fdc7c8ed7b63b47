"""The FP8 adapter protocol: what the engine needs from a library's float8 weights.

A library that trains with float8 weights (torchao, Transformer Engine) installs its own
tensor subclass as the weight. An adapter recognises that weight, refuses a recipe megabuf does
not support, and converts it into the engine's FP8 param: a parameter whose bytes view the
engine's uint8 param buffer and whose scale is one fp32 element, presented to forward in the
library's own float8 tensor type so forward does not re-cast ([Note: FP8 params] in
megabuf/fp8/__init__.py). The scale rule and the cast are always the library's own functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Fp8Spec:
    """What the engine keeps about one FP8 param (its adapter answers the rest)."""

    name: str  # the param's name in the wrapped module
    fp8_dtype: torch.dtype  # float8_e4m3fn, ...: the dtype its bytes hold
    hp_dtype: torch.dtype  # the weight's high precision dtype (grads and the master)
    options: Any  # adapter-private (torchao: the LinearMMConfig and the scale rounding)


class Fp8Adapter(Protocol):
    """One library's float8 weights; every method is pure tensor work (no collective)."""

    name: str

    def claims(self, param: Tensor) -> bool:
        """True for the library's float8 training weight as the user's model holds it."""
        ...

    def is_converted(self, param: Tensor) -> bool:
        """True for an engine FP8 param this adapter made (`new_param`)."""
        ...

    def check_module(self, module: nn.Module, name: str) -> None:
        """Raise ValueError naming `name` if this library's module `module` trains with a
        recipe megabuf does not support (whatever its weight is)."""
        ...

    def check_recipe(self, module: nn.Module, name: str) -> None:
        """Raise ValueError naming `name`, the recipe and the supported one, unless `module`
        (the owner of weight `name`) uses tensorwise dynamic scaling."""
        ...

    def spec(self, module: nn.Module, param: Tensor, name: str) -> Fp8Spec: ...

    def hp_value(self, param: Tensor) -> Tensor:
        """The user's weight in high precision (a plain tensor, the param's shape)."""
        ...

    def scale(self, amax: Tensor, spec: Fp8Spec) -> Tensor:
        """fp32 scales from fp32 amaxes (elementwise), by the library's own rule."""
        ...

    def cast(self, hp: Tensor, scale: Tensor, spec: Fp8Spec) -> Tensor:
        """`hp` cast to `spec.fp8_dtype` with `scale` (0-d), by the library's own cast."""
        ...

    def new_param(self, data: Tensor, scale: Tensor, spec: Fp8Spec) -> nn.Parameter:
        """The param forward reads: `data` (fp8 dtype, the weight's shape) and `scale` (0-d
        fp32) are viewed, not copied."""
        ...

    def repoint(self, param: Tensor, data: Tensor, scale: Tensor) -> None:
        """Make the FP8 param view other memory (`data`, `scale`: as in `new_param`)."""
        ...

    def parts(self, param: Tensor) -> tuple[Tensor, Tensor]:
        """(data in the fp8 dtype, 0-d fp32 scale) the FP8 param views."""
        ...

    def dequantize(self, param: Tensor) -> Tensor:
        """The FP8 param's value in its high precision dtype (a new plain tensor)."""
        ...
