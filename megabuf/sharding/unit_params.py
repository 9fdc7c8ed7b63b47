"""`UnitParams`: the param side under optim_grads_params (ZeRO-3), over `ParamUnits`.

Only a param shard persists between forwards; units gather in forward, in `state_dict()` and in
`summon_full_params()` ([Note: who gathers when] in sharding/units_runtime.py). The rest of the
param side's contract is `GatheredParams`' ([Note: who waits for param gathers] in
megabuf/sync/param_sync.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from megabuf.buckets.bucket_group import BucketGroup
from megabuf.config import DistributedDataParallelConfig
from megabuf.sharding.param_units import ParamUnits
from megabuf.sync.hooks import ParamGatherHooks
from megabuf.sync.param_sync import GatheredParams


class UnitParams(GatheredParams):
    """optim_grads_params: shards between forwards, gathered unit by unit where needed."""

    def __init__(
        self,
        groups: Sequence[BucketGroup],
        gather_hooks: ParamGatherHooks,
        config: DistributedDataParallelConfig,
        units: ParamUnits,
    ) -> None:
        super().__init__(groups, gather_hooks, config)
        self.units = units

    def start(self, force_sync: bool) -> None:
        """Nothing: forward, `state_dict()` and `summon_full_params()` gather the units."""

    def reshard(self) -> None:
        """Finish every unit gather in flight and release every unit's full params."""
        self.units.runtime.release_all()

    def stepped(self) -> None:
        """The shards are the params: nothing to gather now."""

    @contextmanager
    def summon(self, *, writeback: bool) -> Iterator[None]:
        with self.units.summon_full_params(writeback=writeback):
            yield

    def state_dict(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        if args:
            raise ValueError(
                "megabuf: state_dict() under optim_grads_params takes keyword arguments "
                "only (destination=, prefix=)"
            )
        return self.units.state_dict(module, **kwargs)

    def whole_for_replan(self) -> list[tuple[str, nn.Module]]:
        """Every unit gathered (collective), its hooks removed: the old groups' params stay
        whole until the re-plan retires them; (name, module) per unit, the root first."""
        runtime = self.units.runtime
        runtime.release_all()
        runtime.gather_all()
        runtime.remove()
        return [(unit.name, unit.module) for unit in runtime.units]

    def reset(self) -> None:
        super().reset()
        self.units.runtime.reset()
