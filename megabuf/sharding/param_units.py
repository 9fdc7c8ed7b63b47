"""`ParamUnits`: what `DistributedDataParallel` holds under optim_grads_params (ZeRO-3).

It ties the planned shard units (megabuf/sharding/units.py) to the bucket groups' `ShardedParams`,
installs the unit runtime's hooks ([Note: who gathers when] in sharding/units_runtime.py), and
does what needs every unit's params at once outside forward: `summon_full_params`, `state_dict`
(unit by unit) and `load_state_dict`. Frozen params are not in the buffers and stay replicated:
every rank keeps them whole, as without sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

from megabuf.planning.plan import GroupPlan
from megabuf.sharding.params import ParamShardState
from megabuf.sharding.units_runtime import RuntimeUnit, UnitRuntime

if TYPE_CHECKING:
    from megabuf.buckets.bucket_group import BucketGroup
    from megabuf.config import DistributedDataParallelConfig
    from megabuf.planning.plan import Plan
    from megabuf.sharding.ledger import MemoryLedger
    from megabuf.sharding.units import UnitPlan


def unit_of(planned: GroupPlan) -> int:
    """The shard unit a planned group holds ([Note: unit-aligned plan]); the root (0) without."""
    return 0 if planned.unit is None else planned.unit


def unit_modules(root: nn.Module, unit_plan: UnitPlan | None) -> list[tuple[str, nn.Module]]:
    """(name, module) per unit, the root first: the unit plan's, or the root alone."""
    if unit_plan is None:
        return [("", root)]
    return [(u.name, u.module) for u in unit_plan.units]


class ParamUnits:
    """The ZeRO-3 side of one wrapped model: its units, their groups and the runtime."""

    def __init__(self, runtime: UnitRuntime, groups: list[BucketGroup]) -> None:
        self.runtime = runtime
        self.groups = groups  # every bucket group, by group id

    @classmethod
    def build(
        cls,
        modules: list[tuple[str, nn.Module]],
        plan: Plan,
        groups: list[BucketGroup],
        param_to_name: dict[nn.Parameter, str],
        config: DistributedDataParallelConfig,
        ledger: MemoryLedger,
        rank: int,
        *,
        reshard_after_forward: bool,
        entry_guard: Callable[[str], None],
    ) -> ParamUnits:
        """Fill the shards from the (broadcast) full params, release them, install the hooks.
        `modules`: `unit_modules(...)`; `groups`: every bucket group of the plan;
        `reshard_after_forward`: the strategy's answer ([Note: sharding strategy objects]);
        `entry_guard`: raises while the engine is offloaded."""
        units = [RuntimeUnit(i, name, module) for i, (name, module) in enumerate(modules)]
        by_id = {g.group_id: g for g in groups}
        groups = [by_id[planned.group_id] for planned in plan.groups]
        for planned, group in zip(plan.groups, groups, strict=True):
            if group.sharded_params is None:
                raise RuntimeError(
                    f"megabuf: bucket group {group.group_id} has no sharded params under "
                    f"optim_grads_params (rank {rank}); this is a megabuf bug"
                )
            units[unit_of(planned)].params.append(group.sharded_params)
            group.sharded_params.release_params(writeback=True)
        owners = {
            p: (param_to_name[p], units[unit_of(planned)].name, group.sharded_params)
            for planned, group in zip(plan.groups, groups, strict=True)
            if group.sharded_params is not None
            for p in group.params_list
        }
        runtime = UnitRuntime(
            units,
            reshard_after_forward=reshard_after_forward,
            prefetch_units=config.prefetch_units,
            rank=rank,
            owners=owners,
            entry_guard=entry_guard,
        )
        runtime.install()
        ledger.reset_peaks()  # the wrapped full copy is gone: peaks start here
        return cls(runtime, groups)

    @contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Every unit gathered inside; `writeback`: what was written into the params is copied
        into the shards before they are released. Collective."""
        self.runtime.release_all()
        self.runtime.gather_all()
        try:
            yield
        finally:
            for group in self.groups:
                params = group.sharded_params
                if params is not None and params.state is ParamShardState.UNSHARDED:
                    params.release_params(writeback=writeback)

    def state_dict(self, module: nn.Module, **kwargs: Any) -> dict[str, Any]:
        """`module.state_dict(**kwargs)` with every sharded param gathered unit by unit and
        copied out (the peak is one bucket group's full params). Collective."""
        if kwargs.get("keep_vars"):
            raise ValueError(
                "megabuf: state_dict(keep_vars=True) under optim_grads_params would hand out "
                "params whose storage is released after the call; use keep_vars=False, or read "
                "the params inside model.summon_full_params()"
            )
        self.runtime.release_all()
        state = module.state_dict(**kwargs)  # aliases of the released params: nothing read
        prefix = kwargs.get("prefix", "")
        keys: dict[nn.Parameter, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if prefix + name in state:
                keys.setdefault(param, []).append(prefix + name)
        for group in self.groups:
            params = group.sharded_params
            if params is None:
                continue
            params.ensure_gathered()
            for param in group.params_list:
                for key in keys.get(param, ()):
                    state[key] = state[key].clone()
            params.release_params()
        return state
