"""Wire bytes per communication hook: what each hook issued per bucket, and the formulas.

[Note: hook wire bytes]
Every collective a hook issues goes through `bucket.collectives` ([Note: comm hook contract]),
which counts it in the engine's `CommStats`. `HookWork` runs each stage of a hook (the call at
dispatch, each resumption at finish) inside `bucket.tally.counting(...)`, which adds the counts
taken during the stage to that bucket's `HookTally`: the hook's own share, whatever it issued,
counted from the real tensors as the engine's counter does (`ring_nbytes` is the textbook ring
figure for those calls, see `CommStats`). Nothing runs on the no-hook path. Collectives a hook
issues past `bucket.collectives` (straight to torch.distributed) are not seen.

`wire_formula` is the same ring figure worked out from the bucket's size and the hook's options
alone, per dispatch; the benchmark prints both, and the tests hold them equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from megabuf.comm_hooks.contract import GradBucket, hook_name


@dataclass(frozen=True)
class BucketWire:
    """One bucket's hook traffic since the last reset (bytes and calls per operation name)."""

    index: int
    kind: str  # "dense" | "expert"
    hook: str
    mode: str
    numel: int
    dtype: str
    group_size: int
    dispatches: int  # hook calls (synced steps)
    calls: dict[str, int] = field(default_factory=dict)
    input_nbytes: dict[str, int] = field(default_factory=dict)
    ring_nbytes: dict[str, int] = field(default_factory=dict)
    level: int = 1  # 2: the second level of a hybrid reduction, across the replicate group

    @property
    def total_ring_nbytes(self) -> int:
        return sum(self.ring_nbytes.values())

    @property
    def ring_nbytes_per_dispatch(self) -> int:
        """Ring bytes per hook call (0 before the first)."""
        return self.total_ring_nbytes // self.dispatches if self.dispatches else 0


@dataclass(frozen=True)
class HookReport:
    """Per-bucket hook traffic of a model (`hook_report`), with totals per step and per hook."""

    buckets: tuple[BucketWire, ...]

    @property
    def ring_nbytes_per_step(self) -> int:
        """Ring bytes of every hooked bucket for one hook call each (one synced step)."""
        return sum(b.ring_nbytes_per_dispatch for b in self.buckets)

    def by_hook(self) -> dict[str, dict[str, int]]:
        """Hook name -> {"buckets", "ring_nbytes_per_step", "calls_per_step"}."""
        out: dict[str, dict[str, int]] = {}
        for b in self.buckets:
            row = out.setdefault(b.hook, {"buckets": 0, "ring_nbytes_per_step": 0,
                                          "calls_per_step": 0})  # fmt: skip
            row["buckets"] += b.level == 1
            row["ring_nbytes_per_step"] += b.ring_nbytes_per_dispatch
            if b.dispatches:
                row["calls_per_step"] += sum(b.calls.values()) // b.dispatches
        return out

    def table(self) -> str:
        """A plain-text table, one line per bucket."""
        cols = ("bucket", "kind", "hook", "numel", "steps", "ring B/step")
        fmt = "{:>6} {:6} {:28} {:>10} {:>5} {:>12}"
        lines = [fmt.format(*cols)]
        for b in self.buckets:
            lines.append(fmt.format(b.index, b.kind, b.hook[:28], b.numel, b.dispatches,
                                    b.ring_nbytes_per_dispatch))  # fmt: skip
        lines.append(fmt.format("total", "", "", "", "", self.ring_nbytes_per_step))
        return "\n".join(lines)


def hooked_buckets(model: Any, *, levels: bool = False) -> list[Any]:
    """(hook, bucket view) of every bucket that has a hook, in bucket-index order, each bucket's
    second-level view (hybrid: [Note: comm hooks under hybrid]) after it; with `levels`,
    (hook, view, level) triples. `model` is a megabuf `DistributedDataParallel` or its
    `model.engine` or `model.engine.hooks` (anything with `all_bucket_groups`)."""
    groups = getattr(model, "engine", model).all_bucket_groups
    rows = [
        (group.comm_hook, bucket, level)
        for group in groups
        if group.comm_hook is not None
        for level, views in ((1, group.hook_buckets), (2, _second_level(group)))
        for bucket in views
    ]
    rows.sort(key=lambda row: (row[1].index, row[2]))
    return rows if levels else [(hook, bucket) for hook, bucket, _ in rows]


