"""FP8 params against bf16 and FSDP2 (issue 42): param-gather bytes and step time, CPU gloo.

    python -m megabuf.bench.fp8_peers --model gpt_small --rounds 12

Runs `--dp` gloo ranks (default 2) that build every row side by side in the same processes
([Note: float8 peers] in fp8_systems.py: megabuf with the torchao float8 model and with bf16
params under each of `--strategies`, FSDP2 with float8 all-gather and with bf16 params), warm
each up, then time `--rounds` rounds of one step per row, the order reversed every other round
([Note: paired measurement]), counting every row's param all-gathers over the rounds. A row is
the median step (slowest rank), the median per-round ratio to the first row (megabuf bf16 under
the first strategy) with its 95 % interval, and the param all-gather bytes per step: the ring
figure ((n-1) x the shard each rank hands over) and the bytes of the gathered tensors.

Without torchao the float8 rows are skipped with the reason (the bf16 rows still run). The
megabuf FP8 row gathers at full width until megabuf's FP8 param kind is in the build; the
`wire` column says which it measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

import megabuf
from megabuf.bench.fp8_systems import (
    FP8_SYSTEMS,
    STRATEGY_SYSTEMS,
    GatherCount,
    GatherCounter,
    build_fp8_system,
    megabuf_gather_count,
    param_gather_formula_nbytes,
    torchao_unavailable_reason,
)
from megabuf.bench.paired import round_order, summarize
from megabuf.bench.reference import bench_model, rank_batch
from megabuf.bench.report import markdown_table, write_jsonl
from megabuf.bench.systems import Engine, NotAvailable
from megabuf.bench.worker import train_step
from megabuf.testing.launch import spawn
from megabuf.testing.models import loss_fn, model_from_config


@dataclass(frozen=True)
class Fp8Run:
    """One launch: every (system, strategy) row of `model`, side by side."""

    model: str
    batch_per_rank: int
    rows: tuple[tuple[str, str], ...]  # (one of FP8_SYSTEMS, strategy; "-" for FSDP2)
    warmup: int
    rounds: int


def row_label(system: str, strategy: str) -> str:
    return system if strategy == "-" else f"{system}[{strategy}]"


def plan_rows(strategies: Sequence[str], float8: bool) -> tuple[tuple[str, str], ...]:
    """megabuf bf16 and FP8 under each strategy, then FSDP2 bf16 and float8; without torchao
    (`float8` False) the float8 rows are left out."""
    rows = [(s, st) for st in strategies for s in ("megabuf_bf16", "megabuf_fp8")]
    rows += [("fsdp2_bf16", "-"), ("fsdp2_fp8", "-")]
    return tuple(r for r in rows if float8 or not r[0].endswith("_fp8"))


def _build(run: Fp8Run, pgs: megabuf.ProcessGroups) -> list[Engine]:
    cfg = bench_model(run.model)
    return [
        build_fp8_system(name, model_from_config(cfg, seed=0), pgs, strategy)
        for name, strategy in run.rows
    ]


def _formula(engine: Engine, system: str, dp_size: int) -> int | None:
    """FSDP2's gather formula (param_gather_formula_nbytes); None for megabuf rows."""
    if not system.startswith("fsdp2"):
        return None
    import torch

    float8 = system.endswith("_fp8")
    dtype = None if float8 else torch.bfloat16
    return param_gather_formula_nbytes(engine.inner, dp_size, float8=float8, param_dtype=dtype)


def run_rounds(run: Fp8Run) -> list[dict[str, Any]]:
    """The rank entry point (`spawn` target): `rank_rounds` on the process groups it starts."""
    return rank_rounds(run, megabuf.init_distributed(device="cpu"))


def rank_rounds(run: Fp8Run, pgs: megabuf.ProcessGroups) -> list[dict[str, Any]]:
    """This rank's side of `run`: build, warm up, then `run.rounds` interleaved rounds; per row
    the step seconds and the param all-gathers counted over the rounds."""
    x, y = rank_batch(bench_model(run.model), run.batch_per_rank, pgs.dp_rank)
    loss = loss_fn(run.model)
    counter = GatherCounter()
    with counter.installed():
        engines = _build(run, pgs)
        for engine in engines:
            for _ in range(run.warmup):
                train_step(engine, x, y, loss)
            if engine.collectives is not None:
                engine.collectives.stats.reset()
        counter.take()
        counts = [GatherCount() for _ in engines]
        steps: list[list[float]] = [[] for _ in engines]
        for r in range(run.rounds):
            for i in round_order(len(engines), r):
                dist.barrier()
                times = train_step(engines[i], x, y, loss)
                steps[i].append(times[-1] - times[0])
                counts[i].add(counter.take())
    out = []
    for i, engine in enumerate(engines):
        count = megabuf_gather_count(engine) if engine.collectives is not None else counts[i]
        out.append({
            "step_s": steps[i], "calls": count.calls, "ring_nbytes": count.ring_nbytes,
            "gathered_nbytes": count.gathered_nbytes, "notes": engine.notes,
            "formula_nbytes": _formula(engine, run.rows[i][0], pgs.dp_size),
        })  # fmt: skip
    return out


