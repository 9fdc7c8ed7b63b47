"""Pickling and copying a wrapped model: what `DistributedDataParallel.__getstate__`,
`__setstate__` and `__deepcopy__` do.

[Note: pickling a wrapped model]
torch DDP pickles (`torch.save(model)`, `copy.deepcopy(model)`): its state drops the process
group and the reducer, and unpickling rebuilds them on the default group. megabuf does the same
with its engine. What is pickled is the wrapper's own attributes (the config, whatever plain
values it holds) and a *snapshot* of the wrapped module: a copy whose params are compact clones
of the current values (published first, [Note: who waits for param gathers] in param_sync.py),
without megabuf's param attributes (`main_grad`) or module hooks. The buffers are not pickled
(a param is a view into its buffer, and pickling the views would write the buffers once per
param), nor are grads (torch pickles no `.grad` either), the process groups, the collectives
layer, comm hooks registered with `register_comm_hook` (register them again; a `comm_hook` in
the config is rebuilt, with fresh state), the timeline, the no_sync state or a bucket_size="auto"
re-plan (the copy warms up again).
Unpickling (and `copy.deepcopy`) rebuilds the engine eagerly, in `__setstate__`, over
the default groups (`ProcessGroups.default_local()`: the world as dp, this rank's ep and pp
groups of one rank made by it alone): new buffers, the params moved into them, new hooks.
Unlike the constructor it is *not* collective, as torch DDP's unpickling is not: it neither
checks that every rank holds the same model nor broadcasts rank 0's values, so one rank may
unpickle alone (a copy for evaluation on rank 0, in this job or a fresh one) and a deepcopy on
one rank cannot hang. So every rank that trains the copy must unpickle the same payload, or
call `model.broadcast_params()` (collective) before training it. One exception: a config with
`num_distributed_optimizer_instances` > 1 splits dp again, collectively (every rank unpickles).
Eager, not at the copy's first use: a lazy build would turn its first forward into the
place where the cost and any failure land, and until then the copy would be a wrapper without
an engine that every other door would have to expect.
Refused, naming what to do: process groups other than the default ones (as torch DDP),
optim_grads_params (its params are shards between forwards; save `model.state_dict()` instead),
and an offloaded engine.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.core.engine import Engine
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups, resolve_split

REBUILD_KEY = "_megabuf_rebuild"
DROPPED = ("engine", "process_groups", "buffers", "_uneven")  # rebuilt on restore
MEGABUF_PARAM_ATTRS = ("main_grad",)  # and every `_megabuf_*`: views into buffers, bookkeeping


@dataclass(frozen=True)
class RebuildArgs:
    """What the constructor was given beyond the pickled attributes."""

    disable_bucketing: bool
    sync_buffers: bool  # broadcast_buffers, as last set


def wrapper_state(
    state: dict[str, Any],
    engine: Engine,
    process_groups: ProcessGroups,
    config: DistributedDataParallelConfig,
) -> dict[str, Any]:
    """The pickled state of a wrapper whose `__dict__` is `state`: see [Note: pickling a
    wrapped model]."""
    _refuse_unpicklable(engine, process_groups, config)
    engine.param_side.publish()
    out = {k: v for k, v in state.items() if k not in DROPPED}
    modules = dict(state["_modules"])
    modules["module"] = module_snapshot(modules["module"])
    out["_modules"] = modules
    out[REBUILD_KEY] = RebuildArgs(engine.disable_bucketing, state["_uneven"].sync_buffers)
    return out


def restore(model: nn.Module, state: dict[str, Any]) -> tuple[ProcessGroups, Engine, bool]:
    """Set `model`'s attributes from `state` and build its engine over the default groups
    (not collective: no replica check, no broadcast). Returns (process groups, engine,
    broadcast_buffers) for the wrapper to hold."""
    state = dict(state)
    rebuild: RebuildArgs = state.pop(REBUILD_KEY)
    nn.Module.__setstate__(model, state)
    config: DistributedDataParallelConfig = state["ddp_config"]
    groups = resolve_split(ProcessGroups.default_local(), config)
    engine = Engine(
        state["_modules"]["module"], config, groups, Collectives(),
        disable_bucketing=rebuild.disable_bucketing, init_sync=False, check_replicas=False,
    )  # fmt: skip
    return groups, engine, rebuild.sync_buffers


def copied_state(state: dict[str, Any], memo: dict[int, Any]) -> dict[str, Any]:
    """`copy.deepcopy` of a pickled state whose module snapshot is already a fresh copy."""
    snapshot = state["_modules"]["module"]
    memo[id(snapshot)] = snapshot
    return copy.deepcopy(state, memo)


def module_snapshot(module: nn.Module) -> nn.Module:
    """A deep copy of `module` whose params are compact clones of the current values, without
    megabuf's param attributes and module hooks (the engine's; the user's are copied)."""
    memo: dict[int, Any] = {id(p): _clean_param(p) for p in module.parameters()}
    ours = [fn for fn in _hook_functions(module) if _is_megabuf(fn)]
    memo.update({id(fn): fn for fn in ours})  # not copied: removed from the copy below
    snapshot = copy.deepcopy(module, memo)
    for sub in snapshot.modules():
        for hooks in _hook_dicts(sub):
            for key in [k for k, fn in hooks.items() if any(fn is f for f in ours)]:
                del hooks[key]
                for extra in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                              "_forward_pre_hooks_with_kwargs"):  # fmt: skip
                    getattr(sub, extra, {}).pop(key, None)
    return snapshot


def _clean_param(param: nn.Parameter) -> nn.Parameter:
    clone = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
    for name, value in vars(param).items():
        if name not in MEGABUF_PARAM_ATTRS and not name.startswith("_megabuf"):
            setattr(clone, name, copy.deepcopy(value))
    return clone


def _hook_dicts(module: nn.Module) -> Iterator[dict[Any, Any]]:
    for name, value in vars(module).items():
        if name.endswith("hooks") and isinstance(value, dict):
            yield value


def _hook_functions(module: nn.Module) -> Iterator[Any]:
    for sub in module.modules():
        for hooks in _hook_dicts(sub):
            yield from hooks.values()


def _is_megabuf(fn: Any) -> bool:
    return str(getattr(fn, "__module__", "") or "").startswith("megabuf.")


def _refuse_unpicklable(
    engine: Engine, process_groups: ProcessGroups, config: DistributedDataParallelConfig
) -> None:
    engine.check_resident("pickling or copying the model")
    rank, topology = engine.rank, process_groups.topology
    if config.sharding.shards_params:
        raise RuntimeError(
            "megabuf: cannot pickle or copy a model under data_parallel_sharding_strategy="
            f"'optim_grads_params' (rank {rank}): its params are shards between forwards. Save "
            "`model.state_dict()` (collective) and wrap a fresh module instead"
        )
    default = (
        process_groups.pp_size == 1 and topology.ep_size == 1
        and process_groups.dp_size == Collectives.size(None)
        and (not process_groups.hybrid or config.num_distributed_optimizer_instances > 1)
    )  # fmt: skip
    if not default:
        raise RuntimeError(
            "megabuf: pickling or copying a wrapped model needs the default process groups (the "
            f"whole world as dp, as torch DDP; rank {rank} has pp_size {process_groups.pp_size}, "
            f"ep_size {topology.ep_size}, dp_size {process_groups.dp_size}): the copy is rebuilt "
            "on them. Pickle `model.module` (or its state_dict) and wrap it again instead"
        )
