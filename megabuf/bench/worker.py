"""What each benchmark rank runs: build a system, check one step, time warm steps, measure.

[Note: peak RSS per rank]
With `isolate` (the default for full runs) every (model, system) pair runs in fresh processes, so
the peak RSS (VmHWM, else getrusage's ru_maxrss) is that system's own, start-up included. Without
it the peak is reset (`/proc/self/clear_refs`) before each system, but memory an earlier system
freed stays in the heap (the benchmark raises glibc's trim threshold on purpose), so the figure is
an upper bound.

[Note: peak CUDA memory per system]
`peak_cuda_bytes` is `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` at the
start of the system, so it counts only tensors allocated (not cached blocks), but it also counts
whatever an earlier system of the same launch left allocated: `cuda_bytes_at_start` records
that, after `gc.collect()`. With `isolate` (the default) every system runs in fresh processes
and it is 0. Without it (`--no-isolate`) it should be 0 too: no system leaves anything allocated
after it ends (measured on CPU at world 1). megabuf systems did until [Note: hooks hold the
engine weakly] (their grad hooks kept every engine alive), which is why the first GPU run's peaks
climbed system after system; the report still flags such rows rather than subtracting (a later
allocation may reuse none of that memory).
"""

from __future__ import annotations

import gc
import itertools
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import megabuf
from megabuf.bench.hooks import HOOK_VARIANTS, build_hooked
from megabuf.bench.mcore import MCORE_SYSTEMS, build_mcore
from megabuf.bench.memory import (
    formula_is_exact,
    measured_persistent_nbytes,
    persistent_formula_nbytes,
    state_bytes_per_param,
)
from megabuf.bench.options import split_system
from megabuf.bench.reference import (
    Reference,
    bench_model,
    max_error,
    rank_batch,
    tokens_per_sample,
)
from megabuf.bench.systems import (
    BUILDERS,
    MEGABUF_CONFIGS,
    Engine,
    NotAvailable,
    build_megabuf,
    full_params,
    optimizer_state_nbytes,
)
from megabuf.pure.overlap import analyze
from megabuf.testing.models import loss_fn, model_from_config

PHASES = ("zero_grad", "forward", "backward", "grad_sync", "optimizer")
# Chrome traces of the peers on the many-small model reach 100 MB per rank: trace megabuf, the
# baseline and the floor only.
TRACED_PREFIXES = ("megabuf_", "torch_ddp_gabv", "no_comm")


@dataclass(frozen=True)
class Job:
    """One (model, system) measurement."""

    model: str
    batch_per_rank: int
    system: str
    warmup: int
    steps: int
    reference: Reference | None
    trace_dir: str | None
    trace_steps: int
    progress: str  # prefix of the progress line rank 0 prints (empty: silent)
    reset_peak: bool  # not isolated: see [Note: peak RSS per rank]
    megabuf_overrides: dict[str, Any] = field(default_factory=dict)  # config fields
    device: str = "cpu"  # "cpu" (gloo) or "cuda" (NCCL, GPU LOCAL_RANK)
    model_overrides: dict[str, int] = field(default_factory=dict)  # GPTConfig fields


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _show(job: Job, text: str) -> None:
    if job.progress and dist.get_rank() == 0 and sys.stderr.isatty():
        sys.stderr.write(f"\r{job.progress} {text}\x1b[K")
        sys.stderr.flush()


def train_step(engine: Engine, x: Tensor, y: Tensor, loss: Any) -> list[float]:
    """One step of megabuf's contract; returns the perf_counter times at the start and at the
    end of each phase (see PHASES): 6 values. On CUDA each phase ends when the kernels it queued
    on the current stream have run (collectives on NCCL's own streams are not waited for, so
    overlapped communication stays where it runs)."""
    now = _clock(x.device)
    t0 = now()
    with torch.profiler.record_function("bench::zero_grad"):
        engine.zero_grad()
    t_zero = now()
    with torch.profiler.record_function("bench::forward"):
        value = loss(engine.model(x), y)
    t1 = now()
    with torch.profiler.record_function("bench::backward"):
        value.backward()
    t2 = now()
    with torch.profiler.record_function("bench::grad_sync"):
        engine.finish_sync()
    t3 = now()
    with torch.profiler.record_function("bench::optimizer"):
        engine.optimizer.step()
        engine.after_step()
    return [t0, t_zero, t1, t2, t3, now()]


def _clock(device: torch.device) -> Callable[[], float]:
    """time.perf_counter, after the current CUDA stream of `device` has caught up, if CUDA."""
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter()

    return now


def check_error(job: Job, engine: Engine) -> float | None:
    if job.reference is None:
        return None
    # the reference was computed on the CPU
    return max_error(job.reference, ((n, p.detach().cpu()) for n, p in full_params(engine)))