def measure(run: Fp8Run, dp_size: int) -> list[dict[str, Any]]:
    """Rows of `run` on `dp_size` spawned gloo ranks: per-step figures and ratios."""
    per_rank = spawn(run_rounds, dp_size, run)
    labels = [row_label(*r) for r in run.rows]
    summary = summarize(run.model, labels, [[row["step_s"] for row in rank] for rank in per_rank])
    rows = []
    for i, (system, strategy) in enumerate(run.rows):
        mine = per_rank[0][i]
        rows.append({
            **summary[i].__dict__, "base_system": system, "strategy": strategy,
            "dp": dp_size, "calls_per_step": mine["calls"] / run.rounds,
            "gather_ring_nbytes_per_step": mine["ring_nbytes"] // run.rounds,
            "gathered_nbytes_per_step": mine["gathered_nbytes"] // run.rounds,
            "formula_ring_nbytes_per_step": mine["formula_nbytes"], "notes": mine["notes"],
        })  # fmt: skip
    _add_wire(rows)
    return rows


def param_gather_bytes_per_step(
    model: str = "gpt_tiny", strategy: str = "optim", dp_size: int = 2, steps: int = 2
) -> dict[str, int]:
    """Param all-gather ring bytes per step (counted) of megabuf bf16, megabuf with the float8
    model, FSDP2 bf16 and FSDP2 float8 all-gather (the last three need torchao: left out
    without it), on `dp_size` spawned gloo ranks, megabuf under `strategy`."""
    rows = plan_rows([strategy], torchao_unavailable_reason() is None)
    run = Fp8Run(model, 2, rows, warmup=1, rounds=steps)
    return {r["base_system"]: r["gather_ring_nbytes_per_step"] for r in measure(run, dp_size)}


def _add_wire(rows: list[dict[str, Any]]) -> None:
    """Each row's bytes relative to its family's bf16 row (same strategy), and for the megabuf
    FP8 rows whether they measured FP8 or full-width gathers."""
    bf16 = {(r["base_system"].split("_")[0], r["strategy"]): r for r in rows
            if r["base_system"].endswith("_bf16")}  # fmt: skip
    for r in rows:
        base = bf16.get((r["base_system"].split("_")[0], r["strategy"]))
        ring = r["gather_ring_nbytes_per_step"]
        r["x_bf16_bytes"] = ring / base["gather_ring_nbytes_per_step"] if base and ring else None
        r["wire"] = _wire_label(r)


def _wire_label(row: dict[str, Any]) -> str:
    system, ratio = row["base_system"], row["x_bf16_bytes"]
    if system.endswith("_bf16"):
        return "bf16"
    if system == "fsdp2_fp8":
        return "float8 weights, fp32 rest"
    if ratio is not None and ratio > 1.5:  # twice bf16's bytes: every weight at fp32 width
        return "full width (fp32): FP8 kind not in this build"
    return "FP8 weights"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megabuf.bench.fp8_peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default="gpt_small", help="a GPT preset (default gpt_small)")
    p.add_argument("--batch", type=int, default=4, help="samples per rank (default 4)")
    p.add_argument("--dp", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument(
        "--strategies",
        default="optim,optim_grads_params",
        help=f"megabuf strategies, comma list of {list(STRATEGY_SYSTEMS)}",
    )
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per row (default 2)")
    p.add_argument("--out", default="bench-fp8-peers.jsonl", help="JSON lines output")
    args = p.parse_args(list(argv))
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in STRATEGY_SYSTEMS]
    if unknown or not args.strategies:
        p.error(f"--strategies {unknown or '(none)'}: choose from {list(STRATEGY_SYSTEMS)}")
    if args.rounds < 1 or args.warmup < 1 or args.dp < 2:
        p.error("need --rounds >= 1, --warmup >= 1 and --dp >= 2")
    return args


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("system", "wire", "gather ring MB/step", "x bf16 bytes", "FSDP2 formula MB",
            "step ms", "x base", "95% interval")  # fmt: skip
    cells = []
    for r in rows:
        formula, xb = r["formula_ring_nbytes_per_step"], r["x_bf16_bytes"]
        cells.append([
            r["system"], r["wire"], f"{r['gather_ring_nbytes_per_step'] / 1e6:.3f}",
            "-" if xb is None else f"{xb:.3f}", "-" if formula is None else f"{formula / 1e6:.3f}",
            f"{r['step_ms']:.1f}", f"{r['ratio']:.3f}",
            f"{r['ratio_low']:.3f}-{r['ratio_high']:.3f}",
        ])  # fmt: skip
    return markdown_table(head, cells)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    reason = torchao_unavailable_reason()
    if reason is not None:
        print(f"megabuf.bench.fp8_peers: skipping the float8 rows: {reason}")
    run = Fp8Run(args.model, args.batch, plan_rows(args.strategies, reason is None),
                 args.warmup, args.rounds)  # fmt: skip
    start = time.perf_counter()
    try:
        rows = measure(run, args.dp)
    except NotAvailable as exc:  # pragma: no cover - a row that cannot run on this install
        print(f"megabuf.bench.fp8_peers: {exc}")
        return 1
    header = {"argv": sys.argv, "run": run.__dict__, "dp": args.dp, "systems": FP8_SYSTEMS}
    write_jsonl(args.out, header, rows)
    print(table(rows))
    print(
        f"\n{args.dp} gloo ranks, {args.model}, {args.batch} samples per rank, {args.rounds} "
        f"rounds after {args.warmup} warm-up steps per row; 'x base' = median over rounds of "
        f"each step / {rows[0]['system']}'s step in the same round ([Note: paired "
        "measurement]); gather ring = (n-1) x shard bytes handed to each param all-gather per "
        "step (megabuf: its collective records; FSDP2: a counting wrapper on "
        f"all_gather_single); took {time.perf_counter() - start:.0f} s. JSON lines: {args.out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
