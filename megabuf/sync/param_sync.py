"""The param side of an engine: how params come back after an optimizer step and what waits
for them, one class per place params live; the sharding strategy picks one
(`ShardingStrategy.param_side`, [Note: strategies build their parts] in sharding/strategies.py).

`GatheredParams` (no_shard, optim, optim_grads): params live whole in the module or in the
buffers' `param_data`; after a distributed-optimizer step each bucket group all-gathers the
other ranks' shards ([Note: publishing params] in optimizer/distributed.py), and forward
pre-hooks wait for each group just in time ([Note: lazy param gather] in hooks.py).
`UnitParams` (optim_grads_params, megabuf/sharding/unit_params.py): only a param shard persists;
units gather in forward, in `state_dict()` and in `summon_full_params()` ([Note: who gathers
when] in sharding/units_runtime.py). `DistributedDataParallel`'s param methods are thin calls
into the engine's object, and the optimizer tells it `before_step()` / `stepped()` instead of
reaching into bucket groups.

[Note: who waits for param gathers]
With `overlap_param_gather` the step leaves every bucket group's param all-gather in flight
(DISPATCHED); a param is readable only once its group is waited for. Every way to read params
waits, and none returns early on a state it did not expect: a forward pre-hook waits for its
group; a forward with the pre-hooks disabled (`disable_forward_pre_hook`, or a compiled model)
waits for every group before the module runs; `start_param_sync(force_sync=True)` and
`disable_forward_pre_hook()` wait for what is in flight and gather what is stale, so on return
every param holds the last step's values; `publish_params()`, `state_dict()`,
`summon_full_params()`, `broadcast_params()`, `save_checkpoint` and `full_state_dict` wait
before reading. A wait only completes work every rank issued at the step, so it is never a
collective of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from megabuf.buckets.bucket_group import BucketGroup, ParamSyncState
from megabuf.config import DistributedDataParallelConfig
from megabuf.sync.hooks import ParamGatherHooks, has_compiled, profiler_recording


class GatheredParams:
    """Params readable whole between forwards; gathered after a distributed-optimizer step."""

    def __init__(
        self,
        groups: Sequence[BucketGroup],
        gather_hooks: ParamGatherHooks,
        config: DistributedDataParallelConfig,
    ) -> None:
        self.groups = list(groups)  # dense then expert
        self.gather_hooks = gather_hooks
        self.overlap = config.overlap_param_gather

    def before_forward(self, module: nn.Module, compiling: bool) -> None:
        """Before the wrapped module runs: see [Note: who waits for param gathers]."""
        hooks = self.gather_hooks
        if hooks.enabled and (compiling or has_compiled(module)):
            hooks.gather_at_root()  # [Note: compiled modules] in hooks.py
        if hooks.at_root or (self.overlap and not hooks.enabled):
            self.publish()

    def start(self, force_sync: bool) -> None:
        """Dispatch every group's gather in forward read order; gather synchronously without
        overlap, while the profiler records, or with `force_sync` (then also wait for what is
        in flight)."""
        if force_sync or not self.overlap or profiler_recording():
            for group in self.groups:
                group.start_param_sync(force_sync=True)
            return
        for group in self.gather_hooks.forward_order or self.groups:
            group.start_param_sync()

    def publish(self) -> None:
        """Wait for every gather in flight (not collective)."""
        for group in self.groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)

    def reshard(self) -> None:
        """Release whatever full params are held beyond the persistent ones (none here)."""

    def before_step(self) -> None:
        """The optimizer is about to write the params: no gather may be in flight, and no full
        copy may outlive the step."""
        self.publish()
        self.reshard()

    def stepped(self) -> None:
        """The optimizer wrote this rank's shards: the rest is stale; gather it."""
        for group in self.groups:
            group.mark_params_stale()
        self.start(force_sync=False)

    @contextmanager
    def summon(self, *, writeback: bool) -> Iterator[None]:
        del writeback  # the params are the storage: writes land in place
        self.publish()
        yield

    def state_dict(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.publish()
        return module.state_dict(*args, **kwargs)

    def whole_for_replan(self) -> list[tuple[str, nn.Module]]:
        """Before a sharded bucket re-plan copies the params into new buffers: make them whole
        and current (wait for the gathers in flight) and return the shard units to build again
        on the new groups: none here ([Note: sharded auto bucket re-plan])."""
        self.publish()
        return []

    def reset(self) -> None:
        """After an exception mid-iteration: wait out the gathers in flight."""
        for group in self.groups:
            if group.param_state is ParamSyncState.DISPATCHED:
                group.finish_param_sync(skip_next_bucket_dispatch=True)
