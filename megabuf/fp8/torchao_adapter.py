"""The torchao adapter: `convert_to_float8_training(..., Float8LinearConfig(
enable_fsdp_float8_all_gather=True))` weights become engine FP8 params ([Note: FP8 params]).

The user's weight is torchao's `WeightWithDynamicFloat8CastTensor`; the engine's FP8 param is an
`nn.Parameter` of torchao's `Float8TrainingTensor` whose `_data` views the uint8 param buffer and
whose `_scale` views one element of the buffer's scales, so `Float8Linear` sees a weight already
cast and does not cast it again. Scale: torchao's `amax_to_scale`; cast: torchao's
`hp_tensor_and_scale_to_float8`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from megabuf.fp8.spec import Fp8Adapter, Fp8Spec

SUPPORTED_RECIPE = "tensorwise"  # torchao's Float8LinearRecipeName.TENSORWISE: dynamic scaling


class TorchaoFloat8Adapter:
    """`Fp8Adapter` for torchao.float8 (tested with torchao 0.18.0)."""

    name = "torchao"

    def __init__(self) -> None:
        from torchao.float8.float8_training_tensor import Float8TrainingTensor
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        self._weight_type = WeightWithDynamicFloat8CastTensor
        self._fp8_type = Float8TrainingTensor

    def claims(self, param: Tensor) -> bool:
        return isinstance(param, self._weight_type)

    def is_converted(self, param: Tensor) -> bool:
        return isinstance(param, self._fp8_type)

    def check_module(self, module: nn.Module, name: str) -> None:
        """A torchao float8 module with an unsupported recipe, or an MX (block scaled) module,
        is refused whatever its weight."""
        if type(module).__module__.startswith("torchao.prototype.mx_formats"):
            raise ValueError(
                f"megabuf: module {name!r} ({type(module).__name__}) trains with MX block "
                f"scales; megabuf's FP8 params support only torchao's {SUPPORTED_RECIPE!r} "
                "recipe (Float8LinearConfig(enable_fsdp_float8_all_gather=True), docs/fp8.md)"
            )
        from torchao.float8.float8_linear import Float8Linear

        if isinstance(module, Float8Linear):
            self.check_recipe(module, f"{name}.weight" if name else "weight")

    def check_recipe(self, module: nn.Module, name: str) -> None:
        config = getattr(module, "config", None)
        problem = _recipe_problem(config)
        if problem is not None:
            raise ValueError(
                f"megabuf: FP8 param {name!r} uses {problem}; megabuf's FP8 params support only "
                f"torchao's {SUPPORTED_RECIPE!r} recipe (dynamic tensorwise scaling, "
                "Float8LinearConfig(enable_fsdp_float8_all_gather=True)); convert the model with "
                "that recipe, or without enable_fsdp_float8_all_gather to keep the weights in "
                "high precision (docs/fp8.md)"
            )

    def spec(self, module: nn.Module, param: Tensor, name: str) -> Fp8Spec:
        config: Any = module.config  # checked by check_recipe
        options = (param._linear_mm_config, bool(config.round_scales_to_power_of_2))  # type: ignore[attr-defined]
        return Fp8Spec(name, param._dtype, param.dtype, options)  # type: ignore[attr-defined]

    def hp_value(self, param: Tensor) -> Tensor:
        return param._tensor.detach()  # type: ignore[attr-defined, no-any-return]

    def scale(self, amax: Tensor, spec: Fp8Spec) -> Tensor:
        from torchao.float8.float8_utils import amax_to_scale

        return amax_to_scale(amax, spec.fp8_dtype, round_scales_to_power_of_2=spec.options[1])  # type: ignore[no-any-return]

    def cast(self, hp: Tensor, scale: Tensor, spec: Fp8Spec) -> Tensor:
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            hp_tensor_and_scale_to_float8,
        )

        cast = hp_tensor_and_scale_to_float8(
            hp, scale, spec.fp8_dtype, spec.options[0], GemmInputRole.WEIGHT
        )
        return cast._data  # type: ignore[no-any-return]

    def new_param(self, data: Tensor, scale: Tensor, spec: Fp8Spec) -> nn.Parameter:
        from torchao.float8.float8_training_tensor import GemmInputRole

        tensor = self._fp8_type(data, scale, spec.hp_dtype, spec.options[0], GemmInputRole.WEIGHT)
        return nn.Parameter(tensor)

    def repoint(self, param: Tensor, data: Tensor, scale: Tensor) -> None:
        param._data = data  # type: ignore[attr-defined]
        param._scale = scale  # type: ignore[attr-defined]

    def parts(self, param: Tensor) -> tuple[Tensor, Tensor]:
        return param._data, param._scale  # type: ignore[attr-defined]

    def dequantize(self, param: Tensor) -> Tensor:
        data, scale = self.parts(param)
        return (data.to(torch.float32) / scale).to(param.dtype)


def _recipe_problem(config: Any) -> str | None:
    """Why a Float8Linear's config is not tensorwise dynamic scaling, or None."""
    if config is None:
        return "a module without a torchao Float8LinearConfig"
    from torchao.float8.config import ScalingGranularity, ScalingType

    casts = {
        "input": config.cast_config_input,
        "weight": config.cast_config_weight,
        "grad_output": config.cast_config_grad_output,
        "input_for_grad_weight": config.cast_config_input_for_grad_weight,
        "weight_for_grad_input": config.cast_config_weight_for_grad_input,
        "grad_output_for_grad_weight": config.cast_config_grad_output_for_grad_weight,
    }
    for role, cast in casts.items():
        if cast.scaling_granularity is not ScalingGranularity.TENSORWISE:
            return (
                f"{cast.scaling_granularity.value} scaling of its {role} (the "
                f"{_recipe_name(config)!r} recipe)"
            )
        if role.startswith("weight") and cast.scaling_type is not ScalingType.DYNAMIC:
            return f"{cast.scaling_type.value} scaling of its {role} (not dynamic)"
    return None


def _recipe_name(config: Any) -> str:
    """torchao's name of the recipe `config` is (whatever its FSDP all-gather flag), or
    'custom'."""
    from dataclasses import replace

    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName

    for recipe in Float8LinearRecipeName:
        named = Float8LinearConfig.from_recipe_name(recipe)
        flag = config.enable_fsdp_float8_all_gather
        if replace(named, enable_fsdp_float8_all_gather=flag) == config:
            return str(recipe.value)
    return "custom"


def torchao_adapter() -> Fp8Adapter | None:
    """The adapter when torchao.float8 is imported, else None (its weights cannot exist)."""
    if "torchao.float8" not in sys.modules:
        return None
    return TorchaoFloat8Adapter()
