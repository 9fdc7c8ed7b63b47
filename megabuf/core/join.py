"""Uneven inputs: megabuf's side of torch's join protocol (`torch.distributed.algorithms.Join`).

`DistributedDataParallel` and megabuf's optimizers are torch `Joinable`s; their doors
(`model.join()`, `join_hook()`, `join_device`, `join_process_group`) are thin calls into this
module, which owns the behaviour.

[Note: uneven inputs]
A rank that runs out of data leaves the others waiting in their grad collectives. Inside
`Join([model, optimizer])` (or `model.join()`, which is `Join([model])`), a rank that left its
loop ("joined") runs, once per training forward of the ranks still training ("active"), the
model's main hook and then the optimizer's, which issue the collectives the active ranks issue,
in the same order, so every collective pairs:

    active rank, each training forward        joined rank, each pass of Join's loop
    Collectives.notify_join (torch's, async)  Join counts the active ranks (torch's)
    the exchange (below)                      the exchange, all zeros
    broadcast_buffers from `source`           the same broadcast (receiving)
    backward: the grad sync, in chain order   zero_grad_buffer(); finish_grad_sync(): every
                                              grad zero-filled, reduced in chain order
    optimizer step (megabuf's): hyperparams   the same step() on the reduced grads

The exchange is one synchronous SUM all-reduce over dp of a float32 vector of dp_size + 2:
a 1 at each active rank's dp rank, the number of active ranks whose backward will sync (no_sync
forwards shadow no grad sync and no step), and a flag a joined rank raises when it cannot
shadow the step's param gathers (below). Every rank learns from it the active ranks, so:
- `source`: module buffers come from the highest active dp rank, not dp-rank 0 (which may
  have joined and hold stale buffers), as torch's DDP does under Join;
- a joined rank contributes zero grads; with `divide_by_initial_world_size=True` the sum is
  divided by dp_size (what the grad sync does anyway: a zero adds nothing, so the grads are
  bitwise torch's); with False the reduced grads are multiplied by dp_size / active ranks
  before anyone reads them (`GradSync.rescale_next_sync`), on the active ranks and on the
  joined ones (whose ZeRO-1 shards step on them): torch divides by the active count instead,
  the same bits when dp_size / active is a power of two (world size 2), else within rounding;
- the checks below run after the exchange on every rank, so a refusal raises on all of them
  and leaves no collective unpaired.
A joined rank runs the real `step()`, so under the distributed optimizer its shards step with
the reduced grads (the zero contribution included), and the grad scaler's found-inf
all-reduce, the grad norm's all-reduce (clip_grad) and the param all-gathers are issued where
the active ranks issue them: every rank's params stay equal. Each megabuf step inside the
Join first takes the param groups' hyperparameters from the highest active rank (one
broadcast_object, on every rank), since a scheduler steps only where there is data; torch's
ZeroRedundancyOptimizer steps a joined rank's shard at its stale lr. Under overlap_param_gather the
step dispatches gathers in the forward read order each rank learned in its first training
forward; a rank that joined before one cannot know it, and the exchange refuses that on every
rank. overlap_grad_reduce needs nothing: the shadow dispatches in chain order, the order every
active rank's backward keeps ([Note: dispatch order] in dispatch.py); but a rank whose first
grad sync is a shadow learns one arrival per param ([Note: grad readiness]), which a param used
twice per backward then contradicts after the Join.
Once every rank joined, the model's post hook agrees on the highest-ranked last joiner and
broadcasts its params and (with broadcast_buffers) its buffers, as torch does; a param written
only where it differed (a joined rank whose optimizer was not megabuf's is stale), so fp32 main
params equal to the model's are not reloaded. The model and its optimizer then leave join
mode (torch keeps the notify all-reduce in every later forward).
Refused by name when the Join is built (in `join()` / `join_hook()`, and again at every
exchange, on every rank): sharded grads or params (optim_grads_params gathers units inside
forward and backward, which a joined rank does not run; optim_grads' grad shards and
per-micro-batch agreement are not shadowed), a registered
comm hook (a hook may keep per-rank state, such as PowerSGD's error feedback, that a zero
contribution does not leave alone), pipeline or expert parallelism and hybrid splits (their
collectives run over other groups), bucket_size="auto" before its re-plan (collective warm-up),
error_on_unused_params (every param of a joined rank is unused); a megabuf model that is not
the Join's first joinable, or with several megabuf models; an optimizer before its model, or a
megabuf optimizer stepping the model left out of the Join. As in torch, the loop inside the
Join runs one training forward per backward, and one megabuf step per synced backward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.algorithms.join import JoinHook

from megabuf.core.engine import Engine


@dataclass(frozen=True)
class Exchange:
    """What one exchange told every rank ([Note: uneven inputs])."""

    active: tuple[int, ...]  # dp ranks still training, ascending
    syncing: int  # active ranks whose backward syncs grads
    order_missing: bool  # a joined rank cannot shadow the param gathers

    @property
    def source(self) -> int:
        """The dp rank module buffers come from: the highest active one."""
        return self.active[-1]


class UnevenInputs:
    """One wrapped model's side of the join protocol: its `_join_config` (set by torch's
    `Join`), the Join's options and the hook it is running. Held by the model."""

    def __init__(self, engine: Engine, sync_buffers: bool) -> None:
        self.engine = engine
        self.sync_buffers = sync_buffers
        self.config: Any = None  # torch's; the model's Joinable.__init__ sets it disabled
        self._disabled: Any = None  # that first, disabled config: what it returns to after
        self.divide_by_initial_world_size = True
        self.hook: ModelJoinHook | None = None  # of the Join being built or running
        self.optimizer: weakref.ref[Any] | None = None  # the last megabuf optimizer over it
        self.shadowed_sync = False  # joined rank: this loop pass shadowed a grad sync
        self.source = 0  # the highest active dp rank at the last exchange

    def set_sync_buffers(self, value: bool) -> None:
        """The wrapper's `broadcast_buffers` setter (torch DDP's flag)."""
        self.sync_buffers = value

    # ---- torch's Join builds the hooks, then sets every joinable's config --------------------
    def join_hook(self, kwargs: dict[str, Any]) -> ModelJoinHook:
        refuse_unsupported(self.engine, "join_hook()")
        self.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))
        self.hook = ModelJoinHook(self)
        return self.hook

    def configure(self, config: Any) -> None:
        """Join sets this after every hook was built: check the Join on every rank."""
        if self._disabled is None:
            self._disabled = config  # from Joinable.__init__, at the model's construction
        if config.enable:
            rank = self.engine.rank
            if not config.is_first_joinable:
                raise ValueError(
                    "megabuf: a megabuf DistributedDataParallel must be the first joinable of "
                    f"torch's Join (rank {rank}): it tells the Join each training forward that "
                    "this rank has not joined; use Join([model, optimizer]) with one megabuf model"
                )
            optimizer = self.optimizer() if self.optimizer is not None else None
            hook = self.hook
            if optimizer is not None and (hook is None or hook.optimizer_hook is None):
                raise ValueError(
                    f"megabuf: {type(optimizer).__name__} steps this model but is not in the "
                    f"Join (rank {rank}): a joined rank must run its step too (its shards, "
                    "found-inf and norm all-reduces, param gathers); use "
                    "Join([model, optimizer]) instead of model.join() or Join([model])"
                )
        self.config = config

    def shadowing(self, seen: Exchange) -> bool:
        """A joined rank's loop pass: take the exchange's buffer source; whether it shadows a
        grad sync."""
        self.source, self.shadowed_sync = seen.source, seen.syncing > 0
        return self.shadowed_sync

    def leave(self) -> None:
        """The Join ended: back to the disabled config (no per-forward exchange)."""
        self.config, self.hook, self.shadowed_sync = self._disabled, None, False

    @property
    def disabled_config(self) -> Any:
        """torch's disabled join config, which the model had before any Join."""
        return self._disabled

    def attach_optimizer(self, optimizer: Any) -> None:
        """A megabuf optimizer now steps this model (the newest one counts)."""
        self.optimizer = weakref.ref(optimizer)

    # ---- an active rank's training forward -------------------------------------------------
    @torch.compiler.disable
    def iteration_start(self, model: Any) -> int:
        """Inside an enabled Join: notify, exchange and check; the dp rank to take module
        buffers from. Outside one: dp-rank 0, nothing issued."""
        if not self.config.enable:
            return 0
        engine = self.engine
        engine.check_resident("forward")  # before anything is issued
        work = engine.collectives.notify_join(model)
        seen = exchange(engine, active=True, syncing=engine.sync.require_sync)
        if work is not None:
            work.wait()
        self.check(seen)
        self.rescale(seen)
        self.source = seen.source
        return seen.source

    def rescale(self, seen: Exchange) -> None:
        """divide_by_initial_world_size=False: the next grad sync averages over the active
        ranks ([Note: uneven inputs])."""
        dp_size = self.engine.process_groups.dp_size
        if not self.divide_by_initial_world_size and len(seen.active) < dp_size:
            self.engine.sync.rescale_next_sync(dp_size / len(seen.active))

    def check(self, seen: Exchange) -> None:
        """After an exchange, on every rank alike."""
        refuse_unsupported(self.engine, "an iteration inside Join")
        if seen.order_missing:
            raise RuntimeError(
                "megabuf: join: a rank ran out of inputs before its first training forward "
                "under overlap_param_gather, so it cannot issue the step's param gathers in the "
                f"forward read order the others learned (seen on rank {self.engine.rank}); give "
                "every rank at least one batch, or set overlap_param_gather=False"
            )


