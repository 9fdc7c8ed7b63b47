"""PowerSGD on megabuf's buckets ([Note: comm hook contract]); `BatchedPowerSGD` is in
batched_powersgd.py, the pure math in lowrank.py.

[Note: PowerSGD in megabuf]
Units: the engine hands the hook `data` already multiplied by gradient_scaling_factor (1/dp),
so the hook SUMS over `bucket.group` (or averages when `bucket.average`). Per compressed matrix
M_r (rank r's pre-scaled grad plus its residual e_r), with a Q shared by every rank:
    P = orth(sum_r M_r Q);  Q' = sum_r M_r^T P  (/ d when averaging);  A = P Q'^T,
so A approximates the sum (or mean) of the M_r: stage one issues the all-reduces of P and of
the uncompressed concatenation at dispatch, stage two the all-reduce of Q'. Error feedback
keeps the residual of the compressed matrices only, in the grad dtype, no bucket clone: after
adding e_r to the grad the grad is copied into e_r, and after the reconstruction
e_r -= A / d (A itself when averaging: the mean). Hence, every step, in pre-scaled units,
    sum_r (data_r + old e_r) = A_sum + sum_r new e_r
(the residual's per-rank split never matters: P and Q' depend only on sum_r M_r). Multiplying
by dp gives torch's `powerSGD_hook` error (local input minus the mean approximation).
Reduce-scatter mode: every rank still computes P and Q' for whole matrices (each has its full
local M_r), but writes into `data` only the rows of P Q'^T that hold elements of its shard (a
matrix may straddle a shard boundary mid-row: its boundary rows are rebuilt whole). The
residual covers the whole local matrix, so with error feedback e_r -= A / d is one fused
addmm over the whole matrix (no extra memory). The uncompressed tensors (biases, norms, small
matrices) are all-reduced as one concatenation in both modes, and the shard's part of them is
copied out: their pieces do not line up with the shard boundaries (a reduce-scatter would need
an all-to-all with uneven splits), and they are a small part of a bucket.
Wire per compressing step and bucket: sum r (n + m) elements of P and Q (factor dtype) plus
the uncompressed elements (grad dtype) through `bucket.collectives` (`wire_numel`).
Step counter: one per synced step (per hook call of each bucket; `no_sync` micro-batches do
not call the hook); bucket indices are stable from step 0, so `start_step=0` is allowed.
Skipped steps: `on_step_skipped()` (the optimizer found inf/NaN and applied nothing) zeroes the
residuals, forgets Q (the next step draws a new one), reseeds the generator and takes the
skipped step off the counter: the hook is then exactly a new one whose counter holds the
applied steps. `on_loss_scale_change(ratio)` multiplies the residuals, which are in
loss-scaled units. DistributedDataParallel.notify_comm_hooks_step_skipped() /
notify_comm_hooks_loss_scale_changed(ratio) reach them; megabuf's optimizer calls both.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import GradBucket
from megabuf.comm_hooks.lowrank import BucketPlan, Unit, orthogonalize_, plan_bucket, shard_rows
from megabuf.comm_hooks.lowrank_hook import LowRankHook
from megabuf.transport.collectives import PendingCollective


@dataclass
class _Bucket:
    """One bucket's persistent PowerSGD state (all 1-D, in unit order: see `Unit`)."""

    plan: BucketPlan
    offsets: tuple[int, ...]  # each param's first element in `data`
    p: Tensor  # factor dtype, p_numel
    q: Tensor  # factor dtype, q_numel; holds last step's Q when `warm`
    error: Tensor | None  # grad dtype, compressed_numel; None without error feedback
    warm: bool = False


