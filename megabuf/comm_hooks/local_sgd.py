"""`LocalSGD` (post-local SGD) and its `PeriodicAverager`.

[Note: local SGD]
Until `start_step` synced steps have run, `LocalSGD` is the engine's all-reduce over the bucket's
group (bitwise `Reduce`). From then on each rank's grads are averaged only inside its subgroup
(consecutive runs of `subgroup_size` group ranks, or the explicit `subgroups` partition), or
not at all (`reduce_in_subgroup=False`: every rank steps on its own grads), so replicas in
different subgroups drift apart. Every `period` of those local steps `PeriodicAverager.step()`
(called right after `optimizer.step()`) averages the params over the whole group, fp32 main
params included, and writes the average back into the model params: afterwards every rank holds
the same values, bitwise. The training loop:

    hook = LocalSGD(start_step=100, period=4, subgroup_size=2)
    model.register_comm_hook(hook)          # collective: creates the subgroups now
    optimizer = megabuf.MixedPrecisionOptimizer(model, torch.optim.AdamW, lr=...)
    averager = PeriodicAverager(optimizer)  # finds the hook on the optimizer's model
    for batch in data:
        optimizer.zero_grad(); loss(model(batch)).backward(); optimizer.step()
        averager.step()                     # averages when a period of local steps is over

- Steps are counted per bucket, once per synced step (under `no_sync()` the hook runs once, on
  the summed grads): `hook.step` is the number of synced steps seen.
- All-reduce mode only: with the distributed optimizer (reduce-scatter mode) each rank steps
  one shard of the optimizer state, which is sharded over the whole dp group, with grads that
  were averaged in its subgroup only, and the param all-gather would stitch together shards of
  diverged replicas; registration refuses it (`CommHookModeError`).
- Expert buffers: the subgroups are cut from the bucket's own group (expert-dp for expert
  buckets) with the same `subgroup_size` (or `subgroups`, in that group's ranks), so it must
  divide the expert-dp size too; the averager averages expert params over expert-dp.
- The subgroups are new process groups, created at registration by the subgroup's members
  (`megabuf.transport.process_groups.new_subgroup`), never inside backward.
- Only params are averaged, as torch's `PeriodicModelAverager` does: the optimizer state
  (moments) stays each rank's own. Between averagings the replicas differ: a checkpoint is
  saved right after an averaging step, when every rank holds the same params; one asked for
  between averagings raises on every rank (a ValueError naming the step), as it would keep
  dp rank 0's params only.
- `PeriodicAverager` refuses a model without a `LocalSGD` hook. When 2·period local steps
  have passed without an averaging, the next step warns once (the averager is never called,
  or not after every `optimizer.step()`).
"""

from __future__ import annotations

import warnings
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import GradBucket
from megabuf.transport.collectives import PendingCollective
from megabuf.transport.process_groups import new_subgroup

_RS_WHY = (
    "local SGD averages grads inside a subgroup only, but in reduce-scatter mode the optimizer "
    "state is sharded over the whole dp group: each rank would step its shard with grads of "
    "its own subgroup and the param all-gather would stitch together shards of diverged "
    "replicas (design notes §1.5). Use LocalSGD with use_distributed_optimizer=False and a "
    "non-distributed optimizer (MixedPrecisionOptimizer / FP32Optimizer)"
)


class LocalSGDError(ValueError):
    """A `LocalSGD` / `PeriodicAverager` configuration that cannot work."""


@dataclass(frozen=True)
class _Subgroup:
    group: Any  # ProcessGroup, or None when there is nothing to reduce over
    size: int


