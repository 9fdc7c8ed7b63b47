"""Typed records of the optimizer package: what `step()` returns, the dense/expert domains, and
`OptimizerParts`, the part of an optimizer that the state and memory helpers read (so they need
not import the optimizer class: imports flow records -> memory / model_space -> base)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.grad_scaler import GradScaler
from megabuf.optimizer.main_params import MainParam

DomainKind = Literal["dense", "expert"]
DOMAIN_KINDS: tuple[DomainKind, ...] = ("dense", "expert")


class StepResult(NamedTuple):
    """What `MegabufOptimizer.step()` returns; see [Note: optimizer step]."""

    update_successful: bool  # False: the step was skipped on every rank (inf/NaN grads)
    grad_norm: float | None  # global L2 norm before clipping; None if the grad scaler found inf
    num_zeros_in_grad: int | None  # only with log_num_zeros_in_grad and a successful step


@dataclass
class Domain:
    """Dense or expert params: their main params, inner optimizer and norm groups."""

    kind: DomainKind
    main_params: list[MainParam]
    optimizer: torch.optim.Optimizer
    norm_groups: tuple[ProcessGroup, ...]  # see [Note: global grad norm]


@dataclass(frozen=True)
class OptimizerParts:
    """What `memory_report` and the model-space state functions read of an optimizer."""

    domains: Sequence[Domain]
    keys: Mapping[nn.Parameter, str]  # model-space name (checkpoint key) of every param
    model_chunks: Sequence[DistributedDataParallel]
    optimizer_cls: type[torch.optim.Optimizer]
    num_param_groups: int  # user param groups (every inner optimizer has this many)
    grad_scaler: GradScaler | None
    sharded: bool  # main params are shards of the buffers (the distributed optimizer)
    # half-precision grads upcast in windows of this many elements; None: all copied at once
    grad_upcast_window_numel: int | None = None

    @property
    def main_params(self) -> list[MainParam]:
        return [mp for d in self.domains for mp in d.main_params]
