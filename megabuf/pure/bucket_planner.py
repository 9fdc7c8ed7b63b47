"""Bucket boundaries chosen from a measured step: the pure planner behind `bucket_size = "auto"`.

Sees numbers only (param numels in buffer order, their measured grad-ready times, the backward
end, a latency + bandwidth model of the collective) and returns frozen records; never a process
group or a Parameter. `megabuf.replan.autobucket` measures, agrees the numbers across ranks and
applies the result.

[Note: auto bucket plan]
The model of one step's gradient communication for one buffer (one dispatch chain):
- params sit in buffer order (reverse registration, [Note: buffer layout]); param i's grad is
  ready at `ready_s[i]`; a bucket is ready when its last-ready param is;
- a bucket's collective costs `latency_s + seconds_per_byte * nbytes` (its padded numel times the
  element size), and collectives run one after another in bucket order (one chain per
  communicator, [Note: one chain per communicator] in plan.py): bucket k starts at
  max(its ready time, the end of bucket k - 1);
- predicted exposed communication = max(0, end of the last bucket - backward end), the figure
  the overlap report measures ([Note: what the overlap report measures] in overlap.py).
`plan_buckets` returns the boundaries with the least predicted exposed time and, among those
(within TIE_S), the fewest buckets, so with nothing to overlap (one rank, a free link) it keeps
one bucket instead of fragmenting. Exactly, by dynamic programming over (prefix of params,
number of buckets): the end of a prefix's last collective only grows with the end of the prefix
before it, so the earliest-ending k-bucket plan of each prefix extends an earliest-ending
(k - 1)-bucket plan of a shorter one. Cost O(n^2 k): above MAX_PLANNED_PARAMS params, runs of
neighbours are planned as one (a boundary may then fall only between runs). Layout rules
hold by construction: a bucket is a run of whole params (never split), a `breaks_after[i]`
boundary (a param with a bucket of its own, a shard-unit change) is always cut and never
spanned, and the padded size is computed as `compute_layout` will lay it out. Identical inputs
give identical boundaries (no randomness, no dict order, ties broken by a fixed rule), which is
why every rank must plan from the same, agreed numbers (`megabuf.replan.autobucket` takes the MAX
over the data-parallel group before planning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MAX_PLANNED_PARAMS = 512  # above this, neighbouring params are planned in runs (O(n^2 k) DP)
MAX_BUCKETS = 64  # per buffer
TIE_S = 1e-6  # plans whose predicted exposed times differ by less are equally good
MAX_SLOWDOWN = 64.0  # the most `calibrate` slows the probed model down
MIN_GAIN = 0.02  # of the backward's length: a smaller predicted gain keeps the plan that ran


@dataclass(frozen=True)
class CollectiveModel:
    """Seconds for one collective of `nbytes`: `latency_s + seconds_per_byte * nbytes`."""

    latency_s: float
    seconds_per_byte: float

    def __post_init__(self) -> None:
        for name in ("latency_s", "seconds_per_byte"):
            value = getattr(self, name)
            if not value >= 0.0 or value == float("inf"):
                raise ValueError(
                    f"megabuf: CollectiveModel.{name} must be finite >= 0, got {value}"
                )

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + self.seconds_per_byte * nbytes


@dataclass(frozen=True)
class BucketChoice:
    """The chosen boundaries of one buffer: `param_counts[k]` params (in buffer order) in bucket
    k; `predicted_exposed_s` is the model's exposed time for them ([Note: auto bucket plan])."""

    param_counts: tuple[int, ...]
    bucket_numels: tuple[int, ...]  # padded numel of each bucket, as compute_layout lays it out
    predicted_exposed_s: float


