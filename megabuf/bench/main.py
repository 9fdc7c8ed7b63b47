"""The benchmark launcher: references, rank launches, table, JSON lines, traces."""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from megabuf.bench.hooks import (
    LOSSY_CHECK_ATOL,
    baselines_needed,
    hook_check_atol,
    unavailable_reason,
)
from megabuf.bench.mcore import MCORE_SYSTEMS
from megabuf.bench.mcore import unavailable_reason as mcore_unavailable_reason
from megabuf.bench.options import CHECK_ATOL, FLOOR, BenchOptions, parse_options
from megabuf.bench.plot import matplotlib_available, plot_timeline
from megabuf.bench.reference import Reference, compute_reference
from megabuf.bench.report import (
    Progress,
    add_pass_ratios,
    add_ratios,
    combine_ranks,
    cuda_table,
    hook_table,
    inherited_memory_note,
    memory_table,
    phase_table,
    results_table,
    write_jsonl,
)
from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.bench.worker import Job, run_jobs
from megabuf.testing.launch import spawn
from megabuf.transport.collective_backends import choose_strategy
from megabuf.transport.distributed_init import DEFAULT_BACKENDS


def machine_description() -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": load,
    }


def make_jobs(
    opts: BenchOptions, refs: dict[str, Reference], progress: Progress, hooks: Sequence[str] = ()
) -> list[Job]:
    """Every (model, system) of the run, then the hook rows (`hooks`, on `opts.hook_model`, with
    the plain systems they are compared with if the run has not got them)."""
    pairs = [(m, b, s) for m, b in opts.models.items() for s in available_systems(opts)]
    if hooks:
        have = {s for m, _, s in pairs if m == opts.hook_model}
        extra = sorted(baselines_needed(hooks) - have) + list(hooks)
        pairs += [(opts.hook_model, opts.hook_batch, s) for s in extra]
    jobs: list[Job] = []
    for model, batch, system in pairs:
        label = f"{model} {system}"
        jobs.append(Job(
            model=model, batch_per_rank=batch, system=system, warmup=opts.warmup,
            steps=opts.steps, reference=None if system == FLOOR else refs[model],
            trace_dir=opts.trace_dir, trace_steps=opts.trace_steps,
            progress=progress.prefix(len(jobs), label), reset_peak=not opts.isolate,
            megabuf_overrides=dict(opts.megabuf_overrides), device=opts.device,
            model_overrides=dict(opts.model_overrides),
        ))  # fmt: skip
    return jobs


def available_hooks(opts: BenchOptions) -> list[str]:
    """`opts.hooks` that can run here; prints a note for each one skipped (a megabuf hook not
    registered in `megabuf.comm_hooks.build`)."""
    kept = []
    for name in opts.hooks:
        reason = unavailable_reason(name)
        if reason is None:
            kept.append(name)
        else:
            print(f"megabuf.bench: skipping hook row {name}: {reason}")
    return kept


def pass_order(n_jobs: int, repeat: int) -> list[int]:
    """Job indices in the order of pass `repeat`: forward, then reversed, alternating, so a
    drift within a pass (clocks, other load) favours no system on every pass."""
    order = list(range(n_jobs))
    return order[::-1] if repeat % 2 else order


def available_systems(opts: BenchOptions) -> tuple[str, ...]:
    """`opts.systems` that can run here; prints a note for each one skipped (the megatron-core
    peers without megatron.core or off CUDA, [Note: megatron-core peers])."""
    kept = []
    for name in opts.systems:
        reason = mcore_unavailable_reason(opts.device) if name in MCORE_SYSTEMS else None
        if reason is None:
            kept.append(name)
        else:
            print(f"megabuf.bench: skipping system {name}: {reason}")
    return tuple(kept)