def exchange(engine: Engine, *, active: bool, syncing: bool) -> Exchange:
    """The per-iteration all-reduce of [Note: uneven inputs]; collective over dp."""
    pgs = engine.process_groups
    vec = torch.zeros(pgs.dp_size + 2, dtype=torch.float32, device=engine.device)
    if active:
        vec[pgs.dp_rank] = 1.0
        vec[pgs.dp_size] = float(syncing)
    elif engine.config.overlap_param_gather and engine.config.sharding.shards_optimizer:
        vec[pgs.dp_size + 1] = float(not engine.gather_hooks.forward_order)
    engine.collectives.all_reduce(vec, pgs.dp, async_op=False)
    flags = vec.tolist()
    ranks = tuple(r for r in range(pgs.dp_size) if flags[r] > 0)
    if not ranks:
        raise RuntimeError(
            f"megabuf: join: an exchange found no active rank (rank {engine.rank}); torch's "
            "Join runs the hooks only while one is: was a collective left unpaired?"
        )
    return Exchange(ranks, int(flags[pgs.dp_size]), flags[pgs.dp_size + 1] > 0)


def refuse_unsupported(engine: Engine, where: str) -> None:
    """The configurations a joined rank cannot shadow ([Note: uneven inputs]); raises the same
    on every rank (they share the config)."""
    cfg, pgs, rank = engine.config, engine.process_groups, engine.rank
    reasons = []
    if cfg.sharding.shards_grads:
        reasons.append(
            f"data_parallel_sharding_strategy={cfg.sharding.name!r} (its grad shards and unit "
            "gathers are driven by forward and backward, which a joined rank does not run; use "
            "'optim' or 'no_shard')"
        )
    if engine.hooks.comm_hooks():
        reasons.append(
            f"comm hooks {sorted(engine.hooks.comm_hooks())} (a hook may keep per-rank state "
            "that a joined rank's zero grads would change; reduce without a hook)"
        )
    if pgs.pp_size > 1 or engine.expert_parallel_buffers or pgs.hybrid:
        reasons.append(
            "pipeline or expert parallelism, or a hybrid replicate x shard split (their "
            "collectives run over groups other than dp)"
        )
    if engine.auto is not None and not engine.auto.replanned:
        reasons.append('bucket_size="auto" before its re-plan (the warm-up is collective)')
    if cfg.error_on_unused_params:
        reasons.append("error_on_unused_params=True (every param of a joined rank is unused)")
    if reasons:
        raise ValueError(
            f"megabuf: uneven inputs (Join) cannot be shadowed at {where} on rank {rank} with "
            + "; ".join(reasons)
        )


