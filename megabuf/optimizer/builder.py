"""`build_optimizer`: the right megabuf optimizer for DDP model chunks from an `OptimizerConfig`."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from megabuf.ddp import DistributedDataParallel
from megabuf.devices import params_device
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.config import OptimizerConfig
from megabuf.optimizer.distributed import DistributedOptimizer
from megabuf.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megabuf.optimizer.mixed_precision import FP32Optimizer, MixedPrecisionOptimizer
from megabuf.optimizer.param_groups import ParamGroupsArg, as_chunks

logger = logging.getLogger(__name__)


def build_optimizer(
    model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
    config: OptimizerConfig,
    param_groups: ParamGroupsArg = None,
) -> MegabufOptimizer:
    """DistributedOptimizer when the chunks' DDP config says use_distributed_optimizer, else
    MixedPrecisionOptimizer (bf16/fp16 params) or FP32Optimizer. Dense and expert params get
    separate inner optimizers stepped under one global grad norm.

    `param_groups` is torch's format, over the wrapped model's trainable params: None (one
    group of every param), an iterable of params, or an iterable of dicts
    `{"params": [p, ...], <hyperparameter>: value, ...}` whose hyperparameters override the
    config's for that group (e.g. `{"params": no_decay, "weight_decay": 0.0}`). Every trainable
    param must be in exactly one group; anything else raises a ValueError naming the group.
    """
    chunks = as_chunks(model_chunks)
    flags = {c.ddp_config.use_distributed_optimizer for c in chunks}
    if len(flags) > 1:
        raise ValueError(
            "megabuf: build_optimizer got model chunks with different "
            "use_distributed_optimizer settings; build every chunk with the same DDP config"
        )
    params = [p for c in chunks for p in c.param_to_name]
    dtypes = {p.dtype for p in params}
    _check_precision(config, dtypes)
    device = params_device(params, None)  # [Note: allocation device]
    optimizer_cls, kwargs = optimizer_class_and_kwargs(config, device)
    grad_scaler = make_grad_scaler(config, device)
    if flags == {True}:
        cls: type[MegabufOptimizer] = DistributedOptimizer
    elif dtypes <= {torch.float32}:
        cls = FP32Optimizer
    else:
        cls = MixedPrecisionOptimizer
    logger.debug("megabuf: building %s around %s", cls.__name__, optimizer_cls.__name__)
    return cls(
        chunks, optimizer_cls, param_groups,
        clip_grad=config.clip_grad, grad_scaler=grad_scaler,
        log_num_zeros_in_grad=config.log_num_zeros_in_grad, **kwargs,
    )  # fmt: skip


def _check_precision(config: OptimizerConfig, dtypes: set[torch.dtype]) -> None:
    if torch.float16 in dtypes and not config.fp16:
        raise ValueError(
            "megabuf: the model has fp16 params but OptimizerConfig.fp16=False; fp16 training "
            "needs a loss scaler: set fp16=True (dynamic scaling) or fp16=True and loss_scale"
        )
    half = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    for dtype, flag in half.items():
        if getattr(config, flag) and dtype not in dtypes:
            logger.warning("megabuf: OptimizerConfig.%s=True but no param is %s", flag, dtype)


def make_grad_scaler(config: OptimizerConfig, device: torch.device) -> GradScaler | None:
    """Constant scaler if loss_scale is set, dynamic for fp16 without it, else none."""
    if config.loss_scale is not None:
        return ConstantGradScaler(config.loss_scale, device)
    if not config.fp16:
        return None
    return DynamicGradScaler(
        config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_factor=config.growth_factor,
        backoff_factor=config.backoff_factor,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
        device=device,
    )


def optimizer_class_and_kwargs(
    config: OptimizerConfig, device: torch.device
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch optimizer class (a fused GPU Adam when importable) and its constructor args."""
    common = {"lr": config.lr, "weight_decay": config.weight_decay}
    if not isinstance(config.optimizer, str):
        return config.optimizer, common
    if config.optimizer == "sgd":
        return torch.optim.SGD, {**common, "momentum": config.sgd_momentum}
    adam = {**common, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps}
    decoupled = config.optimizer == "adamw"
    fused = _fused_adam(device)
    if fused is not None:
        return fused, {**adam, "adam_w_mode": decoupled}
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), adam


def _fused_adam(device: torch.device) -> type[torch.optim.Optimizer] | None:
    """Transformer Engine's or apex's multi-tensor FusedAdam, on CUDA only."""
    if device.type != "cuda":
        return None
    for module, name in (("transformer_engine.pytorch.optimizers", "FusedAdam"),
                         ("apex.optimizers", "FusedAdam")):  # fmt: skip
        try:
            mod = __import__(module, fromlist=[name])
        except ImportError:
            continue
        return getattr(mod, name)  # type: ignore[no-any-return]
    return None
