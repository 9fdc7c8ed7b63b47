"""`LowRankHook`: what `PowerSGD` and `BatchedPowerSGD` share (options, the synced-step counter,
the seeded generator, skipped steps and loss-scale changes, the replicated state); see
[Note: PowerSGD in megabuf] in powersgd.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.builtin import Reduce
from megabuf.comm_hooks.contract import MODES, GradBucket

SEED_RANGE = 1_000_000_000  # each Q draw seeds a fresh generator with a number below this


class LowRankHook:
    """What PowerSGD and BatchedPowerSGD share: options, the synced-step counter, the seeded
    generator, the skip / loss-scale methods and the replicated part of the state."""

    name = "LowRankHook"
    modes = MODES
    two_level_note = (  # why hybrid sharding refuses it ([Note: comm hooks under hybrid])
        "it keeps error feedback and Q factors per bucket across steps, shaped by the bucket's "
        "params; the second level's view of the reduced shard has neither"
    )
    _state: Mapping[int, Any]  # bucket index -> the subclass's state (has `warm`, `error`)
    # optim_grads*: set True to accept the full-size residuals ([Note: sharded grad lifecycle])
    allow_full_size_error_feedback = False

    def __init__(
        self, rank: int, start_step: int, error_feedback: bool, warm_start: bool,
        orthogonalization_epsilon: float, seed: int, factor_dtype: torch.dtype | None,
    ) -> None:  # fmt: skip
        bad = []
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            bad.append(f"rank={rank!r} must be an int >= 1")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            bad.append(f"start_step={start_step!r} must be an int >= 0")
        if not orthogonalization_epsilon >= 0:
            bad.append(f"orthogonalization_epsilon={orthogonalization_epsilon!r} must be >= 0")
        if factor_dtype is not None and (
            not isinstance(factor_dtype, torch.dtype) or not factor_dtype.is_floating_point
        ):
            bad.append(f"factor_dtype={factor_dtype!r} must be a floating torch dtype or None")
        if bad:
            raise ValueError(f"megabuf: {self.name}: " + "; ".join(bad))
        self.rank = rank
        self.start_step = start_step
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = int(seed)
        self.factor_dtype = factor_dtype
        self._rng = torch.Generator().manual_seed(self.seed)
        self._buckets: dict[int, GradBucket] = {}
        self._calls: dict[int, int] = {}  # bucket index -> synced steps it has seen

    # ---- registration and the counter ---------------------------------------------------------
    def setup(self, buckets: list[GradBucket]) -> None:
        for bucket in buckets:
            if bucket.index in self._buckets:
                raise ValueError(
                    f"megabuf: {self.name} is already set up for {bucket.describe()}; one "
                    "instance per model (register it once, or once per buffer kind)"
                )
            factor = self.factor_of(bucket)
            grad = bucket.data.dtype
            if grad == torch.bfloat16 and factor == torch.float16:
                raise ValueError(
                    f"megabuf: {self.name} factor_dtype=torch.float16 on {bucket.describe()}: "
                    "fp16 factors lose the range of bf16 grads; use torch.float32 or None"
                )
            self._buckets[bucket.index] = bucket
            self._calls[bucket.index] = 0
            self._setup_bucket(bucket)

    def _setup_bucket(self, bucket: GradBucket) -> None:
        raise NotImplementedError

    def factor_of(self, bucket: GradBucket) -> torch.dtype:
        """The dtype of P and Q for `bucket`: `factor_dtype`, else the grad dtype."""
        return self.factor_dtype if self.factor_dtype is not None else bucket.data.dtype

    @property
    def step(self) -> int:
        """Synced steps seen (the largest count of any bucket; all are equal between steps)."""
        return max(self._calls.values(), default=0)

    def __call__(self, bucket: GradBucket) -> Any:
        step = self._calls[bucket.index]
        self._calls[bucket.index] = step + 1
        if step < self.start_step:
            return Reduce()(bucket)
        return self._compress(bucket)

    def _compress(self, bucket: GradBucket) -> Any:
        raise NotImplementedError

    def wire_numel(self, bucket: GradBucket) -> dict[str, int]:
        raise NotImplementedError

    def wire_nbytes(self, bucket: GradBucket) -> int:
        """Bytes of the tensors a compressing step all-reduces for `bucket` (what
        `Collectives.stats.input_nbytes["all_reduce"]` counts)."""
        numel = self.wire_numel(bucket)
        factor_size = self.factor_of(bucket).itemsize
        return numel["factors"] * factor_size + numel["uncompressed"] * bucket.data.element_size()

    def _next_seed(self) -> int:
        """The seed of one Q draw, from the hook's generator (the same on every rank)."""
        return int(torch.randint(SEED_RANGE, (1,), generator=self._rng).item())

    def _random(self, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> Tensor:
        """Normal values drawn on the CPU (the same on every device type)."""
        return torch.randn(shape, generator=gen, dtype=dtype)

    # ---- skipped steps and loss scale ---------------------------------------------------------
    def on_step_skipped(self) -> None:
        """The optimizer skipped the last synced step (inf/NaN): drop every residual and Q and
        reseed the generator (the hook is then a new one), and do not count that step."""
        self._reset_memory()
        self._rng.manual_seed(self.seed)
        for index, calls in self._calls.items():
            self._calls[index] = max(0, calls - 1)

    def on_loss_scale_change(self, ratio: float) -> None:
        """The loss scale was multiplied by `ratio`: so are the residuals (loss-scaled units)."""
        for error in self._errors():
            error.mul_(ratio)

    def _reset_memory(self) -> None:
        """Drop warm-start Q and zero the residuals (each subclass's per-bucket state has
        `warm` and `error`)."""
        for st in self._state.values():
            st.warm = False
            if st.error is not None:
                st.error.zero_()

    def _errors(self) -> list[Tensor]:
        return [st.error for st in self._state.values() if st.error is not None]

    # ---- state ([hook state protocol]: replicated / per_rank / layout) ------------------------
    def _replicated(self) -> dict[str, Any]:
        steps = set(self._calls.values())
        if len(steps) > 1:
            raise RuntimeError(
                f"megabuf: {self.name}.state_dict() during a grad sync: its buckets have seen "
                f"{sorted(steps)} steps; save between steps"
            )
        return {"step": self.step, "rng": self._rng.get_state()}

    def _load_replicated(self, replicated: dict[str, Any]) -> None:
        for index in self._calls:
            self._calls[index] = int(replicated["step"])
        self._rng.set_state(replicated["rng"])
