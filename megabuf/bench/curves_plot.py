"""Loss curves from `megabuf.bench.curves`' JSON lines to a PNG (matplotlib: `megabuf[plot]`).

Imports nothing from megabuf or torch, so it also runs by path in a venv that has only
matplotlib: `python megabuf/bench/curves_plot.py curves.jsonl curves.png`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

# one colour per hook, solid for megabuf and dashed for torch DDP
COLORS = {"none": "tab:blue", "bf16": "tab:orange", "powersgd_r1": "tab:green",
          "powersgd_r4": "tab:red", "bf16_fp32acc": "tab:purple", "reduce": "tab:gray"}  # fmt: skip


def read_curves(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the run's header line, one dict per curve: engine, hook, losses, ...)."""
    header: dict[str, Any] = {}
    curves = []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("kind") == "run":
                header = record
            elif record.get("kind") == "curve":
                curves.append(record)
    return header, curves


def smooth(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over `window` values (the first ones over what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_curves(path: str, out: str, window: int | None = None) -> None:
    """One line per curve of `path` (JSON lines) into the PNG `out`, each smoothed by a
    trailing mean over `window` steps (default: a 30th of the run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, curves = read_curves(path)
    if window is None:
        window = max(1, max((len(c["losses"]) for c in curves), default=0) // 30)
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for c in curves:
        style = "-" if c["engine"] == "megabuf" else "--"
        label = f"{c['engine']} {c['hook']} ({c['ms_per_step']:.0f} ms/step)"
        steps = range(1, len(c["losses"]) + 1)
        ax.plot(steps, smooth(c["losses"], window), style, label=label, lw=1.3,
                color=COLORS.get(c["hook"]))  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (global batch; trailing mean of {window})")
    title = header.get("title", "loss curves")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: curves_plot.py CURVES.jsonl OUT.png")
    plot_curves(sys.argv[1], sys.argv[2])
    print(f"wrote {sys.argv[2]}")