class PowerSGD(LowRankHook):
    """PowerSGD (Vogels et al. 2019) per matrix, with error feedback, in both modes: see
    [Note: PowerSGD in megabuf].

    Args:
        rank: the approximation rank r (per matrix min(n, m, rank)).
        start_step: synced steps reduced in full before compressing (0 is allowed).
        min_compression_rate: a matrix n x m (shape[0] x rest) is compressed iff
            (n + m) r min_compression_rate < n m; 1-D tensors never are.
        error_feedback: keep each rank's residual of the compressed matrices and add it back.
        warm_start: start each step's power iteration from last step's Q.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt.
        seed: seeds the generator every rank draws Q from (identical on all ranks).
        batch_same_shape: multiply same-shape matrices together (stacked: a copy).
        factor_dtype: dtype of P and Q (e.g. torch.float32 on bf16 grads); None: grad dtype.
    Memory per bucket: residuals of the compressed matrices (grad dtype), P and Q
    (sum r (n + m), factor dtype); transient workspaces for the uncompressed concatenation and,
    when batching or when factor_dtype differs, a factor-dtype copy of the compressed matrices.
    """

    name = "PowerSGD"

    def __init__(
        self,
        rank: int = 1,
        start_step: int = 1000,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
        batch_same_shape: bool = False,
        factor_dtype: torch.dtype | None = None,
    ) -> None:
        if not min_compression_rate >= 0:
            raise ValueError(
                f"megabuf: PowerSGD: min_compression_rate={min_compression_rate!r} must be >= 0"
            )
        super().__init__(
            rank, start_step, error_feedback, warm_start, orthogonalization_epsilon, seed,
            factor_dtype,
        )  # fmt: skip
        self.min_compression_rate = float(min_compression_rate)
        self.batch_same_shape = batch_same_shape
        self._state: dict[int, _Bucket] = {}

    def _setup_bucket(self, bucket: GradBucket) -> None:
        shapes = [tuple(p.shape) for p in bucket.params]
        plan = plan_bucket(shapes, self.rank, self.min_compression_rate, self.batch_same_shape)
        base = int(bucket.data.storage_offset())
        offsets = tuple(int(g.storage_offset()) - base for g in bucket.gradients())
        factor, device = self.factor_of(bucket), bucket.data.device
        error = None
        if self.error_feedback:
            error = torch.zeros(plan.compressed_numel, dtype=bucket.data.dtype, device=device)
        self._state[bucket.index] = _Bucket(
            plan, offsets,
            p=torch.zeros(plan.p_numel, dtype=factor, device=device),
            q=torch.zeros(plan.q_numel, dtype=factor, device=device),
            error=error,
        )  # fmt: skip

    # ---- what goes on the wire ----------------------------------------------------------------
    def wire_numel(self, bucket: GradBucket) -> dict[str, int]:
        """Elements a compressing step all-reduces for `bucket`: "factors" (P and Q, sum
        r (n + m), factor dtype) and "uncompressed" (grad dtype)."""
        plan = self._state[bucket.index].plan
        return {"factors": plan.factor_numel, "uncompressed": plan.uncompressed_numel}

    # ---- the hook -----------------------------------------------------------------------------
    def _compress(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        st, coll, group = self._state[bucket.index], bucket.collectives, bucket.group
        plan, grads = st.plan, bucket.gradients()
        mats = [g.view(g.shape[0], -1) if g.dim() else g.view(1, 1) for g in grads]
        compressed = [mats[i] for i in plan.compressed]
        errors = self._unit_views(st.error, plan, "x") if st.error is not None else []
        if errors:
            flat_errors = [e for unit in errors for e in unit.unbind(0)]
            torch._foreach_add_(compressed, flat_errors)
            torch._foreach_copy_(flat_errors, compressed)
        xs = self._matrices(bucket, plan, mats)
        pending_u = self._start_uncompressed(bucket, plan, grads)
        ps, qs = self._unit_views(st.p, plan, "p"), self._unit_views(st.q, plan, "q")
        self._prepare_q(st, qs)
        for x, p, q in zip(xs, ps, qs, strict=True):
            torch.bmm(x, q, out=p)
        pending_p = coll.all_reduce(st.p, group)
        if pending_u is not None:
            yield pending_u
            uncompressed = [grads[i].view(-1) for i in plan.uncompressed]
            pieces = pending_u.output.split([t.numel() for t in uncompressed])  # type: ignore[union-attr]
            torch._foreach_copy_(uncompressed, list(pieces))
        yield pending_p
        for x, p, q in zip(xs, ps, qs, strict=True):
            orthogonalize_(p, self.orthogonalization_epsilon)
            torch.bmm(x.transpose(1, 2), p, out=q)
        yield coll.all_reduce(st.q, group, average=bucket.average)
        alpha = -1.0 if bucket.average else -1.0 / bucket.group_size
        if bucket.shard is None:
            self._rebuild_all(plan, mats, xs, ps, qs, errors, alpha)
        else:
            self._rebuild_shard(bucket, st, mats, xs, ps, qs, errors, alpha)
        st.warm = self.warm_start

    def _copies(self, bucket: GradBucket) -> bool:
        """Compressed matrices are copied into a stacked factor-dtype workspace."""
        return self.batch_same_shape or self.factor_of(bucket) != bucket.data.dtype

    def _matrices(self, bucket: GradBucket, plan: BucketPlan, mats: list[Tensor]) -> list[Tensor]:
        """Each unit's b x n x m matrices: views of the grads, or a stacked copy."""
        if not self._copies(bucket):
            return [mats[u.members[0]].unsqueeze(0) for u in plan.units]
        ws = bucket.workspace(self.factor_of(bucket), "powersgd_x", plan.compressed_numel)
        xs = self._unit_views(ws, plan, "x")
        for unit, x in zip(plan.units, xs, strict=True):
            for j, i in enumerate(unit.members):
                x[j].copy_(mats[i])
        return xs

    @staticmethod
    def _unit_views(flat: Tensor, plan: BucketPlan, kind: str) -> list[Tensor]:
        """Per unit, its b x rows x cols view of a flat P ("p"), Q ("q") or matrix ("x")
        memory."""
        views = []
        for u in plan.units:
            start, rows, cols = {
                "p": (u.p_start, u.n, u.r),
                "q": (u.q_start, u.m, u.r),
                "x": (u.x_start, u.n, u.m),
            }[kind]
            views.append(flat[start : start + u.batch * rows * cols].view(u.batch, rows, cols))
        return views

    def _start_uncompressed(
        self, bucket: GradBucket, plan: BucketPlan, grads: list[Tensor]
    ) -> PendingCollective | None:
        if not plan.uncompressed:
            return None
        flat = bucket.workspace(bucket.data.dtype, "powersgd_unc", plan.uncompressed_numel)
        torch.cat([grads[i].reshape(-1) for i in plan.uncompressed], out=flat)
        return bucket.collectives.all_reduce(flat, bucket.group, average=bucket.average)

    def _prepare_q(self, st: _Bucket, qs: list[Tensor]) -> None:
        """Last step's Q (warm start), else a new draw; orthogonalised either way."""
        if not st.warm:
            gen = torch.Generator().manual_seed(self._next_seed())
            for q in qs:
                q.copy_(self._random(tuple(q.shape), q.dtype, gen))
        for q in qs:
            orthogonalize_(q, self.orthogonalization_epsilon)

    def _rebuild_all(
        self, plan: BucketPlan, mats: list[Tensor], xs: list[Tensor], ps: list[Tensor],
        qs: list[Tensor], errors: list[Tensor], alpha: float,
    ) -> None:  # fmt: skip
        """All-reduce mode: every matrix becomes P Q'^T; residual -= it / d."""
        for unit, x, p, q in zip(plan.units, xs, ps, qs, strict=True):
            torch.bmm(p, q.transpose(1, 2), out=x)
            for j, i in enumerate(unit.members):
                if x[j].data_ptr() != mats[i].data_ptr() or x.dtype != mats[i].dtype:
                    mats[i].copy_(x[j])
        if errors:
            compressed = [mats[i] for i in plan.compressed]
            torch._foreach_add_([e for u in errors for e in u.unbind(0)], compressed, alpha=alpha)

    def _rebuild_shard(
        self, bucket: GradBucket, st: _Bucket, mats: list[Tensor], xs: list[Tensor],
        ps: list[Tensor], qs: list[Tensor], errors: list[Tensor], alpha: float,
    ) -> None:  # fmt: skip
        """Reduce-scatter mode: only the rows covering this rank's shard are rebuilt into
        `data`; the residual loses the whole local approximation."""
        lo, hi = bucket.shard_range
        copies = self._copies(bucket)
        for k, unit in enumerate(st.plan.units):
            p, q = ps[k], qs[k]
            if copies and errors:  # whole P Q'^T in the factor dtype, then rows and residual
                torch.bmm(p, q.transpose(1, 2), out=xs[k])
            for j, i in enumerate(unit.members):
                first, last = _rows(st, unit, i, lo, hi)
                if copies and errors:
                    errors[k][j].add_(xs[k][j], alpha=alpha)
                    mats[i][first:last].copy_(xs[k][j][first:last])
                    continue
                if errors:
                    errors[k][j].addmm_(p[j], q[j].T, alpha=alpha)
                if last > first:
                    rows = torch.mm(p[j][first:last], q[j].T)
                    mats[i][first:last].copy_(rows)

    # ---- skipped steps, loss scale, state -----------------------------------------------------
    def _params(self) -> dict[str, tuple[int, int, int]]:
        """Compressed param name -> (bucket index, unit position, member position)."""
        found = {}
        for index, st in self._state.items():
            names = self._buckets[index].param_names
            for k, unit in enumerate(st.plan.units):
                for j, i in enumerate(unit.members):
                    found[names[i]] = (index, k, j)
        return found

    def state_dict(self) -> dict[str, Any]:
        """{"replicated": step, rng and "q/<param>" (m x r, for matrices with a warm Q),
        "per_rank": "error/<param>" (param-shaped residual), "layout": {}}."""
        replicated: dict[str, Any] = self._replicated()
        per_rank: dict[str, Tensor] = {}
        for name, (index, k, j) in self._params().items():
            st = self._state[index]
            unit = st.plan.units[k]
            if st.warm:
                replicated[f"q/{name}"] = self._unit_views(st.q, st.plan, "q")[k][j].clone()
            if st.error is not None:
                shape = self._buckets[index].params[unit.members[j]].shape
                error = self._unit_views(st.error, st.plan, "x")[k][j]
                per_rank[f"error/{name}"] = error.reshape(shape).clone()
        return {"replicated": replicated, "per_rank": per_rank, "layout": {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what `state_dict` saved at any bucket layout; merged per-rank state (another dp
        size) gives each rank residual = sum / group size, preserving the group's total."""
        if state.get("layout"):
            raise ValueError(
                f"megabuf: {self.name} state has a layout {state['layout']} but PowerSGD's state "
                "is in param space; was it saved by BatchedPowerSGD?"
            )
        params, merged = self._params(), bool(state.get("per_rank_merged", False))
        where = {n: i for i, b in self._buckets.items() for n in b.param_names}
        keys = [k for k in state["replicated"] if k not in ("step", "rng")]
        for key in keys + list(state["per_rank"]):
            field, _, name = key.partition("/")
            if field not in ("q", "error") or name not in params:
                held = "a compressed matrix of" if name in where else "held by"
                raise ValueError(
                    f"megabuf: {self.name} state key {key!r} does not name {held} this rank's "
                    f"params (rank {next(iter(self._buckets.values())).rank}); same model and "
                    "rank / min_compression_rate as when it was saved?"
                )
        self._load_replicated(state["replicated"])
        for index, st in self._state.items():
            self._load_bucket(index, st, state, merged)

    def _load_bucket(self, index: int, st: _Bucket, state: dict[str, Any], merged: bool) -> None:
        bucket = self._buckets[index]
        qs = self._unit_views(st.q, st.plan, "q")
        errors = self._unit_views(st.error, st.plan, "x") if st.error is not None else []
        have = []
        for k, unit in enumerate(st.plan.units):
            for j, i in enumerate(unit.members):
                name = bucket.param_names[i]
                q = state["replicated"].get(f"q/{name}")
                have.append(q is not None)
                if q is not None:
                    _copy_checked(qs[k][j], q, f"q/{name}", self.name)
                error = state["per_rank"].get(f"error/{name}")
                if errors:
                    target = errors[k][j]
                    if error is None:
                        target.zero_()
                        continue
                    _copy_checked(target.view(error.shape), error, f"error/{name}", self.name)
                    if merged:
                        target.div_(bucket.group_size)
        if any(have) and not all(have):
            raise ValueError(
                f"megabuf: {self.name} state has Q for some compressed matrices of "
                f"{bucket.describe()} but not all ({sum(have)} of {len(have)})"
            )
        st.warm = self.warm_start and all(have) and bool(have)


def _rows(st: _Bucket, unit: Unit, i: int, lo: int, hi: int) -> tuple[int, int]:
    return shard_rows(st.offsets[i], unit.n * unit.m, unit.m, lo, hi)


def _copy_checked(target: Tensor, value: Tensor, key: str, hook: str) -> None:
    if target.numel() != value.numel():
        raise ValueError(
            f"megabuf: {hook} state {key!r} has shape {tuple(value.shape)}, this hook expects "
            f"{tuple(target.shape)} (another rank option?)"
        )
    target.copy_(value.view(target.shape))
