"""The Transformer Engine adapter, present only when `transformer_engine` is imported.

TE keeps FP8 weights as its `Float8Tensor` (uint8 `_data`, fp32 `_scale_inv`). This adapter
recognises them so they are never mistaken for high precision weights; it refuses them at
construction, naming the supported path (torchao), because TE's cast and scale rule could not be
run where this adapter was written (TE is not installed there) and megabuf does not ship an FP8
path it has not checked bitwise ([Note: FP8 params] in megabuf/fp8/__init__.py).
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

from megabuf.fp8.spec import Fp8Adapter, Fp8Spec


class TransformerEngineAdapter:
    """Detects TE's `Float8Tensor` params; every conversion refuses ([Note: FP8 params])."""

    name = "transformer_engine"

    def __init__(self, float8_tensor_type: type) -> None:
        self._type = float8_tensor_type

    def claims(self, param: Tensor) -> bool:
        return isinstance(param, self._type)

    def is_converted(self, param: Tensor) -> bool:
        return False

    def check_module(self, module: nn.Module, name: str) -> None:
        return None  # its weights are refused (`check_recipe`)

    def check_recipe(self, module: nn.Module, name: str) -> None:
        raise ValueError(
            f"megabuf: FP8 param {name!r} is a Transformer Engine Float8Tensor; megabuf's FP8 "
            "params support torchao's 'tensorwise' recipe only (convert_to_float8_training with "
            "Float8LinearConfig(enable_fsdp_float8_all_gather=True)); build the model's linears "
            "with torchao, or keep TE weights in high precision (fp8_model_init off)"
        )

    def spec(self, module: nn.Module, param: Tensor, name: str) -> Fp8Spec:
        self.check_recipe(module, name)
        raise AssertionError("unreachable")  # pragma: no cover

    def _refuse(self) -> None:
        self.check_recipe(nn.Module(), "<Transformer Engine weight>")

    def hp_value(self, param: Tensor) -> Tensor:
        self._refuse()
        return param  # pragma: no cover

    def scale(self, amax: Tensor, spec: Fp8Spec) -> Tensor:
        self._refuse()
        return amax  # pragma: no cover

    def cast(self, hp: Tensor, scale: Tensor, spec: Fp8Spec) -> Tensor:
        self._refuse()
        return hp  # pragma: no cover

    def new_param(self, data: Tensor, scale: Tensor, spec: Fp8Spec) -> nn.Parameter:
        self._refuse()
        return nn.Parameter(data)  # pragma: no cover

    def repoint(self, param: Tensor, data: Tensor, scale: Tensor) -> None:
        self._refuse()

    def parts(self, param: Tensor) -> tuple[Tensor, Tensor]:
        self._refuse()
        return param, param  # pragma: no cover

    def dequantize(self, param: Tensor) -> Tensor:
        self._refuse()
        return param  # pragma: no cover


def te_float8_tensor_type() -> type | None:
    """TE's Float8Tensor class when transformer_engine is imported, else None."""
    if "transformer_engine" not in sys.modules:
        return None
    for module_name in (
        "transformer_engine.pytorch.tensor.float8_tensor",
        "transformer_engine.pytorch.float8_tensor",
    ):
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, "Float8Tensor"):
            return module.Float8Tensor  # type: ignore[no-any-return]
    return None


def te_adapter() -> Fp8Adapter | None:
    """The adapter when transformer_engine is imported, else None."""
    cls = te_float8_tensor_type()
    return None if cls is None else TransformerEngineAdapter(cls)
