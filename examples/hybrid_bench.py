"""Benchmark: hybrid (2 replicas x 2-way shard) vs flat ZeRO-1/2/3 and FSDP2's HSDP, gloo, 4 ranks.

    python examples/hybrid_bench.py [--steps 6] [--repeats 3] [--width 512]

Every rank trains the same MLP (AdamW) on its slice of a global batch; the configurations run
interleaved, `--repeats` times each, and the table gives the median step time and, per step and
rank, the ring bytes handed to each process group (megabuf's `Collectives.group_stats`; for
FSDP2 the written formula: its collectives are not counted here). On one machine every "link"
is the same loopback, so the time column measures overheads, not the inter-node saving: the
point is the bytes column, what crosses the replicate (inter-node) group.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if importlib.util.find_spec("megabuf") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.testing.launch import spawn

CONFIGS = [
    (strategy, split)
    for strategy in ("optim", "optim_grads", "optim_grads_params")
    for split in ("flat", "2x2")
] + [("fsdp2_hsdp", "2x2")]


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def build(strategy: str, split: str, width: int) -> tuple[Any, Any, Any]:
    if strategy == "fsdp2_hsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = make_model(width)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), None
    pgs = megabuf.ProcessGroups.build(dp_shard_size=2 if split == "2x2" else None)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True,
        bucket_size=width * width,
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(make_model(width), cfg, process_groups=pgs)
    opt = megabuf.DistributedOptimizer(model, torch.optim.AdamW, lr=1e-3)
    return model, opt, model.engine.collectives


def run(strategy: str, split: str, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    model, opt, counted = build(strategy, split, args.width)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, args.width, generator=g), torch.randn(64, 8, generator=g)
    n = x.shape[0] // world
    xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
    times = []
    for step in range(args.steps + 1):
        if step == 1 and counted is not None:  # after the warm-up step
            before = {k: sum(s.ring_nbytes.values()) for k, s in counted.group_stats.items()}
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        ((model(xs) - ys) ** 2).mean().backward()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    per_step: dict[str, float] = {}
    if counted is not None:
        for k, s in counted.group_stats.items():
            delta = sum(s.ring_nbytes.values()) - before.get(k, 0)
            if delta:
                per_step[k] = delta / args.steps
    return statistics.median(times[1:]), per_step


def worker(args: argparse.Namespace) -> dict[str, list[tuple[float, dict[str, float]]]]:
    megabuf.init_distributed(device="cpu")
    out: dict[str, list[tuple[float, dict[str, float]]]] = {}
    for _ in range(args.repeats):  # interleaved: every configuration once per round
        for strategy, split in CONFIGS:
            out.setdefault(f"{strategy} {split}", []).append(run(strategy, split, args))
    return out


def fsdp2_formula(width: int) -> dict[str, float]:
    """HSDP per rank per step, fp32, ring model: reduce-scatter + 2 all-gathers (forward and
    backward) over the shard group (S = 2), all-reduce of the shard over the replicas (R = 2)."""
    numel = 4 * (width * width + width) + width * 8 + 8
    nbytes, s, r = 4 * numel, 2, 2
    return {"shard": 3 * (s - 1) / s * nbytes, "replicate": 2 * (r - 1) / r * nbytes / s}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    results = spawn(worker, 4, args)[0]
    print(f"| config (gloo, 4 ranks, MLP width {args.width}) | step ms (median of "
          f"{args.repeats} rounds) | ring KiB/step/rank per group |")  # fmt: skip
    print("| --- | --- | --- |")
    for name, runs in results.items():
        ms = statistics.median(t for t, _ in runs) * 1e3
        groups = runs[0][1] or {f"{k} (formula)": v for k, v in fsdp2_formula(args.width).items()}
        text = ", ".join(f"{k} {v / 1024:,.0f}" for k, v in sorted(groups.items()))
        print(f"| {name} | {ms:.1f} | {text} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
