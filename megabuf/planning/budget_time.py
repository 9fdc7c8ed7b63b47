"""Predicted exposed communication of one candidate configuration (pure; `megabuf plan`).

[Note: planner step-time model]
The planner ranks configurations that fit by the communication a step cannot hide. It reuses
the collective model behind `bucket_size = "auto"` (`CollectiveModel`: latency + seconds per
byte of one all-reduce over the dp group, [Note: calibrated collective model] in
autobucket.py) and the same exposure rule for a buffer's grad buckets (`predict_exposed`,
[Note: auto bucket plan] in bucket_planner.py). What it adds, per strategy:
- Other collectives are charged by their ring volume relative to that all-reduce: a
  reduce-scatter or an all-gather over d ranks moves (d - 1) / d of the bytes, an all-reduce
  2 (d - 1) / d; the latency term is kept whole.
- Grad reduction: one chain per buffer; without measured grad-ready times a param's grad is
  taken as ready when the backward has computed its share of the params (by numel, in buffer
  order, which is backward order). Without `overlap_grad_reduce` every bucket is exposed.
- Hybrid (R replicas x S shards): the reduce-scatter runs over S ranks during backward and each
  reduced shard is all-reduced over R ranks once per step, after backward: exposed.
- "optim" / "optim_grads": the all-gather of the updated params after the step is exposed
  (hidden behind the forward, as far as it lasts, with `overlap_param_gather`).
- "optim_grads_params": every unit is gathered before its forward (and again before its
  backward when units reshard after forward). Simulated unit by unit: unit i's gather starts
  once gather i - 1 is done and unit i - prefetch has started computing (with prefetch 0:
  once unit i - 1 has finished); its compute starts once its gather is done. A unit's compute
  is its numel's share of the forward (backward). Exposed = the simulated end - the compute.
- cpu_offload (params on an accelerator): this rank's grad shard goes to the host and its
  updated param shard comes back each step over `host_link`, exposed. The host optimizer
  step itself is not modelled.
The model is a ranking aid, not a stopwatch: BENCHMARKS.md states how often its order of
candidates agreed with the measured one.
"""

from __future__ import annotations

from collections.abc import Sequence

from megabuf.planning.plan import BufferPlan, Plan
from megabuf.pure.bucket_planner import CollectiveModel, predict_exposed
from megabuf.sharding.formula import itemsize
from megabuf.sharding.strategies import ShardingStrategy

FORWARD_SHARE = 1.0 / 3.0  # of a step's compute; the backward takes the rest


def ring_factor(op: str, ranks: int) -> float:
    """Bytes on the wire per byte of input for a ring `op` over `ranks` ranks."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks
    return 2.0 * share if op == "all_reduce" else share


def scaled(model: CollectiveModel, op: str, ranks: int, dp_size: int) -> CollectiveModel:
    """`model` (an all-reduce over `dp_size`) re-scaled to `op` over `ranks` ranks."""
    base = ring_factor("all_reduce", dp_size)
    if ranks <= 1:
        return CollectiveModel(0.0, 0.0)
    factor = ring_factor(op, ranks) / base if base > 0 else ring_factor(op, ranks)
    return CollectiveModel(model.latency_s, model.seconds_per_byte * factor)


def _buffer_exposed(
    buf: BufferPlan, model: CollectiveModel, backward_s: float, overlap: bool
) -> float:
    """One buffer's grad buckets: predicted exposed seconds after the backward's end."""
    buckets = buf.layout.buckets
    numels = [k.numel for k in buckets]
    total = max(1, sum(numels))
    element = itemsize(buf.grad_dtype)
    if not overlap:
        return sum(model.seconds(n * element) for n in numels)
    ready, done = [], 0
    for n in numels:
        done += n
        ready.append(backward_s * done / total)
    counts = [1] * len(numels)
    return predict_exposed(counts, numels, ready, backward_s, model, element_size=element)


def unit_gather_exposed(
    gather_s: Sequence[float], compute_s: Sequence[float], prefetch: int
) -> float:
    """Exposed seconds of gathering units before their compute; see [Note: planner step-time
    model]."""
    gather_end = 0.0
    compute_start: list[float] = []
    compute_end: list[float] = []
    clock = 0.0
    for i, (g, c) in enumerate(zip(gather_s, compute_s, strict=True)):
        if prefetch <= 0:
            may_start = compute_end[i - 1] if i else 0.0
        else:
            may_start = compute_start[i - prefetch] if i >= prefetch else 0.0
        gather_end = max(gather_end, may_start) + g
        start = max(clock, gather_end)
        compute_start.append(start)
        clock = start + c
        compute_end.append(clock)
    return max(0.0, clock - sum(compute_s))


def _unit_times(plan: Plan, model: CollectiveModel) -> tuple[list[float], list[float]]:
    """Per unit group (plan order): all-gather seconds and share of the params (by numel)."""
    gathers, shares = [], []
    total = max(1, sum(b.layout.numel for b in plan.buffers))
    for group in plan.groups:
        numel = nbytes = 0
        for b, k in group.members:
            buf = plan.buffers[b]
            numel += buf.layout.buckets[k].numel
            nbytes += buf.layout.buckets[k].numel * itemsize(buf.param_dtype)
        gathers.append(model.seconds(nbytes))
        shares.append(numel / total)
    return gathers, shares


def _param_nbytes(plan: Plan) -> list[int]:
    return [k.numel * itemsize(buf.param_dtype) for buf in plan.buffers for k in buf.layout.buckets]


def exposed_comm_s(
    plan: Plan,
    rules: ShardingStrategy,
    *,
    model: CollectiveModel,
    dp_size: int,
    shard_size: int,
    step_compute_s: float,
    overlap_grad_reduce: bool,
    overlap_param_gather: bool,
    prefetch_units: int,
    offload_nbytes: int,
    host_link: CollectiveModel,
) -> float:
    """Predicted exposed communication seconds of one step ([Note: planner step-time model])."""
    if dp_size <= 1 and offload_nbytes == 0:
        return 0.0
    forward_s = step_compute_s * FORWARD_SHARE
    backward_s = step_compute_s - forward_s
    reduce = scaled(model, rules.reduction, shard_size, dp_size)
    total = sum(_buffer_exposed(b, reduce, backward_s, overlap_grad_reduce) for b in plan.buffers)
    replicas = dp_size // shard_size
    if replicas > 1:
        across = scaled(model, "all_reduce", replicas, dp_size)
        total += sum(
            across.seconds(k.numel // shard_size * itemsize(b.grad_dtype))
            for b in plan.buffers
            for k in b.layout.buckets
        )
    gather = scaled(model, "all_gather", shard_size, dp_size)
    if rules.shards_params:
        gathers, shares = _unit_times(plan, gather)
        times = 2 if rules.reshards_after_forward else 1
        for window in [forward_s, backward_s][:times]:
            total += unit_gather_exposed(gathers, [s * window for s in shares], prefetch_units)
    elif rules.gathers_after_step:
        after = sum(gather.seconds(n) for n in _param_nbytes(plan))
        total += max(0.0, after - forward_s) if overlap_param_gather else after
    if offload_nbytes:
        total += host_link.seconds(offload_nbytes)
    return total