class LocalSGD:
    """Post-local SGD: global all-reduce until `start_step`, then an all-reduce within the
    rank's subgroup ([Note: local SGD]); all-reduce mode only.

    Args:
        start_step: synced steps reduced over the whole group before local steps begin.
        period: local steps between two parameter averagings (`PeriodicAverager`).
        subgroup_size: split each bucket's group into consecutive runs of this many ranks.
        subgroups: or an explicit partition of the group's ranks, e.g. [[0, 2], [1, 3]].
        reduce_in_subgroup: False: after `start_step` no communication at all (each rank's own
            grads, unscaled back to a mean over its own batch).
    """

    modes = frozenset({"all_reduce"})
    mode_notes: ClassVar[dict[str, str]] = {"reduce_scatter": _RS_WHY}

    def __init__(
        self,
        start_step: int,
        period: int,
        *,
        subgroup_size: int | None = None,
        subgroups: Sequence[Sequence[int]] | None = None,
        reduce_in_subgroup: bool = True,
    ) -> None:
        if not isinstance(start_step, int) or start_step < 0:
            raise LocalSGDError(
                f"megabuf: LocalSGD start_step must be an int >= 0, got {start_step!r}"
            )
        if not isinstance(period, int) or period < 1:
            raise LocalSGDError(f"megabuf: LocalSGD period must be an int >= 1, got {period!r}")
        if (subgroup_size is None) == (subgroups is None):
            raise LocalSGDError(
                "megabuf: LocalSGD needs exactly one of subgroup_size= (e.g. the ranks of one "
                "node: int(os.environ['LOCAL_WORLD_SIZE'])) or subgroups= (a partition of the "
                f"group's ranks); got subgroup_size={subgroup_size!r}, subgroups={subgroups!r}"
            )
        if subgroup_size is not None and (not isinstance(subgroup_size, int) or subgroup_size < 1):
            raise LocalSGDError(
                f"megabuf: LocalSGD subgroup_size must be an int >= 1, got {subgroup_size!r}"
            )
        self.start_step = start_step
        self.period = period
        self.subgroup_size = subgroup_size
        self.subgroups = None if subgroups is None else [list(s) for s in subgroups]
        self.reduce_in_subgroup = reduce_in_subgroup
        self.name = f"LocalSGD(start_step={start_step}, period={period})"
        self.buckets: list[GradBucket] = []
        self._sub: dict[int, _Subgroup] = {}  # id(bucket) -> its subgroup
        self._counts: dict[int, int] = {}  # id(bucket) -> synced steps it has seen
        self._base_step = 0  # where new buckets start counting (load_state_dict)
        self.averaged_at: int | None = None  # hook.step at the last averaging
        self._warned = False

    # ---- registration ---------------------------------------------------------------------
    def setup(self, buckets: list[GradBucket]) -> None:
        """At registration (collective over each subgroup's members): check the partition
        against every bucket's group and create the subgroups, one per distinct group."""
        made: dict[int, _Subgroup] = {}
        for bucket in buckets:
            key = id(bucket.group)
            if key not in made:
                made[key] = self._make_subgroup(bucket)
            self._sub[id(bucket)] = made[key]
            self._counts[id(bucket)] = self._base_step
        self.buckets += buckets

    def _members(self, bucket: GradBucket) -> list[int]:
        """The group ranks of `bucket.group` in this rank's subgroup."""
        size, rank = bucket.group_size, bucket.group_rank
        where = f"{self.name} on {bucket.describe()}"
        if self.subgroup_size is not None:
            s = self.subgroup_size
            if size % s != 0:
                raise LocalSGDError(
                    f"megabuf: {where}: subgroup_size={s} does not divide the bucket's group "
                    f"size {size} ({'expert-dp' if bucket.expert else 'dp'}); pick a divisor"
                )
            return list(range(rank - rank % s, rank - rank % s + s))
        parts = self.subgroups or []
        flat = sorted(r for part in parts for r in part)
        if flat != list(range(size)) or any(not part for part in parts):
            raise LocalSGDError(
                f"megabuf: {where}: subgroups={parts} must partition the group's ranks "
                f"0..{size - 1} (each exactly once, no empty subgroup)"
            )
        return sorted(next(part for part in parts if rank in part))

    def _make_subgroup(self, bucket: GradBucket) -> _Subgroup:
        members = self._members(bucket)  # checked even when nothing is reduced
        if len(members) == 1 or not self.reduce_in_subgroup:
            return _Subgroup(None, 1)
        if len(members) == bucket.group_size:
            return _Subgroup(bucket.group, len(members))
        return _Subgroup(new_subgroup(bucket.group, members), len(members))

    # ---- the hook ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Synced steps seen (every bucket counts once per synced step)."""
        return min(self._counts.values(), default=self._base_step)

    def __call__(self, bucket: GradBucket) -> Any:
        step = self._counts[id(bucket)]
        self._counts[id(bucket)] = step + 1
        coll = bucket.collectives
        if step < self.start_step:
            return coll.all_reduce(bucket.data, bucket.group, average=bucket.average)
        self._check_averaging(step)
        sub = self._sub[id(bucket)]
        # the pre-scale made the data sum to the mean over the whole group: rescale to a mean
        # over the subgroup (exact when both sizes are powers of two)
        factor = 1.0 if bucket.average else bucket.group_size / sub.size
        if sub.group is None:  # nothing to reduce over: this rank's own grads
            if factor != 1.0:
                bucket.data.mul_(factor)
            return None
        pending = coll.all_reduce(bucket.data, sub.group, average=bucket.average)
        return pending if factor == 1.0 else _then_scale(pending, bucket.data, factor)

    @property
    def last_equal_step(self) -> int:
        """The last step after which every replica held the same params: the last averaging,
        or `start_step` (until then grads are reduced over the whole group)."""
        return max(self.start_step, self.averaged_at or 0)

    def _check_averaging(self, step: int) -> None:
        last = self.last_equal_step
        if step - last >= 2 * self.period and not self._warned:
            self._warned = True
            warnings.warn(
                f"megabuf: {self.name}: {step - last + 1} local steps since the last parameter "
                f"averaging (period {self.period}); replicas keep drifting apart. Call "
                "PeriodicAverager(optimizer).step() after every optimizer.step()",
                RuntimeWarning,
                stacklevel=3,
            )

    # ---- checkpoints ([hook state protocol]) -----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters. Between averagings the replicas differ and a checkpoint keeps dp rank
        0's params only, which the other ranks would resume with: refused (every rank raises,
        the checkpoint already at the path stays)."""
        last = self.last_equal_step
        if self.step > last:
            raise ValueError(
                f"megabuf: {self.name}: a checkpoint at step {self.step}, between parameter "
                f"averagings (the last at step {last}), would keep dp rank 0's params, which "
                "the other replicas do not hold; save right after PeriodicAverager.step() "
                f"averaged (every {self.period} steps)"
            )
        replicated: dict[str, Any] = {"step": self.step}
        if self.averaged_at is not None:
            replicated["averaged_at"] = self.averaged_at
        return {"replicated": replicated, "per_rank": {}, "layout": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The counters saved by `state_dict()` (any world size: nothing is per rank)."""
        unknown = [k for k in state.get("replicated", {}) if k not in ("step", "averaged_at")]
        unknown += [f"per_rank/{k}" for k in state.get("per_rank", {})]
        if unknown or "step" not in state.get("replicated", {}):
            raise ValueError(
                f"megabuf: {self.name}.load_state_dict: expected replicated 'step' (and "
                f"'averaged_at') and no per-rank state; unexpected keys {unknown}"
            )
        step = int(state["replicated"]["step"])
        self._base_step = step
        self._counts = dict.fromkeys(self._counts, step)
        averaged = state["replicated"].get("averaged_at")
        self.averaged_at = None if averaged is None else int(averaged)


