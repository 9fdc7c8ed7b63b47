"""What the `bucket_size = "auto"` warm-up measured: the events its hooks and the grad sync
record, read into one `Measurement`, agreed over the dp group; and the probe of the collective.
`megabuf.replan.autobucket` watches the warm-up and plans from these numbers ([Note: auto bucket
re-plan] there).

[Note: quiet step]
On two shared CPU cores (and, less so, on a GPU, where collectives take SMs and memory
bandwidth) the collectives that overlap backward slow its compute by about what they hide:
many_small's backward took 63.2 ms with its buckets reduced during it and 54.5 ms with all of
them reduced after it (BENCHMARKS.md, issue 30's sixth measurement). The planner's objective,
exposed time after backward, cannot see that. So the last warm-up step (of at least three) is
*quiet*: its grads are only accumulated during backward (the groups' `is_last_microbatch` off,
as inside `no_sync()`), and `finish_grad_sync()` reduces every bucket after backward, in chain
order, as without `overlap_grad_reduce`. The numbers are the same reductions of the same grads
as any step (bitwise: tests/test_autobucket.py); only when they run moves. The step gives:
- `quiet_backward_s`: backward from its first param's grad to its end, with nothing to contend;
- `quiet_exposed_s`: every collective of the plan that ran, one after the other, exposed alone:
  a clean calibration of the collective model for reductions after backward.
The overlapped steps give the same two numbers for the plan that ran (`backward_s`,
`exposed_s`). The re-plan then compares two ways to run the step: the best overlapped plan
(its measured backward + the predicted exposed time of its chosen boundaries) and reducing each
buffer as one bucket at backward's end (the quiet backward + the predicted time of those
collectives, the model calibrated on the quiet step), and takes the second only when it is
predicted to save at least MIN_GAIN of the overlapped backward (`reduce_at_end` in
bucket_planner.py). Only where the grads are not sharded ("no_shard", "optim"): under
"optim_grads*" every full grad bucket would be held to the end, the memory those strategies
exist to save. With `auto_bucket_warmup_steps` = 2 there is no quiet step (the first step
learns, the second is the only overlapped one measured), and the comparison is not made.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megabuf.pure.bucket_planner import CollectiveModel, fit_collective_model
from megabuf.pure.timeline import Event
from megabuf.transport.collectives import Collectives, Group

PARAM_READY = "param_ready"
BACKWARD_END = "backward_end"
SYNCED = "synced"
QUIET = "quiet"  # the step that follows is the quiet step ([Note: quiet step])
PROBE_NUMELS = (1 << 12, 1 << 20)  # the two all-reduce sizes of the probe (elements)


@dataclass(frozen=True)
class Measurement:
    """What the planner needs, as measured (and, after `agree`, the same on every rank)."""

    ready_s: tuple[float, ...]  # per trainable param, registration order, rel. to backward end
    model: CollectiveModel
    steps: int  # measured steps
    exposed_s: float = 0.0  # exposed time of the plan the warm-up ran (synced - backward end)
    slowdown: float = 1.0  # the calibration's factor on the probed model (set at the re-plan)
    backward_s: float = 0.0  # overlapped backward, first grad to end ([Note: quiet step])
    quiet_backward_s: float = 0.0  # 0.0: no quiet step
    quiet_exposed_s: float = 0.0


@dataclass
class _Step:
    """One grad sync's events: each param's last ready time, its backward end, its "synced"."""

    ready: dict[int, float]
    backward_end: float
    quiet: bool
    synced: float | None = None

    @property
    def backward_s(self) -> float:
        """From its first param grad to its end."""
        return self.backward_end - min(self.ready.values())


def _steps(events: Sequence[Event]) -> list[_Step]:
    """The events cut into grad syncs: a step ends at its "backward_end" (its ready times) and
    takes the "synced" that follows; a QUIET marker flags the step after it."""
    steps: list[_Step] = []
    ready: dict[int, float] = {}
    quiet = False
    for group_id, name, t in events:
        if name == QUIET:
            quiet = True
        elif name == PARAM_READY:
            ready[group_id] = t
        elif name == BACKWARD_END:
            steps.append(_Step(ready, t, quiet))
            ready, quiet = {}, False
        elif name == SYNCED and steps and steps[-1].synced is None:
            steps[-1].synced = t
    return steps


def ready_times(
    events: Sequence[Event], n_params: int, skip_steps: int = 1
) -> tuple[list[float], int]:
    """Per param, the median over the overlapped steps (after the first `skip_steps`) of its
    last "param_ready" before the step's "backward_end", relative to it (<= 0); 0.0 when it had
    no grad."""
    per_step = [
        [s.ready[i] - s.backward_end if i in s.ready else 0.0 for i in range(n_params)]
        for s in _steps(events)[skip_steps:]
        if not s.quiet
    ]
    if not per_step:
        return [0.0] * n_params, 0
    return [statistics.median(step[i] for step in per_step) for i in range(n_params)], len(per_step)


def exposed_time(events: Sequence[Event], skip_steps: int = 1) -> float:
    """The least over the overlapped steps (after the first `skip_steps`) of "synced" -
    "backward_end": the exposed communication of the plan the warm-up ran ([Note: calibrated
    collective model] in autobucket.py). The least, not the median: load from outside the step
    only ever adds time."""
    gaps = [
        s.synced - s.backward_end
        for s in _steps(events)[skip_steps:]
        if not s.quiet and s.synced is not None
    ]
    return min(gaps) if gaps else 0.0


def backward_time(events: Sequence[Event], skip_steps: int = 1) -> float:
    """The median over the overlapped steps (after the first `skip_steps`) of backward's length
    from its first param grad to its end ([Note: quiet step]); 0.0 without any."""
    spans = [s.backward_s for s in _steps(events)[skip_steps:] if not s.quiet and s.ready]
    return statistics.median(spans) if spans else 0.0


def quiet_times(events: Sequence[Event]) -> tuple[float, float]:
    """The last quiet step's backward (first grad to end) and exposed time; (0.0, 0.0) without
    one ([Note: quiet step])."""
    quiet = [
        (s.backward_s, s.synced - s.backward_end)
        for s in _steps(events)
        if s.quiet and s.ready and s.synced is not None
    ]
    return quiet[-1] if quiet else (0.0, 0.0)


def measured(events: Sequence[Event], n_params: int, model: CollectiveModel) -> Measurement:
    """Everything one rank measured, with `model` from the probe."""
    ready, steps = ready_times(events, n_params)
    quiet_backward, quiet_exposed = quiet_times(events)
    return Measurement(
        tuple(ready), model, steps, exposed_time(events), backward_s=backward_time(events),
        quiet_backward_s=quiet_backward, quiet_exposed_s=quiet_exposed,
    )  # fmt: skip


def agree(
    measurement: Measurement, collectives: Collectives, group: Group, device: torch.device
) -> Measurement:
    """The elementwise MAX of every rank's numbers over `group` (one all-reduce)."""
    m = measurement
    tail = [m.model.latency_s, m.model.seconds_per_byte, m.exposed_s, m.backward_s,
            m.quiet_backward_s, m.quiet_exposed_s, float(m.steps)]  # fmt: skip
    tensor = torch.tensor([*m.ready_s, *tail], dtype=torch.float64, device=device)
    collectives.all_reduce_max(tensor, group)
    out = tensor.tolist()
    n = len(m.ready_s)
    latency, per_byte, exposed, backward, q_backward, q_exposed, steps = out[n:]
    return Measurement(
        tuple(out[:n]), CollectiveModel(max(0.0, latency), max(0.0, per_byte)), int(steps),
        max(0.0, exposed), backward_s=max(0.0, backward), quiet_backward_s=max(0.0, q_backward),
        quiet_exposed_s=max(0.0, q_exposed),
    )  # fmt: skip


def probe_collective(
    collectives: Collectives, group: Group, device: torch.device, dtype: torch.dtype
) -> CollectiveModel:
    """Latency and bandwidth of an all-reduce on `group`: see [Note: auto bucket re-plan]."""
    samples = []
    for numel in PROBE_NUMELS:
        tensor = torch.zeros(numel, dtype=dtype, device=device)
        times = [_timed_all_reduce(collectives, tensor, group) for _ in range(4)][1:]
        samples.append((numel * tensor.element_size(), min(times)))
    return fit_collective_model(samples)


def _timed_all_reduce(collectives: Collectives, tensor: torch.Tensor, group: Group) -> float:
    cuda = tensor.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    collectives.all_reduce(tensor, group, async_op=False).wait()
    if cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - start
