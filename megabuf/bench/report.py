"""Progress bar, per-rank aggregation, the result tables and the JSON lines file."""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from megabuf.bench.hooks import HOOK_VARIANTS, MEGABUF_BASE, TORCH_BASE, hook_check_atol
from megabuf.bench.options import BASELINE, FLOOR

MiB = 1 << 20
PHASES = ("zero_grad", "forward", "backward", "grad_sync", "optimizer")
MB = 1e6


class Progress:
    """A one-line progress bar on stderr: `[#####.....] 7/30 gpt_small torch_ddp`."""

    def __init__(self, total: int, width: int = 24, stream: TextIO | None = None) -> None:
        self.total = max(1, total)
        self.width = width
        self.stream = stream or sys.stderr

    def prefix(self, done: int, label: str) -> str:
        filled = self.width * done // self.total
        return f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {label}"

    def show(self, done: int, label: str) -> None:
        """Redraw the line on a terminal; elsewhere (a log file) one line per update."""
        if self.stream.isatty():
            self.stream.write(f"\r{self.prefix(done, label)}\x1b[K")
        else:
            self.stream.write(f"{self.prefix(done, label)}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream.isatty():
            self.stream.write("\n")
        self.stream.flush()


def combine_ranks(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's result: the slowest rank's time, the largest memory figures,
    the worst check error; rank 0's bytes, phases and overlap figures."""
    row = {k: v for k, v in per_rank[0].items() if k not in ("rank", "timeline_events")}
    if row.get("status") != "ok":
        return row
    row["step_ms"] = max(r["step_ms"] for r in per_rank)
    row["step_ms_per_rank"] = [r["step_ms"] for r in per_rank]
    for key in ("peak_rss_bytes", "optimizer_state_nbytes"):
        row[key] = max(r[key] for r in per_rank)
    for key in ("persistent_nbytes", "persistent_formula_nbytes", "cuda_bytes_at_start"):
        if all(key in r for r in per_rank):
            row[key] = max(r[key] for r in per_rank)
    if all("peak_cuda_bytes" in r for r in per_rank):
        row["peak_cuda_bytes"] = max(r["peak_cuda_bytes"] for r in per_rank)
    errors = [r["check_max_abs_error"] for r in per_rank if r["check_max_abs_error"] is not None]
    row["check_max_abs_error"] = max(errors) if errors else None
    row["other_cpu_share"] = _other_cpu_share(per_rank)
    traces = [r.get("trace") for r in per_rank]
    row["traces"] = [t["chrome_trace"] for t in traces if t]
    row["trace"] = traces if any(traces) else None  # per rank; for the PNG, not for JSON
    return row


def _other_cpu_share(per_rank: Sequence[dict[str, Any]]) -> float | None:
    """Share of the machine's CPU time that processes other than the ranks used while the ranks
    ran their timed steps (rank 0's view of /proc/stat): > 0.05 means the timings are noisy."""
    busy, wall = per_rank[0].get("machine_busy_s"), per_rank[0].get("wall_s")
    cpus = os.cpu_count() or 1
    if busy is None or not wall:
        return None
    ours = sum(r.get("cpu_s", 0.0) for r in per_rank)
    return max(0.0, (busy - ours) / (wall * cpus))


def add_pass_ratios(rows: list[dict[str, Any]], runs: Sequence[Sequence[dict[str, Any]]]) -> None:
    """With several passes, each row's ratio to the baseline of the same model taken pass by
    pass (`ratio_to_ddp_runs`; `add_ratios` reports their median), so one drifting pass cannot
    decide a ratio. `runs[i]` are row i's passes, each with its "pass" index."""
    base = {
        rows[i]["model"]: {r["pass"]: r for r in job_runs if r.get("status") == "ok"}
        for i, job_runs in enumerate(runs)
        if rows[i].get("system") == BASELINE
    }
    for row, job_runs in zip(rows, runs, strict=True):
        peers = base.get(row.get("model"), {})
        ratios = [
            r["step_ms"] / peers[r["pass"]]["step_ms"]
            for r in job_runs
            if r.get("status") == "ok" and r["pass"] in peers
        ]
        if len(ratios) > 1:
            row["ratio_to_ddp_runs"] = ratios


def add_ratios(rows: list[dict[str, Any]], world_size: int) -> None:
    """Ratio to the baseline (torch DDP, bucket view) and to the floor, per model; samples/s."""
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_model.setdefault(row["model"], {})[row["system"]] = row
    for row in rows:
        if row.get("status") != "ok":
            continue
        peers = by_model[row["model"]]
        for key, name in (("ratio_to_ddp", BASELINE), ("ratio_to_floor", FLOOR)):
            ref = peers.get(name)
            ok = ref is not None and ref.get("status") == "ok"
            row[key] = row["step_ms"] / ref["step_ms"] if ok and ref is not None else None
        if row.get("ratio_to_ddp_runs"):  # several passes: the median of per-pass ratios
            row["ratio_to_ddp"] = statistics.median(row["ratio_to_ddp_runs"])
        variant = HOOK_VARIANTS.get(row["system"])
        if variant is not None and variant.same_as is not None:
            same = peers.get(variant.same_as)
            ok = same is not None and same.get("status") == "ok"
            row["ratio_to_same_hook"] = row["step_ms"] / same["step_ms"] if ok and same else None
        row["samples_per_s"] = 1e3 * row["batch_per_rank"] * world_size / row["step_ms"]
        tokens = row.get("tokens_per_sample")
        row["tokens_per_s"] = None if tokens is None else row["samples_per_s"] * tokens


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _step_cell(row: dict[str, Any]) -> str:
    spread = row.get("step_ms_spread")
    return f"{row['step_ms']:.1f}" + ("" if spread is None else f" ±{100 * spread:.0f}%")


def _ratio_cell(row: dict[str, Any]) -> str:
    """x DDP; with several passes the median of the per-pass ratios and their half range."""
    runs = row.get("ratio_to_ddp_runs")
    cell = _num(row.get("ratio_to_ddp"), ".2f")
    return cell if not runs else f"{cell} ±{(max(runs) - min(runs)) / 2:.2f}"


def _pct(share: float | None) -> float | None:
    return None if share is None else 100.0 * share


def _cells(row: dict[str, Any], tolerance: float) -> list[str]:
    if row.get("status") != "ok":
        return [row["model"], row["system"]] + ["-"] * 10 + [str(row.get("status"))]
    measured = row.get("bytes_per_step")
    sent = _num(measured / MB, ".2f") if measured is not None else "-"
    overlap = row.get("overlap") or {}
    check = _check_cell(row, tolerance)
    return [
        row["model"], row["system"], _step_cell(row),
        _ratio_cell(row), _num(row.get("ratio_to_floor"), ".2f"),
        f"{row['samples_per_s']:.1f}", f"{row['peak_rss_bytes'] / MiB:.0f}",
        f"{row['optimizer_state_nbytes'] / MiB:.1f}", sent,
        f"{row['theoretical_bytes_per_step'] / MB:.2f}",
        _exposed_cell(overlap.get("median_exposed_ms"), row.get("auto_predicted_exposed_ms")),
        _num(_pct(row.get("other_cpu_share")), ".0f"),
        check,
    ]  # fmt: skip


def _exposed_cell(measured: float | None, predicted: float | None) -> str:
    """Measured exposed communication; for bucket_size="auto" also what its planner predicted
    for the plan it chose (the model check of issue 30)."""
    cell = _num(measured, ".1f")
    return cell if predicted is None else f"{cell} (model {predicted:.1f})"


def _check_cell(row: dict[str, Any], tolerance: float) -> str:
    """ok/FAIL and the error of the one-step check (a lossy hook's own tolerance)."""
    err = row.get("check_max_abs_error")
    if err is None:
        return "n/a"
    return ("ok " if err <= hook_check_atol(row["system"], tolerance) else "FAIL ") + f"{err:.1e}"


HEADER = [
    "model", "system", "step ms", "x DDP", "x floor", "samples/s", "peak RSS MiB",
    "opt state MiB", "ring MB/step", "theory MB/step", "exposed comm ms", "other CPU %", "check",
]  # fmt: skip
PHASE_HEADER = ["model", "system", "zero_grad ms", "forward ms", "backward ms", "grad sync ms",
                "optimizer ms"]  # fmt: skip


def markdown_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |"]
    out.append("| " + " | ".join("-" * w for w in widths) + " |")
    for cells in lines:
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |")
    return "\n".join(out)


def results_table(rows: Sequence[dict[str, Any]], tolerance: float) -> str:
    return markdown_table(HEADER, [_cells(r, tolerance) for r in rows])


def phase_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        if row.get("status") == "ok":
            p = row["phase_ms"]
            lines.append([row["model"], row["system"]] + [f"{p[k]:.1f}" for k in PHASES])
    return markdown_table(PHASE_HEADER, lines) if lines else ""


HOOK_HEADER = [
    "model", "system", "step ms", "x same hook", "x DDP", "wire MB/step", "formula MB/step",
    "wire = formula", "check",
]  # fmt: skip


def _hook_cells(row: dict[str, Any], tolerance: float) -> list[str]:
    if row.get("status") != "ok":
        return [row["model"], row["system"]] + ["-"] * 6 + [str(row.get("status"))]
    wire, formula = row.get("hook_wire_bytes_per_step"), row.get("theoretical_bytes_per_step")
    if wire is None:  # no megabuf hook: the engine's own count (torch rows: none)
        wire = row.get("bytes_per_step")
    same = "-" if wire is None or formula is None else (
        "yes" if wire == formula else f"no ({wire - formula:+d} B)"
    )  # fmt: skip
    return [
        row["model"], row["system"], _step_cell(row), _num(row.get("ratio_to_same_hook"), ".2f"),
        _ratio_cell(row), _num(None if wire is None else wire / MB, ".3f"),
        _num(None if formula is None else formula / MB, ".3f"), same, _check_cell(row, tolerance),
    ]  # fmt: skip


def hook_table(rows: Sequence[dict[str, Any]], tolerance: float) -> str:
    """The comm-hook rows (megabuf/bench/hooks.py) with the plain megabuf and torch DDP rows of
    the same model; empty when the run had no hook row."""
    models = {r["model"] for r in rows if r["system"] in HOOK_VARIANTS}
    keep = (MEGABUF_BASE, TORCH_BASE)
    lines = [
        _hook_cells(r, tolerance)
        for r in rows
        if r["model"] in models and (r["system"] in HOOK_VARIANTS or r["system"] in keep)
    ]
    return markdown_table(HOOK_HEADER, lines) if lines else ""


CUDA_HEADER = [
    "model", "system", "step ms", "x DDP", "tokens/s", "peak CUDA MiB", "state formula MiB",
    "B/param", "peak - formula MiB", "exposed comm ms",
]  # fmt: skip


def _cuda_cells(row: dict[str, Any]) -> list[str]:
    peak, formula = row["peak_cuda_bytes"], row["state_formula_bytes"]
    overlap = row.get("overlap") or {}
    return [
        row["model"], row["system"], _step_cell(row), _ratio_cell(row),
        _num(row.get("tokens_per_s"), ".0f"), f"{peak / MiB:.0f}", f"{formula / MiB:.0f}",
        f"{row['state_bytes_per_param']:g}", f"{(peak - formula) / MiB:.0f}",
        _num(overlap.get("median_exposed_ms"), ".2f"),
    ]  # fmt: skip


def cuda_table(rows: Sequence[dict[str, Any]]) -> str:
    """Step time, tokens/s, peak CUDA memory (largest rank) against the model-state formula
    ([Note: model-state formula] in memory.py) and exposed communication (CUDA timeline, megabuf
    systems only); empty when no row ran on CUDA."""
    lines = [_cuda_cells(r) for r in rows if r.get("status") == "ok" and "peak_cuda_bytes" in r]
    return markdown_table(CUDA_HEADER, lines) if lines else ""


def inherited_memory_note(rows: Sequence[dict[str, Any]]) -> str:
    """A warning naming the rows whose peak includes memory earlier systems of the same launch
    left allocated ([Note: peak CUDA memory per system]); empty when there are none."""
    inherited = [r for r in rows if r.get("cuda_bytes_at_start")]
    if not inherited:
        return ""
    named = ", ".join(f"{r['system']} {r['cuda_bytes_at_start'] / MiB:.0f} MiB" for r in inherited)
    return (
        f"!! peak CUDA memory of {len(inherited)} rows includes what earlier systems of the same "
        f"launch left allocated (--no-isolate): {named}; run isolated for per-system peaks"
    )


MEMORY_HEADER = [
    "model", "system", "persistent B/param", "formula B/param", "measured = exact formula",
    "persistent MiB",
]  # fmt: skip


def _memory_cells(row: dict[str, Any]) -> list[str]:
    n, got, want = row["n_params"], row["persistent_nbytes"], row["persistent_formula_nbytes"]
    same = "yes" if got == want else f"no ({got - want:+d} B)"
    if not row.get("persistent_formula_exact", True):
        same = "textbook"  # the formula leaves out padding, scalars and unreachable buffers
    return [
        row["model"], row["system"], f"{got / n:.3f}", f"{want / n:.3f}", same,
        f"{got / MiB:.1f}",
    ]  # fmt: skip


def memory_table(rows: Sequence[dict[str, Any]]) -> str:
    """Model state each system keeps per trainable param on its busiest rank, measured
    ([Note: measured model state] in memory.py) next to the formula: exact for megabuf's
    distributed-optimizer strategies ([Note: memory formula]), the textbook figure otherwise
    ([Note: model-state formula]); empty when no row has the figures."""
    lines = [
        _memory_cells(r)
        for r in rows
        if r.get("status") == "ok" and "persistent_nbytes" in r and r.get("n_params")
    ]
    return markdown_table(MEMORY_HEADER, lines) if lines else ""


def write_jsonl(path: str, header: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps({"kind": "run", **header}) + "\n")
        for row in rows:
            f.write(json.dumps({"kind": "result", **row}, default=str) + "\n")