class ModelJoinHook(JoinHook):
    """The model's hook: shadows a training forward and its backward's grad sync; at the end,
    the last joiner's params and buffers everywhere ([Note: uneven inputs])."""

    def __init__(self, uneven: UnevenInputs) -> None:
        self.uneven = uneven
        self.optimizer_hook: OptimizerJoinHook | None = None

    def main_hook(self) -> None:
        uneven, engine = self.uneven, self.uneven.engine
        with torch.profiler.record_function("megabuf::join_shadow"):
            engine.param_side.publish()  # gathers of the last shadowed step (not collective)
            seen = exchange(engine, active=False, syncing=False)
            uneven.check(seen)
            if not uneven.shadowing(seen):
                return
            if uneven.sync_buffers:
                engine.broadcast_module_buffers(seen.source)
            engine.zero_grad_buffer()
            uneven.rescale(seen)
            engine.sync.finish()  # every grad zero-filled, reduced in chain order

    def post_hook(self, is_last_joiner: bool) -> None:
        uneven, engine = self.uneven, self.uneven.engine
        pgs, collectives = engine.process_groups, engine.collectives
        pick = torch.tensor([float(pgs.dp_rank if is_last_joiner else -1)], device=engine.device)
        collectives.all_reduce_max(pick, pgs.dp)
        source = int(pick.item())
        with engine.param_side.summon(writeback=True), torch.no_grad():
            for param in engine.module.parameters():
                theirs = param.detach().clone()
                collectives.broadcast(theirs, source, pgs.dp)
                if not torch.equal(theirs, param):
                    param.copy_(theirs)  # moves its version: main params reload it
            if uneven.sync_buffers:
                engine.broadcast_module_buffers(source)
        uneven.leave()


