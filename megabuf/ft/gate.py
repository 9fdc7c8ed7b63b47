"""`wrap` (one replica group's model with torchft's Manager across groups) and the optimizer
gate `FaultTolerantOptimizer`; see [Note: fault-tolerant replicas] in megabuf/ft/__init__.py."""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.ft.fingerprint import layout_fingerprint
from megabuf.ft.replicas import ManagerReplicas
from megabuf.ft.state import load_replica_state, replica_state
from megabuf.optimizer import MegabufOptimizer, StepResult
from megabuf.transport.devices import params_device
from megabuf.transport.process_groups import ProcessGroups

STATE_KEY = "megabuf"


def require_torchft() -> None:
    """Raise an ImportError naming the extra when torchft is not installed."""
    if importlib.util.find_spec("torchft") is None:
        raise ImportError(
            "megabuf.ft needs torchft, which is not installed: pip install 'megabuf[ft]' "
            "(it pins the torchft versions megabuf is tested with)"
        )


def replica_groups(manager: Any, groups: ProcessGroups | None = None) -> ProcessGroups:
    """`groups` (default: the whole world, which under torchft is one replica group) with the
    Manager as the cross-replica level ([Note: cross-replica level])."""
    base = groups if groups is not None else ProcessGroups.default()
    return dataclasses.replace(base, cross_replica=ManagerReplicas(manager))


def _check_config(config: DistributedDataParallelConfig) -> None:
    if config.check_for_nan_in_grad:
        raise ValueError(
            "megabuf: check_for_nan_in_grad=True cannot run under megabuf.ft: it agrees inside "
            "one replica group only, so one group would raise while the others step. Under "
            "fault tolerance non-finite grads are caught after the cross-replica average, on "
            "the same values in every group (the optimizer's non-finite grad-norm skip or the "
            "loss scaler), so every group skips alike: set check_for_nan_in_grad=False"
        )
    if config.num_distributed_optimizer_instances != 1:
        raise ValueError(
            "megabuf: a hybrid split (num_distributed_optimizer_instances > 1) "
            "cannot be combined with megabuf.ft: the replica groups are torchft's, and the "
            "process group megabuf gets holds one replica group only"
        )


def wrap(
    module: nn.Module,
    config: DistributedDataParallelConfig,
    manager: Any,
    *,
    process_groups: ProcessGroups | None = None,
    **kwargs: Any,
) -> DistributedDataParallel:
    """Wrap `module` for one replica group (any strategy; `process_groups` default: the world,
    which must hold this group's ranks only), its reduction ending with `manager.allreduce`
    across groups. Build the optimizer on the result, then `FaultTolerantOptimizer`."""
    require_torchft()
    _check_config(config)
    groups = replica_groups(manager, process_groups)
    return DistributedDataParallel(module, config, process_groups=groups, **kwargs)


class FaultTolerantOptimizer:
    """A megabuf optimizer gated by the Manager: `zero_grad()` starts the step's quorum,
    `step()` steps only if `manager.should_commit()` (called on every rank of the group) says
    every member's reduction succeeded. A voted-down step changes nothing: params, main params,
    optimizer state and loss scaler stay as they were. Registers the healing state with the
    Manager ([Note: replica state for healing])."""

    def __init__(
        self, model: DistributedDataParallel, optimizer: MegabufOptimizer, manager: Any
    ) -> None:
        replicas = model.process_groups.cross_replica
        if not isinstance(replicas, ManagerReplicas) or replicas.manager is not manager:
            raise ValueError(
                "megabuf: FaultTolerantOptimizer needs a model made by megabuf.ft.wrap with the "
                "same Manager (its reduction must cross replica groups through that Manager)"
            )
        self.model, self.optimizer, self.manager = model, optimizer, manager
        self.layout = replicas.layout
        self.commits = 0  # steps this group committed
        manager.register_state_dict_fn(STATE_KEY, self._load_replica_state, self._replica_state)

    def _replica_state(self) -> dict[str, Any]:
        return replica_state(self.model, self.optimizer)

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        load_replica_state(self.model, self.optimizer, state)

    def zero_grad(self) -> None:
        """Start the step: the quorum (asynchronous under use_async_quorum), the fingerprint
        the step's first cross-replica all-reduce carries, and a new iteration's grads. The
        grads are divided by the step's contributor count ([Note: layout fingerprint])."""
        device = params_device(self.model.parameters(), None)
        self.layout.expect(layout_fingerprint(self.model), device)
        self.manager.start_quorum()
        self.optimizer.zero_grad()  # the model's zero_grad_buffer()

    def step(self) -> StepResult | None:
        """Finish the grad sync, check the layout, vote; the optimizer's result, or None when
        the step was voted down (nothing changed)."""
        self.model.finish_grad_sync()  # a no-op when backward finished it
        self.layout.check(rank=self.model.engine.rank)
        if not self.manager.should_commit():
            return None
        self.commits += 1
        return self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
