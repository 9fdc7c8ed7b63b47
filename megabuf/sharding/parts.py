"""The kits the engine hands its sharding strategy's builders ([Note: strategies build their
parts] in megabuf/sharding/strategies.py): each knows HOW to construct every candidate of one
part; the strategy decides WHICH. The per-bucket-group kit (param storage) lives in assembly.py,
next to the group it is built for."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from megabuf.buckets.bucket_group import BucketGroup
from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import Plan
from megabuf.sharding.ledger import MemoryLedger
from megabuf.sharding.param_units import ParamUnits
from megabuf.sharding.unit_params import UnitParams
from megabuf.sync.grads import ExposedGrads, refuse_foreign_optimizers
from megabuf.sync.hooks import ParamGatherHooks
from megabuf.sync.param_sync import GatheredParams


@dataclass(frozen=True)
class ExposedGradsParts:
    """`ExposedGradsKit`: what the grad sync hands out as `.grad` ([Note: grad contract])."""

    params: Sequence[nn.Parameter]  # trainable, in the buffers; `main_grad` already set
    param_to_name: dict[nn.Parameter, str]
    param_to_group: dict[nn.Parameter, BucketGroup]

    def exposed(self) -> ExposedGrads:
        params = self.params
        same = [p for p in params if p.main_grad.dtype == p.dtype]  # type: ignore[attr-defined]
        other = [p for p in params if p.main_grad.dtype != p.dtype]  # type: ignore[attr-defined]
        return ExposedGrads(same, other, self.param_to_group)

    def refused(self) -> ExposedGrads:
        refuse_foreign_optimizers(self.param_to_name)
        return ExposedGrads([], [], self.param_to_group)


@dataclass(frozen=True)
class ParamSideParts:
    """`ParamSideKit`: the engine's param side ([Note: who waits for param gathers])."""

    groups: list[BucketGroup]  # every bucket group, dense then expert
    gather_hooks: ParamGatherHooks
    config: DistributedDataParallelConfig
    plan: Plan
    unit_modules: list[tuple[str, nn.Module]]  # (name, module) per shard unit, the root first
    param_to_name: dict[nn.Parameter, str]
    ledger: MemoryLedger
    rank: int
    entry_guard: Callable[[str], None]  # raises while the engine is offloaded

    def gathered(self) -> GatheredParams:
        return GatheredParams(self.groups, self.gather_hooks, self.config)

    def units(self, *, reshard_after_forward: bool) -> GatheredParams:
        built = ParamUnits.build(
            self.unit_modules, self.plan, self.groups, self.param_to_name, self.config,
            self.ledger, self.rank, reshard_after_forward=reshard_after_forward,
            entry_guard=self.entry_guard,
        )  # fmt: skip
        return UnitParams(self.groups, self.gather_hooks, self.config, built)