def system_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _timed_steps(
    job: Job, engine: Engine, x: Tensor, y: Tensor, cpu: dict[str, Any]
) -> list[list[float]]:
    """Warm up, then time `job.steps` steps; fills `cpu` with this rank's CPU seconds, the
    machine's busy CPU seconds and the wall seconds of the timed steps (see `combine_ranks`)."""
    loss = loss_fn(job.model)
    for i in range(job.warmup):
        _show(job, f"warm-up {i + 1}/{job.warmup}")
        train_step(engine, x, y, loss)
    if engine.collectives is not None:
        engine.collectives.stats.reset()
    if engine.ddp is not None:
        engine.ddp.enable_timeline()
        engine.ddp.engine.hooks.comm_hook_report(reset=True)
    dist.barrier()
    phases = []
    busy, process, wall = system_busy_s(), time.process_time(), time.perf_counter()
    for i in range(job.steps):
        _show(job, f"step {i + 1}/{job.steps}")
        times = train_step(engine, x, y, loss)
        phases.append([b - a for a, b in itertools.pairwise(times)])
    end_busy = system_busy_s()
    cpu["cpu_s"] = time.process_time() - process
    cpu["wall_s"] = time.perf_counter() - wall
    cpu["machine_busy_s"] = None if busy is None or end_busy is None else end_busy - busy
    return phases


def phase_medians(phases: list[list[float]]) -> dict[str, float]:
    """Median ms of each of PHASES over steps (`phases[step][phase]` in seconds)."""
    return {n: 1e3 * statistics.median(p[i] for p in phases) for i, n in enumerate(PHASES)}