def _then_scale(
    pending: PendingCollective, data: Tensor, factor: float
) -> Generator[Any, Any, None]:
    yield pending
    data.mul_(factor)


@dataclass
class _AveragePlan:
    """One group's params as one flat fp32 tensor (persistent: nothing allocated per average)."""

    bucket: GradBucket  # any bucket of the group: its group, rank, size and collectives
    mains: list[Any]  # MainParam records (megabuf.optimizer.main_params), in bucket order
    flat: Tensor  # 1-D fp32, sum of the mains' numel padded to a multiple of the group size
    scratch: Tensor | None  # the reduce-scatter's all-to-all landing zone where needed


class PeriodicAverager:
    """Every `hook.period` local steps, average the params (fp32 main params, then the model
    params written from them) over each bucket's whole group ([Note: local SGD]). Call `step()`
    after every `optimizer.step()`; it returns True when it averaged.

    Args:
        optimizer: a non-distributed megabuf optimizer (`MixedPrecisionOptimizer`,
            `FP32Optimizer`) over the model the hook is registered on.
        hook: the `LocalSGD` hook (default: the one registered on the optimizer's model).
    """

    def __init__(self, optimizer: Any, hook: LocalSGD | None = None) -> None:
        if getattr(optimizer, "sharded", False):
            raise LocalSGDError(
                "megabuf: PeriodicAverager needs a non-distributed optimizer "
                "(MixedPrecisionOptimizer / FP32Optimizer); LocalSGD does not support the "
                "distributed optimizer (reduce-scatter mode)"
            )
        self.hook = hook if hook is not None else _find_hook(optimizer)
        by_param = {mp.model_param: mp for mp in optimizer.main_params}
        missing = [n for b in self.hook.buckets for p, n in zip(b.params, b.param_names)
                   if p not in by_param]  # fmt: skip
        if not self.hook.buckets or missing:
            raise LocalSGDError(
                f"megabuf: PeriodicAverager: {self.hook.name} is not registered on this "
                f"optimizer's model (params {missing[:3]} have no main param; "
                "model.register_comm_hook(hook) on the model the optimizer steps)"
            )
        self._plans = [_plan(bucket, by_param) for bucket in _one_per_group(self.hook.buckets)]

    def step(self) -> bool:
        """Average now if a period of local steps has just ended (at most once per step)."""
        hook, step = self.hook, self.hook.step
        local = step - hook.start_step
        if local <= 0 or local % hook.period != 0 or hook.averaged_at == step:
            return False
        with torch.no_grad(), torch.profiler.record_function("megabuf::local_sgd_average"):
            for plan in self._plans:
                _average(plan)
        hook.averaged_at = step
        return True