def _second_level(group: Any) -> list[GradBucket]:
    replicas = getattr(group, "replicas", None)
    return list(getattr(replicas, "hook_buckets", ()))


def hook_report(model: Any, *, reset: bool = False) -> HookReport:
    """What each registered comm hook issued per bucket since the last reset ([Note: hook wire
    bytes]); `reset=True` starts the count again afterwards. Empty without hooks."""
    rows = []
    for hook, bucket, level in hooked_buckets(model, levels=True):
        tally, stats = bucket.tally, bucket.tally.stats
        rows.append(BucketWire(
            index=bucket.index, kind="expert" if bucket.expert else "dense",
            hook=hook_name(hook), mode=bucket.mode, numel=bucket.data.numel(),
            dtype=str(bucket.data.dtype).removeprefix("torch."), group_size=bucket.group_size,
            dispatches=tally.dispatches, calls=dict(stats.calls),
            input_nbytes=dict(stats.input_nbytes), ring_nbytes=dict(stats.ring_nbytes),
            level=level,
        ))  # fmt: skip
        if reset:
            tally.reset()
    return HookReport(tuple(rows))


# ---- formulas ------------------------------------------------------------------------------------
def _dtype_size(dtype: object) -> int | None:
    """Bytes per element of a torch dtype or its name ("bfloat16"); None if neither."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _all_reduce(nbytes: int, d: int) -> int:
    return 2 * (d - 1) * nbytes // d  # as CommStats counts one all-reduce


def wire_formula(spec: Mapping[str, Any] | None, bucket: GradBucket) -> int | None:
    """Ring bytes one dispatch of hook `spec` (a `[comm_hook]` table: {"name": ..., options};
    None = no hook) sends for `bucket`, from sizes alone; None where no formula is known
    (another hook). PowerSGD's is for steps at or after its start step, in both modes: it
    all-reduces its P factors (sum of n*r over compressed n x m matrices) and its Q factors (sum
    of m*r), in `factor_dtype` (default: the grad dtype), and the other params uncompressed."""
    options = dict(spec) if spec is not None else {"name": "reduce"}
    name = str(options.get("name", "")).lower()
    d, numel = bucket.group_size, bucket.data.numel()
    size = bucket.data.element_size()
    rs = bucket.mode == "reduce_scatter"
    if name == "noop":
        return 0
    if name == "reduce":
        return (d - 1) * (numel // d) * size if rs else _all_reduce(numel * size, d)
    if name == "compress":
        low = _dtype_size(options.get("dtype", "bfloat16"))
        if low is None:
            return None
        if options.get("accumulate", "wire") == "fp32":
            padded = -(-numel // d) * d
            chunk = padded // d
            # all-to-all (rows for the others) [+ all-gather of this rank's chunk]
            return (padded - chunk) * low + (0 if rs else (d - 1) * chunk * low)
        return (d - 1) * (numel // d) * low if rs else _all_reduce(numel * low, d)
    if name == "powersgd":
        shapes = [tuple(p.shape) for p in bucket.params]
        p_numel, q_numel, compressed = powersgd_factor_numels(
            shapes, int(options.get("rank", 1)), float(options.get("min_compression_rate", 2.0))
        )
        uncompressed = sum(p.numel() for p in bucket.params) - compressed
        factor = _dtype_size(options.get("factor_dtype")) or size
        # one all-reduce of the uncompressed params (if any), one of every P, one of every Q
        return (_all_reduce(uncompressed * size, d) + _all_reduce(p_numel * factor, d)
                + _all_reduce(q_numel * factor, d))  # fmt: skip
    return None


def powersgd_factor_numels(
    shapes: Iterable[tuple[int, ...]], rank: int, min_compression_rate: float
) -> tuple[int, int, int]:
    """(sum of n*r, sum of m*r, numel compressed) over the tensors PowerSGD compresses: each
    tensor of 2+ dims seen as n x m = (shape[0], rest), r = min(n, m, rank), compressed when
    (n + m) * r * min_compression_rate < n * m (torch's powerSGD_hook rule)."""
    p_numel = q_numel = compressed = 0
    for shape in shapes:
        if len(shape) < 2:
            continue
        n = shape[0]
        m = 1
        for s in shape[1:]:
            m *= s
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p_numel, q_numel, compressed = p_numel + n * r, q_numel + m * r, compressed + n * m
    return p_numel, q_numel, compressed