def _summary(job: Job, engine: Engine, phases: list[list[float]]) -> dict[str, Any]:
    totals = [sum(p) for p in phases]
    out: dict[str, Any] = {
        "step_ms": 1e3 * statistics.median(totals),
        "phase_ms": phase_medians(phases),
        "optimizer_state_nbytes": optimizer_state_nbytes(engine.optimizer),
        # [Note: measured model state] and [Note: memory formula]
        "persistent_nbytes": measured_persistent_nbytes(engine),
        "persistent_formula_nbytes": persistent_formula_nbytes(
            engine, job.system.partition("+")[0], job_dp_size(), _trainable_numel(engine)
        ),
        "persistent_formula_exact": formula_is_exact(engine),
        "theoretical_bytes_per_step": engine.theoretical_nbytes,
        "bytes_per_step": None,
        "overlap": None,
        "notes": engine.notes,
    }
    if engine.ddp is not None:  # the same ring figure over megabuf's padded buffers
        buckets = [b for g in engine.ddp.engine.all_bucket_groups for b in g.buckets]
        padded = sum(b.numel * b.grad_data.element_size() for b in buckets)
        out["theoretical_bytes_layout"] = 2 * (job_dp_size() - 1) * padded // job_dp_size()
    if engine.collectives is not None:
        # bytes_per_step / bytes_by_op: the ring figure of the calls megabuf made (the table's
        # "ring MB/step"); handed_bytes_by_op: the tensors it handed to torch.distributed.
        stats = engine.collectives.stats
        out["bytes_per_step"] = stats.total_ring_nbytes // job.steps
        out["bytes_by_op"] = {k: v // job.steps for k, v in stats.ring_nbytes.items()}
        out["handed_bytes_by_op"] = {k: v // job.steps for k, v in stats.input_nbytes.items()}
    if engine.ddp is not None and engine.ddp.engine.hooks.comm_hook_report().buckets:
        # what the comm hook itself issued ([Note: hook wire bytes]); per hook call = per step
        out["hook_wire_bytes_per_step"] = (
            engine.ddp.engine.hooks.comm_hook_report().ring_nbytes_per_step
        )
    auto = engine.ddp.engine.auto if engine.ddp is not None else None
    if auto is not None and auto.replanned:  # the planner's model check: predicted exposed
        out["auto_predicted_exposed_ms"] = 1e3 * (auto.predicted_exposed_s or 0.0)
        out["auto_plan"] = auto.summary  # the logged plan, with the calibration's factor
    if engine.ddp is not None and engine.ddp.timeline is not None:
        out["overlap"] = analyze(engine.ddp.timeline.events).to_dict()
        out["timeline_events"] = list(engine.ddp.timeline.events)
    return out


def _megabuf_overrides(job: Job) -> dict[str, Any]:
    """The job's config overrides; bucket_size="auto" re-plans at the last warm-up step's
    zero_grad_buffer(), so every earlier warm-up step is measured and the timed steps run on
    the chosen plan."""
    name, sized = split_system(job.system)
    overrides = {**(job.megabuf_overrides or {}), **sized}
    if MEGABUF_CONFIGS[name].get("bucket_size") == "auto":
        overrides.setdefault("auto_bucket_warmup_steps", max(2, job.warmup - 1))
    return overrides


def _trainable_numel(engine: Engine) -> int:
    return sum(p.numel() for p in engine.inner.parameters() if p.requires_grad)


def job_dp_size() -> int:
    return dist.get_world_size()


def _trace(job: Job, engine: Engine, x: Tensor, y: Tensor) -> dict[str, Any] | None:
    if job.trace_dir is None or not job.system.startswith(TRACED_PREFIXES):
        return None
    from torch.profiler import ProfilerActivity, profile

    loss = loss_fn(job.model)
    path = f"{job.trace_dir}/{job.model}_{job.system}_rank{dist.get_rank()}.json"
    _show(job, "tracing")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps = [train_step(engine, x, y, loss) for _ in range(job.trace_steps)]
    prof.export_chrome_trace(path)
    start = steps[0][0]
    events = engine.ddp.timeline.events if engine.ddp and engine.ddp.timeline else []
    return {"chrome_trace": path, "steps": steps,
            "events": [e for e in events if e[2] >= start]}  # fmt: skip


def build_engine(job: Job, module: torch.nn.Module, pgs: megabuf.ProcessGroups) -> Engine:
    """`job.system` around `module`; raises NotAvailable where it cannot run here."""
    if split_system(job.system)[0] in MEGABUF_CONFIGS:  # name@numel: a bucket size of its own
        return build_megabuf(split_system(job.system)[0], module, pgs, _megabuf_overrides(job))
    if job.system in HOOK_VARIANTS:
        return build_hooked(job.system, module, pgs, job.megabuf_overrides)
    if job.system in MCORE_SYSTEMS:
        return build_mcore(job.system, module, pgs)
    return BUILDERS[job.system](module, pgs)


def run_job(job: Job, pgs: megabuf.ProcessGroups) -> dict[str, Any]:
    """Measure one (model, system) pair on this rank."""
    result: dict[str, Any] = {"model": job.model, "system": job.system, "rank": dist.get_rank(),
                              "batch_per_rank": job.batch_per_rank}  # fmt: skip
    gc.collect()
    load_at_start = _load()
    if job.reset_peak:
        reset_peak_rss()
    device = rank_device(job.device)
    if device.type == "cuda":
        # [Note: peak CUDA memory per system]: what is still allocated now was left by earlier
        # systems of this launch (none when isolated); the peak below includes it
        result["cuda_bytes_at_start"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    try:
        cfg = bench_model(job.model, job.model_overrides)
        module = model_from_config(cfg, seed=0).to(device)
        result.update(_model_figures(job, module, tokens_per_sample(cfg)))
        engine = build_engine(job, module, pgs)
    except NotAvailable as exc:
        return {**result, "status": "n/a (not available)", "reason": str(exc)}
    x, y = (t.to(device) for t in rank_batch(cfg, job.batch_per_rank, pgs.dp_rank))
    _show(job, "checking one step")
    train_step(engine, x, y, loss_fn(job.model))
    result["check_max_abs_error"] = check_error(job, engine)
    cpu: dict[str, Any] = {}
    phases = _timed_steps(job, engine, x, y, cpu)
    result.update(cpu)
    result.update(_summary(job, engine, phases))
    result["peak_rss_bytes"] = peak_rss_bytes()
    if device.type == "cuda":
        result["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(device)
    result["loadavg_1min"] = [load_at_start, _load()]  # > world size: other work on the machine
    result["trace"] = _trace(job, engine, x, y)
    result["status"] = "ok"
    del engine
    return result


def _model_figures(job: Job, module: torch.nn.Module, tokens: int | None) -> dict[str, Any]:
    """Params, tokens per sample, and the model-state bytes the bytes/param formula predicts
    for this system on this rank (see megabuf/bench/memory.py), for the GPU table."""
    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    # a hook row has its base system's model state (hook state such as PowerSGD's not included)
    per_param = state_bytes_per_param(job.system.partition("+")[0], dist.get_world_size())
    return {
        "n_params": n_params,
        "tokens_per_sample": tokens,
        "state_bytes_per_param": per_param,
        "state_formula_bytes": int(n_params * per_param),
    }


def run_jobs(jobs: list[Job]) -> list[dict[str, Any]]:
    """The rank entry point (`megabuf.testing.spawn` target): every job, in order (all jobs of
    one launch share a device)."""
    pgs = megabuf.init_distributed(device=jobs[0].device if jobs else "cpu")
    return [run_job(job, pgs) for job in jobs]


def rank_device(device: str) -> torch.device:
    """This rank's device: the CPU, or the GPU init_distributed made current (LOCAL_RANK)."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