def _find_hook(optimizer: Any) -> LocalSGD:
    hooks = {
        id(g.comm_hook): g.comm_hook
        for chunk in optimizer.model_chunks
        for g in chunk.engine.all_bucket_groups
        if isinstance(g.comm_hook, LocalSGD)
    }
    if len(hooks) != 1:
        raise LocalSGDError(
            f"megabuf: PeriodicAverager found {len(hooks)} LocalSGD hooks on the optimizer's "
            "model chunks; register one with model.register_comm_hook(LocalSGD(...)) (or pass "
            "hook=): without it the grads are all-reduced globally and there is nothing to average"
        )
    return next(iter(hooks.values()))


def _one_per_group(buckets: list[GradBucket]) -> list[list[GradBucket]]:
    groups: dict[int, list[GradBucket]] = {}
    for bucket in buckets:
        groups.setdefault(id(bucket.group), []).append(bucket)
    return list(groups.values())


def _plan(buckets: list[GradBucket], by_param: dict[Any, Any]) -> _AveragePlan:
    first = buckets[0]
    mains = [by_param[p] for b in buckets for p in b.params]
    numel = sum(mp.main.numel() for mp in mains)
    padded = -(-numel // first.group_size) * first.group_size
    device = mains[0].main.device
    flat = torch.zeros(padded, dtype=torch.float32, device=device)
    strategy = first.collectives.strategy(first.group, device)
    scratch = torch.empty_like(flat) if strategy.reduce_scatter == "all_to_all" else None
    return _AveragePlan(first, mains, flat, scratch)


def _average(plan: _AveragePlan) -> None:
    """flat = the mains; reduce-scatter (sum, then / size) + all-gather: every rank gets the
    same bits whatever the backend; then back into the mains and the model params."""
    b, flat, coll = plan.bucket, plan.flat, plan.bucket.collectives
    views = _views(plan.mains, flat)
    for mp, view in zip(plan.mains, views, strict=True):
        view.copy_(mp.main)
    chunk = flat.numel() // b.group_size
    shard = flat[b.group_rank * chunk : (b.group_rank + 1) * chunk]
    coll.reduce_scatter(shard, flat, b.group, average=True, scratch=plan.scratch).wait()
    coll.all_gather(flat, shard, b.group).wait()
    for mp, view in zip(plan.mains, views, strict=True):
        mp.main.copy_(view)
        if mp.model_data is not None:  # an fp32 copy of a half-precision param: round it
            mp.model_data.copy_(mp.main.view(mp.model_data.shape))


def _views(mains: list[Any], flat: Tensor) -> list[Tensor]:
    """Each main param's slot in `flat`, shaped like it, in order."""
    views, at = [], 0
    for mp in mains:
        views.append(flat[at : at + mp.main.numel()].view(mp.main.shape))
        at += mp.main.numel()
    return views
