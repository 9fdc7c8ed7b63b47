"""`BatchedPowerSGD`: a whole bucket as one square matrix ([Note: PowerSGD in megabuf]).

The bucket's B elements (padding included) are laid row by row into an s x s matrix,
s = ceil(sqrt(B)), zero-padded in a persistent workspace (never a `resize_` of the grad
buffer), and compressed with rank min(s, rank): every element is compressed, 2 s r factor
elements go on the wire per bucket. The state (residual s^2, Q s x r) is tied to the bucket
layout: `state_dict()["layout"]` records each bucket's numel and group size and loading into
another layout raises.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import GradBucket
from megabuf.comm_hooks.lowrank import orthogonalize_, shard_rows
from megabuf.comm_hooks.lowrank_hook import LowRankHook


@dataclass
class _Square:
    side: int  # s
    r: int
    p: Tensor  # s x r, factor dtype
    q: Tensor  # s x r, factor dtype; last step's Q when `warm`
    error: Tensor | None  # s^2, factor dtype (the workspace's): residual of the padded matrix
    warm: bool = False


class BatchedPowerSGD(LowRankHook):
    """Rank-`rank` PowerSGD of each bucket as one ceil(sqrt(B)) x ceil(sqrt(B)) matrix, in both
    modes; options as `PowerSGD`'s (no per-matrix test: everything is compressed). Memory per
    bucket: an s^2 workspace and, with error feedback, an s^2 residual (factor dtype), P and Q
    (2 s r)."""

    name = "BatchedPowerSGD"

    def __init__(
        self,
        rank: int = 1,
        start_step: int = 1000,
        error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0.0,
        seed: int = 0,
        factor_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            rank, start_step, error_feedback, warm_start, orthogonalization_epsilon, seed,
            factor_dtype,
        )  # fmt: skip
        self._state: dict[int, _Square] = {}

    def _setup_bucket(self, bucket: GradBucket) -> None:
        side = math.isqrt(bucket.data.numel() - 1) + 1 if bucket.data.numel() else 0
        r = min(side, self.rank)
        factor, device = self.factor_of(bucket), bucket.data.device
        error = torch.zeros(side * side, dtype=factor, device=device)
        self._state[bucket.index] = _Square(
            side, r,
            p=torch.zeros(side, r, dtype=factor, device=device),
            q=torch.zeros(side, r, dtype=factor, device=device),
            error=error if self.error_feedback else None,
        )  # fmt: skip

    def wire_numel(self, bucket: GradBucket) -> dict[str, int]:
        """Elements a compressing step all-reduces: P and Q, 2 s r (factor dtype)."""
        st = self._state[bucket.index]
        return {"factors": 2 * st.side * st.r, "uncompressed": 0}

    def _compress(self, bucket: GradBucket) -> Generator[Any, Any, None]:
        st, coll, numel = self._state[bucket.index], bucket.collectives, bucket.data.numel()
        flat = bucket.workspace(self.factor_of(bucket), "batched_powersgd_x", st.side**2)
        x = flat.view(st.side, st.side)
        flat[:numel].copy_(bucket.data)
        flat[numel:].zero_()
        if st.error is not None:
            flat.add_(st.error)
            st.error.copy_(flat)
        if not st.warm:
            gen = torch.Generator().manual_seed(self._next_seed())
            st.q.copy_(self._random(tuple(st.q.shape), st.q.dtype, gen))
        orthogonalize_(st.q.unsqueeze(0), self.orthogonalization_epsilon)
        torch.mm(x, st.q, out=st.p)
        yield coll.all_reduce(st.p, bucket.group)
        orthogonalize_(st.p.unsqueeze(0), self.orthogonalization_epsilon)
        torch.mm(x.T, st.p, out=st.q)
        yield coll.all_reduce(st.q, bucket.group, average=bucket.average)
        alpha = -1.0 if bucket.average else -1.0 / bucket.group_size
        if bucket.shard is None or st.error is not None:
            torch.mm(st.p, st.q.T, out=x)
            if st.error is not None:
                st.error.add_(flat, alpha=alpha)
            lo, hi = bucket.shard_range if bucket.shard is not None else (0, numel)
            bucket.data[lo:hi].copy_(flat[lo:hi])
        else:  # only the rows holding this rank's shard
            lo, hi = bucket.shard_range
            first, last = shard_rows(0, st.side**2, st.side, lo, hi)
            rows = torch.mm(st.p[first:last], st.q.T).view(-1)
            start = first * st.side
            bucket.data[lo:hi].copy_(rows[lo - start : hi - start])
        st.warm = self.warm_start

    # ---- skipped steps, loss scale, state -----------------------------------------------------
    def _layout(self) -> dict[str, Any]:
        order = sorted(self._buckets)
        return {
            "bucket_indices": order,
            "bucket_numels": [self._buckets[i].data.numel() for i in order],
            "group_sizes": [self._buckets[i].group_size for i in order],
            "rank": self.rank,
        }

    def state_dict(self) -> dict[str, Any]:
        """{"replicated": step, rng, "q/bucket/<index>"; "per_rank": "error/bucket/<index>"
        (the s^2 residual); "layout": bucket indices, numels, group sizes, rank}."""
        replicated: dict[str, Any] = self._replicated()
        per_rank: dict[str, Tensor] = {}
        for index, st in self._state.items():
            if st.warm:
                replicated[f"q/bucket/{index}"] = st.q.clone()
            if st.error is not None:
                per_rank[f"error/bucket/{index}"] = st.error.clone()
        return {"replicated": replicated, "per_rank": per_rank, "layout": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Only into the same bucket layout and group sizes; merged per-rank state gives each
        rank residual = sum / group size."""
        mine, saved = self._layout(), state.get("layout", {})
        for key, value in mine.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"megabuf: BatchedPowerSGD state is tied to the bucket layout; saved with "
                    f"{key}={saved.get(key)}, this model has {key}={value} ({self._where(key)}). "
                    "Load it with the same bucket_size and dp size, or use PowerSGD"
                )
        merged = bool(state.get("per_rank_merged", False))
        self._load_replicated(state["replicated"])
        for index, st in self._state.items():
            q = state["replicated"].get(f"q/bucket/{index}")
            if q is not None:
                st.q.copy_(q)
            st.warm = self.warm_start and q is not None
            if st.error is None:
                continue
            error = state["per_rank"].get(f"error/bucket/{index}")
            st.error.copy_(error) if error is not None else st.error.zero_()
            if merged:
                st.error.div_(self._buckets[index].group_size)

    def _where(self, key: str) -> str:
        if key in ("bucket_numels", "group_sizes"):
            return "; ".join(b.describe() for b in self._buckets.values())
        return f"rank {next(iter(self._buckets.values())).rank}"