def fit_collective_model(samples: Sequence[tuple[int, float]]) -> CollectiveModel:
    """Least-squares latency + bandwidth fit of (nbytes, seconds) samples, clamped to >= 0.
    One distinct size: all of the time is charged to bandwidth (latency 0)."""
    if not samples:
        raise ValueError("megabuf: fit_collective_model needs at least one (nbytes, s) sample")
    n = len(samples)
    mean_b = sum(b for b, _ in samples) / n
    mean_t = sum(t for _, t in samples) / n
    var_b = sum((b - mean_b) ** 2 for b, _ in samples)
    if var_b == 0.0:
        return CollectiveModel(0.0, max(0.0, mean_t / mean_b) if mean_b > 0 else 0.0)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in samples) / var_b
    slope = max(0.0, slope)
    return CollectiveModel(max(0.0, mean_t - slope * mean_b), slope)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def bucket_numel(numels: Sequence[int], *, param_align: int, pad_multiple: int) -> int:
    """Padded numel of one bucket holding `numels` (buffer order), as compute_layout packs it:
    each param starts at a multiple of `param_align`, the end is padded to `pad_multiple`."""
    cursor = 0
    for numel in numels:
        cursor = _round_up(cursor, param_align) + numel
    return _round_up(cursor, pad_multiple)


def predict_exposed(
    param_counts: Sequence[int],
    numels: Sequence[int],
    ready_s: Sequence[float],
    backward_end_s: float,
    model: CollectiveModel,
    *,
    element_size: int,
    param_align: int = 1,
    pad_multiple: int = 1,
) -> float:
    """The model's exposed time of given boundaries ([Note: auto bucket plan])."""
    if sum(param_counts) != len(numels) or any(c <= 0 for c in param_counts):
        raise ValueError(
            f"megabuf: bucket param counts {tuple(param_counts)} do not cover {len(numels)} params"
        )
    end, lo = float("-inf"), 0
    for count in param_counts:
        hi = lo + count
        size = bucket_numel(numels[lo:hi], param_align=param_align, pad_multiple=pad_multiple)
        end = max(max(ready_s[lo:hi]), end) + model.seconds(size * element_size)
        lo = hi
    return max(0.0, end - backward_end_s)


def plan_buckets(
    numels: Sequence[int],
    ready_s: Sequence[float],
    backward_end_s: float,
    model: CollectiveModel,
    *,
    element_size: int,
    param_align: int = 1,
    pad_multiple: int = 1,
    breaks_after: Sequence[bool] | None = None,
) -> BucketChoice:
    """Boundaries of one buffer minimising the predicted exposed communication, then the number
    of buckets; see [Note: auto bucket plan]. `numels`, `ready_s`, `breaks_after` are in buffer
    order; `breaks_after[i]` forces a boundary after param i."""
    _check_inputs(numels, ready_s, backward_end_s, element_size, param_align, pad_multiple)
    cuts = list(breaks_after) if breaks_after is not None else [False] * len(numels)
    if len(cuts) != len(numels):
        raise ValueError(f"megabuf: breaks_after has {len(cuts)} entries for {len(numels)} params")
    runs = _runs(len(numels), cuts)
    packed = [
        bucket_numel(numels[lo:hi], param_align=param_align, pad_multiple=1) for lo, hi in runs
    ]
    ends = _solve(
        packed, [max(ready_s[lo:hi]) for lo, hi in runs], [cuts[hi - 1] for _, hi in runs],
        model, element_size, param_align, pad_multiple,
    )  # fmt: skip
    counts = _pick(ends, backward_end_s)
    param_counts, k = [], 0
    for c in counts:  # runs back to params
        param_counts.append(sum(hi - lo for lo, hi in runs[k : k + c]))
        k += c
    bucket_numels, lo = [], 0
    for c in param_counts:
        bucket_numels.append(
            bucket_numel(numels[lo : lo + c], param_align=param_align, pad_multiple=pad_multiple)
        )
        lo += c
    exposed = predict_exposed(
        param_counts, numels, ready_s, backward_end_s, model, element_size=element_size,
        param_align=param_align, pad_multiple=pad_multiple,
    )  # fmt: skip
    return BucketChoice(tuple(param_counts), tuple(bucket_numels), exposed)