def run_all(opts: BenchOptions, jobs: list[Job], progress: Progress) -> list[dict[str, Any]]:
    """Per-rank results of every job, combined into one row each: `opts.repeat` passes (whole
    passes, so slow drifts hit every system alike; see `pass_order`), each job in fresh
    processes (`opts.isolate`) or every job of a pass in one launch."""
    runs: list[list[dict[str, Any]]] = [[] for _ in jobs]
    for repeat in range(opts.repeat):
        again = f" (pass {repeat + 1}/{opts.repeat})" if opts.repeat > 1 else ""
        order = pass_order(len(jobs), repeat)
        if not opts.isolate:
            progress.show(0, f"{len(jobs)} jobs in one launch{again}")
            per_rank = spawn(run_jobs, opts.world_size, [jobs[i] for i in order])
            for k, i in enumerate(order):
                runs[i].append({**combine_ranks([r[k] for r in per_rank]), "pass": repeat})
            continue
        for i in order:
            progress.show(i, f"{jobs[i].model} {jobs[i].system}{again}")
            per_rank = spawn(run_jobs, opts.world_size, [jobs[i]])
            runs[i].append({**combine_ranks([r[0] for r in per_rank]), "pass": repeat})
    rows = [median_run(r) for r in runs]
    add_pass_ratios(rows, runs)
    if opts.isolate:
        retry_noisy(opts, jobs, rows, progress)
    return rows


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median step time (all its fields stay consistent), with every run's
    step time and the spread (max - min) / 2 relative to the median."""
    ok = sorted((r for r in runs if r.get("status") == "ok"), key=lambda r: r["step_ms"])
    if len(ok) < 2:
        return ok[0] if ok else runs[0]
    row = dict(ok[(len(ok) - 1) // 2])
    row["step_ms_runs"] = [r["step_ms"] for r in runs if r.get("status") == "ok"]
    row["step_ms_spread"] = (ok[-1]["step_ms"] - ok[0]["step_ms"]) / 2 / row["step_ms"]
    return row


def _noise(row: dict[str, Any]) -> float:
    share = row.get("other_cpu_share")
    return 0.0 if share is None else float(share)


def retry_noisy(
    opts: BenchOptions, jobs: list[Job], rows: list[dict[str, Any]], progress: Progress
) -> None:
    """Run again the jobs during which other processes used more than `opts.noisy_share` of the
    CPU, keeping the quieter result, while the time budget lasts."""
    for attempt in range(1, opts.retries + 1 if opts.repeat == 1 else 1):
        noisy = [i for i, r in enumerate(rows) if _noise(r) > opts.noisy_share]
        for i in noisy:
            if time.perf_counter() - opts.started_at > opts.retry_budget_s:
                return
            progress.show(i, f"{jobs[i].model} {jobs[i].system} (again: noisy)")
            per_rank = spawn(run_jobs, opts.world_size, [jobs[i]])
            row = combine_ranks([r[0] for r in per_rank])
            row["attempts"] = attempt + 1
            if _noise(row) < _noise(rows[i]):
                rows[i] = row


def write_plots(opts: BenchOptions, rows: list[dict[str, Any]]) -> None:
    if opts.trace_dir is None:
        return
    if not matplotlib_available():
        print("PNG timelines skipped: matplotlib is not installed (pip install 'megabuf[plot]')")
        return
    for row in rows:
        per_rank = row.pop("trace", None)
        if per_rank and all(per_rank):
            path = os.path.join(opts.trace_dir, f"{row['model']}_{row['system']}_timeline.png")
            plot_timeline(per_rank, f"{row['model']} / {row['system']}", path)
            row["timeline_png"] = path


def print_report(opts: BenchOptions, rows: list[dict[str, Any]], seconds: float) -> None:
    print(results_table(rows, CHECK_ATOL))
    print()
    hooked = hook_table(rows, CHECK_ATOL)
    if hooked:
        print(
            "\nComm hooks (same model, data and run; 'x same hook' = step time / torch DDP's "
            "with the same hook, target <= 1.00; wire = ring bytes the hook issued per step, "
            "counted by megabuf's collective layer ([Note: hook wire bytes]), formula = "
            "megabuf.comm_hooks.wire_formula over the buckets (torch rows: the formula over "
            f"the params); the one-step check of lossy hooks is to {LOSSY_CHECK_ATOL:g} (2 lr):"
        )
        print(hooked)
        print()
    memory = memory_table(rows)
    if memory:
        print("Model state per param (busiest rank; measured vs formula; memory.py):")
        print(memory)
        print()
    print("Where the time goes (median ms per phase, rank 0; grad sync = finish_grad_sync):")
    print(phase_table(rows))
    gpu = cuda_table(rows)
    if gpu:
        print(
            "\nOn CUDA (peak = torch.cuda.max_memory_allocated, largest rank; formula = model "
            "state per [Note: model-state formula]; peak - formula ~ activations and workspace; "
            "exposed comm from CUDA events, megabuf only):"
        )
        print(gpu)
        note = inherited_memory_note(rows)
        if note:
            print(note)
    print(
        f"\n{opts.world_size} ranks, {opts.warmup} warm-up + {opts.steps} timed steps, "
        f"AdamW {OPTIMIZER_KWARGS}; 'x DDP' is relative to torch DDP with "
        "gradient_as_bucket_view=True, 'x floor' to the run without communication; theory = "
        "ring-optimal bytes per rank for the model's params; ring = the same figure for the calls "
        "megabuf's collective layer made (tensor sizes as handed over, padding included; megabuf "
        f"only); check = max |param - single-process step| (tolerance {CHECK_ATOL}). "
        f"Took {seconds:.0f} s. JSON lines: {opts.out}"
    )
    backend = DEFAULT_BACKENDS[opts.device]
    strategy = choose_strategy(backend, opts.device)
    print(
        f"megabuf collectives on {backend} ({opts.device} tensors): reduce-scatter = "
        f"{strategy.reduce_scatter}, all-gather = {strategy.all_gather} (see [Note: collective "
        "strategies]); ranks ran with MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ = 1 GiB "
        "(megabuf.testing.spawn)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    opts = parse_options(sys.argv[1:] if argv is None else argv)
    start = opts.started_at
    if opts.trace_dir:
        os.makedirs(opts.trace_dir, exist_ok=True)
    hooks = available_hooks(opts)
    models = dict(opts.models)
    if hooks:
        models.setdefault(opts.hook_model, opts.hook_batch)
    refs = {
        m: compute_reference(m, b, opts.world_size, opts.model_overrides) for m, b in models.items()
    }
    progress = Progress(len(make_jobs(opts, refs, Progress(1), hooks)))
    jobs = make_jobs(opts, refs, progress, hooks)
    rows = run_all(opts, jobs, progress)
    progress.show(len(jobs), "done")
    progress.close()
    add_ratios(rows, opts.world_size)
    write_plots(opts, rows)
    for row in rows:
        row.pop("trace", None)
    header = {"options": opts.__dict__, "machine": machine_description(), "argv": sys.argv}
    write_jsonl(opts.out, header, rows)
    print_report(opts, rows, time.perf_counter() - start)
    failed = [
        r
        for r in rows
        if (r.get("check_max_abs_error") or 0.0) > hook_check_atol(r["system"], CHECK_ATOL)
    ]
    return 1 if failed else 0
