"""PNG timeline of compute vs communication per rank (needs matplotlib: `pip install
megabuf[plot]`). Input: each rank's traced steps (phase boundaries) and megabuf timeline events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLORS = {
    "zero_grad": "tab:gray",
    "forward": "tab:blue",
    "backward": "tab:green",
    "grad_sync": "tab:red",
    "optimizer": "tab:purple",
}


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _comm_bars(events: Sequence[Sequence[Any]]) -> list[tuple[float, float, int]]:
    """(dispatch, finish, group_id) per bucket group and step, from timeline events."""
    open_at: dict[int, float] = {}
    bars = []
    for group_id, name, t in events:
        if name == "dispatch":
            open_at[group_id] = t
        elif name == "finish" and group_id in open_at:
            bars.append((open_at.pop(group_id), t, group_id))
    return bars


def plot_timeline(per_rank: Sequence[dict[str, Any]], title: str, path: str) -> None:
    """Two rows per rank: compute phases, and each bucket group's dispatch-to-finish window."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(t["steps"][0][0] for t in per_rank)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * len(per_rank)))
    labels = []
    for rank, trace in enumerate(per_rank):
        y_compute, y_comm = 2 * rank + 1, 2 * rank
        for step in trace["steps"]:
            for i, phase in enumerate(COLORS):
                start, width = step[i] - origin, step[i + 1] - step[i]
                ax.broken_barh([(1e3 * start, 1e3 * width)], (y_compute - 0.4, 0.8),
                               color=COLORS[phase])  # fmt: skip
        for start, end, _ in _comm_bars(trace["events"]):
            ax.broken_barh([(1e3 * (start - origin), 1e3 * (end - start))], (y_comm - 0.4, 0.8),
                           color="tab:orange", alpha=0.6, edgecolor="black")  # fmt: skip
        labels += [f"rank {rank} comm", f"rank {rank} compute"]
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("ms")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="tab:orange", alpha=0.6))
    ax.legend(handles, [*COLORS, "bucket group in flight"], loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
