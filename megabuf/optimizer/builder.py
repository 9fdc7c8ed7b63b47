"""`build_optimizer`: the right megabuf optimizer for DDP model chunks from an `OptimizerConfig`."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.config import OptimizerConfig
from megabuf.optimizer.distributed import DistributedOptimizer
from megabuf.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler, GradScaler
from megabuf.optimizer.implementation import (
    PACKAGES,
    ImplementationChoice,
    choose_implementation,
)
from megabuf.optimizer.mixed_precision import FP32Optimizer, MixedPrecisionOptimizer
from megabuf.optimizer.muon import MuonAdamW, muon_param_groups
from megabuf.optimizer.param_groups import ParamGroupsArg, as_chunks
from megabuf.transport.devices import params_device

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
    With optimizer="muon" and no `param_groups`: `muon_param_groups` (Muon for 2-D weights but
    embeddings, AdamW for the rest); groups given by hand say `use_muon` per group.
    """
    chunks = as_chunks(model_chunks)
    flags = {c.ddp_config.sharding.shards_optimizer for c in chunks}
    if len(flags) > 1:
        raise ValueError(
            "megabuf: build_optimizer got model chunks with different "
            "use_distributed_optimizer settings; build every chunk with the same DDP config"
        )
    for chunk in chunks:  # [Note: sparse grads outside the buffer] in megabuf/sync/sparse_grads.py
        if chunk.engine.sparse_grads.named:
            names = [n for n, _ in chunk.engine.sparse_grads.named]
            raise ValueError(
                f"megabuf: build_optimizer steps the grad buffers, and params {names} have "
                "sparse grads outside them (nn.Embedding / nn.EmbeddingBag(sparse=True)); step "
                "this model with a torch optimizer that takes sparse grads (SGD, Adagrad, "
                "SparseAdam for those params), or use sparse=False"
            )
    params = [p for c in chunks for p in c.engine.param_to_name]
    dtypes = {p.dtype for p in params}
    _check_precision(config, dtypes)
    device = params_device(params, None)  # [Note: allocation device]
    # cpu_offload on an accelerator: the inner optimizer steps host tensors ([Note: cpu offload])
    # (cpu_offload is refused under strategies that do not shard the optimizer)
    offload = any(c.ddp_config.cpu_offload for c in chunks)
    step_device = torch.device("cpu") if offload else device
    optimizer_cls, kwargs = optimizer_class_and_kwargs(config, step_device)
    grad_scaler = make_grad_scaler(config, device)
    if config.optimizer == "muon" and param_groups is None:
        param_groups = muon_param_groups(chunks, config.muon_lr)
    # [Note: strategies build their parts] in megabuf/sharding/strategies.py
    cls = chunks[0].ddp_config.sharding.optimizer(_OptimizerClasses(dtypes))
    logger.debug("megabuf: building %s around %s", cls.__name__, optimizer_cls.__name__)
    return cls(
        chunks, optimizer_cls, param_groups,
        clip_grad=config.clip_grad, grad_scaler=grad_scaler,
        log_num_zeros_in_grad=config.log_num_zeros_in_grad, **kwargs,
    )  # fmt: skip


@dataclass(frozen=True)
class _OptimizerClasses:
    """The `OptimizerKit` of the sharding strategy: which class steps the params."""

    dtypes: set[torch.dtype]  # of every trainable param

    def distributed(self) -> type[MegabufOptimizer]:
        return DistributedOptimizer

    def replicated(self) -> type[MegabufOptimizer]:
        return FP32Optimizer if self.dtypes <= {torch.float32} else MixedPrecisionOptimizer


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
    """The optimizer class `config.implementation` names for params on `device` and its
    constructor args; see [Note: optimizer implementation]."""
    common: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    name = config.optimizer if isinstance(config.optimizer, str) else None
    if name == "muon":  # [Note: matrix optimizers]
        return MuonAdamW, {
            **common, "betas": (config.adam_beta1, config.adam_beta2), "eps": config.adam_eps,
            "momentum": config.muon_momentum, "ns_steps": config.muon_ns_steps,
            "adjust_lr_fn": config.muon_adjust_lr_fn,
        }  # fmt: skip
    choice = choose_implementation(config.implementation, name, device.type, importable_packages())
    if name is None:
        return config.optimizer, {**common, **choice.kwargs}  # type: ignore[return-value]
    if name == "sgd":
        hparams = {**common, "momentum": config.sgd_momentum}
    else:
        hparams = {
            **common,
            "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_eps,
        }
    return _load_class(config.implementation, choice), {**hparams, **choice.kwargs}


def importable_packages() -> frozenset[str]:
    """Which of the optional optimizer packages (apex, transformer_engine) are installed."""
    return frozenset(name for name in PACKAGES if importlib.util.find_spec(name) is not None)


def _load_class(implementation: str, choice: ImplementationChoice) -> type[torch.optim.Optimizer]:
    module, _, name = (choice.class_path or "").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError) as exc:  # installed, but broken or another version
        raise ImportError(
            f"megabuf: OptimizerConfig.implementation={implementation!r}: cannot import "
            f"{choice.class_path}: {exc}"
        ) from exc