class OptimizerJoinHook(JoinHook):
    """A megabuf optimizer's hook: after its model's hook shadowed a grad sync, the same
    `step()` the active ranks run ([Note: uneven inputs])."""

    def __init__(self, optimizer: Any, chunks: list[Any]) -> None:
        self.optimizer = optimizer
        self.models = [chunk._uneven for chunk in chunks]

    def main_hook(self) -> None:
        if all(m.shadowed_sync for m in self.models):
            self.optimizer.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        del is_last_joiner  # the model's hook synced the params
        self.optimizer._join_config = self.models[0].disabled_config  # steps leave join mode


def sync_hyperparameters(optimizer: Any, chunks: list[Any]) -> None:
    """At the start of a megabuf optimizer's step inside an enabled Join, on every rank: the
    param groups' hyperparameters (lr, ...) of the highest active rank, so a scheduler that
    steps only where there is data still drives a joined rank's shards. Collective over dp."""
    if not optimizer._join_config.enable:
        return
    uneven: UnevenInputs = chunks[0]._uneven
    engine = uneven.engine
    groups = optimizer.param_groups
    mine = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    theirs = engine.collectives.broadcast_object(mine, uneven.source, engine.process_groups.dp)
    for group, values in zip(groups, theirs, strict=True):
        group.update(values)


def optimizer_join_hook(optimizer: Any, chunks: list[Any]) -> OptimizerJoinHook:
    """`optimizer.join_hook()`: pair with the hook its model chunk got from this Join."""
    if len(chunks) != 1:
        raise ValueError(
            f"megabuf: Join supports an optimizer over one model chunk, got {len(chunks)}"
        )
    uneven: UnevenInputs = chunks[0]._uneven
    hook = uneven.hook
    if hook is None or hook.optimizer_hook is not None:
        raise ValueError(
            f"megabuf: {type(optimizer).__name__} is in a Join without its model before it "
            f"(rank {uneven.engine.rank}): list the model first, Join([model, optimizer]), so "
            "its hook shadows the forward and backward before the optimizer's shadows the step"
        )
    hook.optimizer_hook = OptimizerJoinHook(optimizer, chunks)
    return hook.optimizer_hook


def attach_optimizer(chunks: list[Any], optimizer: Any) -> None:
    """A megabuf optimizer was built over `chunks` ([Note: uneven inputs])."""
    for chunk in chunks:
        chunk._uneven.attach_optimizer(optimizer)


class JoinConfigSlot:
    """The model's `_join_config` (torch's Join sets it on each joinable after building every
    hook): kept and checked by the model's `UnevenInputs`."""

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return obj._uneven.config

    def __set__(self, obj: Any, value: Any) -> None:
        obj._uneven.configure(value)
