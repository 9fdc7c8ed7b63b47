"""Paired benchmark: every system of a model in the same ranks, their steps interleaved.

    python -m megabuf.bench.paired --models mlp_34m,gpt_small,many_small \\
        --systems torch_ddp_gabv,megabuf_ar_overlap,megabuf_ar_auto --rounds 30

[Note: paired measurement]
The pass-interleaved bench (`python -m megabuf.bench`) runs each (model, system) in processes
of its own, one after another, and takes ratios pass by pass. On a shared machine the rows of one
pass still run seconds to minutes apart under different load, and single passes swing by 25 %,
so a ratio near 1.00x moves from one side of the line to the other between runs (issue 30's
rows, BENCHMARKS.md). Here the systems of one model are built side by side in the same ranks,
each checked against the single-process step and warmed up on its own, and then timed in
rounds: one step of each system per round, the order reversed every other round (A B C, C B A,
...), every step started by a barrier so the ranks start it together. A drift slower than a
round (other jobs, clocks, a neighbour's memory traffic) hits every system of the round alike,
and the ratio of each step to the baseline's step of the same round cancels it. A row is the
median over rounds of the step time (the slowest rank's, as in the bench) and of the per-round
ratio to the first system, with a distribution-free 95 % interval of that median: the k-th
smallest and k-th largest ratio, k from the binomial tail (`median_interval`). A ratio whose
interval lies below 1.00 was faster in most rounds beyond chance; one whose interval holds 1.00
is a tie at this machine's resolution.

What it leaves out, on purpose: memory (the systems share each process's heap; the plain bench
isolates them), and overlap that crosses a step boundary: after each step the system's params
are made readable (`Engine.publish`: the distributed optimizer's param all-gathers that
`overlap_param_gather` leaves in flight for the next forward are waited for), so another
system's step never runs beside them. For the all-reduce path that changes nothing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import megabuf
from megabuf.bench.options import CHECK_ATOL, DEFAULT_MODELS, parse_models, parse_systems
from megabuf.bench.reference import bench_model, compute_reference, rank_batch
from megabuf.bench.report import markdown_table, write_jsonl
from megabuf.bench.systems import MEGABUF_CONFIGS
from megabuf.bench.worker import (
    Job,
    build_engine,
    check_error,
    phase_medians,
    rank_device,
    train_step,
)
from megabuf.pure.overlap import analyze
from megabuf.testing.launch import spawn
from megabuf.testing.models import loss_fn, model_from_config

DEFAULT_SYSTEMS = "torch_ddp_gabv,megabuf_ar_overlap,megabuf_ar_auto"
CONFIDENCE = 0.95
WORLD_SIZE = 2  # gloo ranks on this host (CPU); see [Note: paired measurement]


def round_order(n_systems: int, round_index: int) -> list[int]:
    """Systems in the order of round `round_index`: forward, then reversed, alternating."""
    order = list(range(n_systems))
    return order[::-1] if round_index % 2 else order


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free interval of the median of `values`: the k-th smallest and the k-th
    largest, k the largest with P(Binomial(n, 1/2) <= k - 1) <= (1 - confidence) / 2; the whole
    range when n is too small for any such k (n < 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("megabuf.bench.paired: no values to take a median interval of")
    tail, k, below = (1.0 - confidence) / 2.0, 0, 0.0
    for j in range(n):  # below = P(B <= j) once j is added
        below += math.comb(n, j) / 2.0**n
        if below > tail:
            break
        k = j + 1
    if k == 0:
        return xs[0], xs[-1]
    return xs[k - 1], xs[n - k]


@dataclass(frozen=True)
class PairedRow:
    """One (model, system) of a paired run; ratios are to the run's first system."""

    model: str
    system: str
    step_ms: float  # median over rounds of the slowest rank's step
    ratio: float  # median over rounds of step / the baseline's step in the same round
    ratio_low: float  # CONFIDENCE interval of that median
    ratio_high: float
    faster_rounds: int  # rounds where this system's step was shorter than the baseline's
    rounds: int


def summarize(model: str, systems: Sequence[str], per_rank: Sequence[Sequence[Sequence[float]]]
              ) -> list[PairedRow]:  # fmt: skip
    """Rows from `per_rank[rank][system][round]` step seconds: each round's step is the slowest
    rank's, each ratio is to the first system's step of the same round."""
    n_rounds = len(per_rank[0][0])
    steps = [
        [max(rank[s][r] for rank in per_rank) for r in range(n_rounds)] for s in range(len(systems))
    ]
    rows = []
    for s, name in enumerate(systems):
        ratios = [steps[s][r] / steps[0][r] for r in range(n_rounds)]
        low, high = median_interval(ratios)
        rows.append(PairedRow(
            model, name, 1e3 * statistics.median(steps[s]), statistics.median(ratios), low, high,
            sum(x < 1.0 for x in ratios), n_rounds,
        ))  # fmt: skip
    return rows