def _check_inputs(
    numels: Sequence[int],
    ready_s: Sequence[float],
    backward_end_s: float,
    element_size: int,
    param_align: int,
    pad_multiple: int,
) -> None:
    if not numels:
        raise ValueError("megabuf: plan_buckets needs at least one param")
    if len(ready_s) != len(numels):
        raise ValueError(f"megabuf: {len(ready_s)} ready times for {len(numels)} params")
    bad = [i for i, n in enumerate(numels) if n <= 0]
    if bad:
        raise ValueError(f"megabuf: params at buffer positions {bad} have no elements")
    times = [*ready_s, backward_end_s]
    if any(t != t or t in (float("inf"), float("-inf")) for t in times):
        raise ValueError("megabuf: measured ready / backward-end times must be finite")
    if element_size <= 0 or param_align <= 0 or pad_multiple <= 0:
        raise ValueError(
            f"megabuf: element_size, param_align, pad_multiple must be > 0, got "
            f"{element_size}, {param_align}, {pad_multiple}"
        )


def _runs(n: int, cuts: Sequence[bool]) -> list[tuple[int, int]]:
    """[lo, hi) runs of params planned as one unit: single params up to MAX_PLANNED_PARAMS,
    else runs of neighbours; a run never spans a forced cut."""
    width = max(1, -(-n // MAX_PLANNED_PARAMS))
    runs, lo = [], 0
    for i in range(n):
        if i + 1 - lo >= width or cuts[i] or i == n - 1:
            runs.append((lo, i + 1))
            lo = i + 1
    return runs


@dataclass(frozen=True)
class _Ends:
    """`end[k][i]`: the earliest end of the last collective of runs [0, i) in k buckets
    (inf: impossible); `start[k][i]`: where that plan's last bucket starts."""

    end: torch.Tensor  # 2-D float64, (buckets + 1, runs + 1)
    start: torch.Tensor  # 2-D int64, same shape


def _solve(
    packed: Sequence[int],
    ready: Sequence[float],
    cut_after: Sequence[bool],
    model: CollectiveModel,
    element_size: int,
    param_align: int,
    pad_multiple: int,
) -> _Ends:
    """The DP of [Note: auto bucket plan] over (prefix, bucket count), vectorised over the
    start of the last bucket."""
    n = len(packed)
    k_max = min(n, MAX_BUCKETS)
    host = torch.device("cpu")  # a few scalars per param: planned on the host, any device
    rounds = [_round_up(p, param_align) for p in packed]
    rounded = torch.tensor(rounds, dtype=torch.int64, device=host)
    zero = torch.zeros(1, dtype=torch.int64, device=host)
    before = torch.cat([zero, torch.cumsum(rounded, 0)])
    ready_t = torch.tensor(list(ready), dtype=torch.float64, device=host)
    end = torch.full((k_max + 1, n + 1), float("inf"), dtype=torch.float64, device=host)
    start = torch.zeros((k_max + 1, n + 1), dtype=torch.int64, device=host)
    end[0, 0] = float("-inf")
    first = 0  # no bucket starts before the latest forced cut
    for hi in range(1, n + 1):
        lo = torch.arange(first, hi, device=host)
        numel = before[hi - 1] - before[lo] + packed[hi - 1]  # runs lo..hi-1, packed
        nbytes = -(-numel // pad_multiple) * pad_multiple * element_size
        cost = model.latency_s + model.seconds_per_byte * nbytes.to(torch.float64)
        last_ready = torch.flip(torch.cummax(torch.flip(ready_t[first:hi], [0]), 0).values, [0])
        prev = end[:k_max, first:hi]
        cand = torch.maximum(last_ready.unsqueeze(0), prev) + cost.unsqueeze(0)
        best, arg = torch.min(cand, dim=1)
        end[1:, hi] = best
        start[1:, hi] = arg + first
        if cut_after[hi - 1]:
            first = hi
    return _Ends(end, start)


def _pick(ends: _Ends, backward_end_s: float) -> list[int]:
    """Runs per bucket of the plan with the least exposed time (within TIE_S), then the fewest
    buckets."""
    n = ends.end.shape[1] - 1
    exposed = torch.clamp(ends.end[:, n] - backward_end_s, min=0.0)
    least = float(exposed.min())
    k = next(k for k in range(exposed.shape[0]) if float(exposed[k]) <= least + TIE_S)
    counts, hi = [], n
    while hi > 0:
        lo = int(ends.start[k, hi])
        counts.append(hi - lo)
        hi, k = lo, k - 1
    return counts[::-1]


def format_bucket_ends(ends: Sequence[Sequence[int]]) -> str:
    """`--bucket-ends` syntax: a buffer's ends comma-separated, buffers split by ';'."""
    return ";".join(",".join(map(str, e)) for e in ends)


def parse_bucket_ends(text: str) -> tuple[tuple[int, ...], ...]:
    """The inverse of the `--bucket-ends` syntax ("23,26" or "10,20;4" for two buffers)."""
    try:
        return tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";"))
    except ValueError:
        raise ValueError(
            f"--bucket-ends {text!r}: expected comma-separated param counts per buffer, "
            "buffers separated by ';' (as the bucket_size=auto re-plan logs them)"
        ) from None


def calibrate(
    model: CollectiveModel,
    predict: Callable[[CollectiveModel], float],
    measured_exposed_s: float,
) -> tuple[CollectiveModel, float]:
    """The probed `model` slowed down by the least factor in [1, MAX_SLOWDOWN] with which
    `predict` (the model's exposed time of the plan that was measured) reaches the exposed time
    measured with that plan, and the factor; see [Note: calibrated collective model] in
    autobucket.py. Never faster than the probe; deterministic (bisection, fixed steps)."""

    def slowed(factor: float) -> CollectiveModel:
        return CollectiveModel(model.latency_s * factor, model.seconds_per_byte * factor)

    if predict(model) >= measured_exposed_s:
        return model, 1.0
    if predict(slowed(MAX_SLOWDOWN)) < measured_exposed_s:
        return slowed(MAX_SLOWDOWN), MAX_SLOWDOWN
    lo, hi = 1.0, MAX_SLOWDOWN  # predict(slowed(lo)) < measured <= predict(slowed(hi))
    for _ in range(40):
        mid = (lo + hi) / 2
        if predict(slowed(mid)) >= measured_exposed_s:
            hi = mid
        else:
            lo = mid
    return slowed(hi), hi


def worth_changing(
    chosen: Sequence[BucketChoice], current: Sequence[BucketChoice], backward_s: float
) -> bool:
    """Whether to replace the current boundaries by the chosen ones (the worst buffer of each
    decides): with no more buckets, when not predicted worse; with more, only when predicted to
    save at least MIN_GAIN of the backward's length `backward_s` of exposed time, since the
    model leaves out what each extra bucket costs during backward (its dispatch, its share of
    the device or the cores), so a smaller predicted gain is not trusted (many_small,
    BENCHMARKS.md)."""

    def worst(choices: Sequence[BucketChoice]) -> float:
        return max((c.predicted_exposed_s for c in choices), default=0.0)

    def count(choices: Sequence[BucketChoice]) -> int:
        return sum(len(c.param_counts) for c in choices)

    gain = worst(current) - worst(chosen)
    if count(chosen) <= count(current):
        return gain >= -TIE_S
    return gain >= MIN_GAIN * backward_s


def reduce_at_end(overlapped_s: float, at_end_s: float, backward_s: float) -> bool:
    """Whether reducing every buffer after backward (`at_end_s`: the quiet step's backward + the
    predicted time of those collectives) beats the overlapped plan (`overlapped_s`: its
    measured backward + predicted exposed time) by at least MIN_GAIN of the overlapped
    backward `backward_s` ([Note: quiet step] in warmup.py): a smaller predicted gain is
    within what one quiet step measures."""
    return at_end_s <= overlapped_s - MIN_GAIN * backward_s