def _rounds(jobs: Sequence[Job], pgs: megabuf.ProcessGroups, rounds: int) -> list[dict[str, Any]]:
    """This rank's side of one model's paired run: build, check and warm up every system, then
    `rounds` rounds of one step each ([Note: paired measurement])."""
    device = rank_device(jobs[0].device)
    cfg = bench_model(jobs[0].model, jobs[0].model_overrides)
    x, y = (t.to(device) for t in rank_batch(cfg, jobs[0].batch_per_rank, pgs.dp_rank))
    loss = loss_fn(jobs[0].model)
    engines: list[Any] = []
    out: list[dict[str, Any]] = []
    for job in jobs:
        engine = build_engine(job, model_from_config(cfg, seed=0).to(device), pgs)
        train_step(engine, x, y, loss)
        out.append({"system": job.system, "check_max_abs_error": check_error(job, engine)})
        for _ in range(job.warmup):
            train_step(engine, x, y, loss)
            engine.publish()
        if engine.ddp is not None:
            engine.ddp.enable_timeline()
        engines.append(engine)
    steps: list[list[float]] = [[] for _ in jobs]
    phases: list[list[list[float]]] = [[] for _ in jobs]
    for r in range(rounds):
        for i in round_order(len(jobs), r):
            dist.barrier()
            times = train_step(engines[i], x, y, loss)
            engines[i].publish()
            steps[i].append(times[-1] - times[0])
            phases[i].append([b - a for a, b in itertools.pairwise(times)])
    for i, engine in enumerate(engines):
        out[i]["step_s"] = steps[i]
        out[i]["phase_ms"] = phase_medians(phases[i])
        if engine.ddp is not None and engine.ddp.timeline is not None:
            out[i]["exposed_ms"] = (
                analyze(engine.ddp.timeline.events).to_dict().get("median_exposed_ms")
            )
        if engine.ddp is not None:
            groups = engine.ddp.engine.all_bucket_groups
            out[i]["bucket_groups"] = len(groups)
            out[i]["counted_groups"] = sum(g.counted is not None for g in groups)
        auto = engine.ddp.engine.auto if engine.ddp is not None else None
        if auto is not None and auto.replanned:
            out[i]["auto_plan"] = auto.summary
    del engines
    gc.collect()
    return out


def run_paired(models: Sequence[Sequence[Job]], rounds: int) -> list[list[dict[str, Any]]]:
    """The rank entry point (`megabuf.testing.spawn` target): each model's paired run in turn."""
    pgs = megabuf.init_distributed(device=models[0][0].device)
    return [_rounds(jobs, pgs, rounds) for jobs in models]


def _jobs(model: str, batch: int, systems: Sequence[str], warmup: int) -> list[Job]:
    ref = compute_reference(model, batch, WORLD_SIZE)
    return [
        Job(model=model, batch_per_rank=batch, system=s, warmup=warmup, steps=0, reference=ref,
            trace_dir=None, trace_steps=0, progress="", reset_peak=False)
        for s in systems
    ]  # fmt: skip


def check_options(systems: Sequence[str], rounds: int, warmup: int) -> None:
    """Refuse what would measure something else than it says, naming the option."""
    if len(systems) < 2:
        raise ValueError("megabuf.bench.paired: --systems needs a baseline and at least one more")
    if len(set(systems)) != len(systems):
        raise ValueError(f"megabuf.bench.paired: --systems names a system twice: {list(systems)}")
    if rounds < 1:
        raise ValueError(f"megabuf.bench.paired: --rounds must be >= 1, got {rounds}")
    auto = [s for s in systems if MEGABUF_CONFIGS.get(s, {}).get("bucket_size") == "auto"]
    if auto and warmup < 3:
        raise ValueError(
            f"megabuf.bench.paired: {auto} re-plan after warmup - 1 measured steps: --warmup must "
            f"be >= 3 so the rounds run on the chosen plan, got {warmup}"
        )


def _table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("model", "system", "step ms", "x base", "95% interval", "faster rounds", "exposed ms",
            "check")  # fmt: skip
    return markdown_table(head, [_cells(r) for r in rows])


def _cells(r: dict[str, Any]) -> list[str]:
    exposed, err = r.get("exposed_ms"), r.get("check_max_abs_error")
    return [
        r["model"], r["system"], f"{r['step_ms']:.1f}", f"{r['ratio']:.3f}",
        f"{r['ratio_low']:.3f}-{r['ratio_high']:.3f}", f"{r['faster_rounds']}/{r['rounds']}",
        "-" if exposed is None else f"{exposed:.1f}", "-" if err is None else f"{err:.1e}",
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megabuf.bench.paired", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--models", help="comma list of preset[:batch_per_rank] (default: the bench's)")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help="comma list; the first is the base")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per system (default 5)")
    p.add_argument("--out", default="bench-paired.jsonl", help="JSON lines output")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    models = parse_models(args.models) if args.models else dict(DEFAULT_MODELS)
    systems = parse_systems(args.systems)
    check_options(systems, args.rounds, args.warmup)
    start = time.perf_counter()
    specs = [_jobs(m, b, systems, args.warmup) for m, b in models.items()]
    per_rank = spawn(run_paired, WORLD_SIZE, specs, args.rounds)
    rows: list[dict[str, Any]] = []
    for k, model in enumerate(models):
        results = [rank[k] for rank in per_rank]
        summary = summarize(model, systems, [[s["step_s"] for s in rank] for rank in results])
        for s, row in enumerate(summary):
            errors = [rank[s]["check_max_abs_error"] for rank in results]
            keys = ("phase_ms", "exposed_ms", "auto_plan", "bucket_groups", "counted_groups")
            extra = {key: results[0][s][key] for key in keys
                     if key in results[0][s]}  # fmt: skip
            rows.append({**row.__dict__, **extra, "check_max_abs_error": max(errors),
                         "step_s_per_rank": [rank[s]["step_s"] for rank in results]})  # fmt: skip
    header = {"argv": sys.argv, "rounds": args.rounds, "warmup": args.warmup,
              "models": models, "systems": list(systems)}  # fmt: skip
    write_jsonl(args.out, header, rows)
    print(_table(rows))
    print(f"\n2 gloo ranks; 'x base' is the median over rounds of each step / {systems[0]}'s step "
          f"in the same round, with a distribution-free {CONFIDENCE:.0%} interval of that median "
          f"([Note: paired measurement]); took {time.perf_counter() - start:.0f} s. "
          f"JSON lines: {args.out}")  # fmt: skip
    failed = [r for r in rows if (r["check_max_abs_error"] or 0.0) > CHECK_ATOL]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
