"""Hybrid sharding over "nodes": shard inside a node, replicate across nodes (docs/sharding.md).

Two "nodes" of two ranks on this machine, each its own torchrun process tree, joined by torchrun's
static rendezvous (run both lines, in two shells or with `&`):

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29512 examples/train_hybrid.py --check
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --master-addr 127.0.0.1 \\
        --master-port 29512 examples/train_hybrid.py --check

Each rank's shard group is its node (`dp_shard_size="node"`: torchrun's LOCAL_WORLD_SIZE), so
the reduce-scatters and param gathers stay inside a node and only each shard's all-reduce
crosses nodes. Without torchrun the script spawns 4 ranks as 2 x 2 itself. `--check` trains the
same model on the whole global batch in one process (torch's AdamW) and compares the params;
every rank prints its bytes per process group.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

if importlib.util.find_spec("megabuf") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.testing.launch import spawn, under_torchrun

GLOBAL_BATCH, DIM, LR = 32, 32, 1e-2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def train(args: argparse.Namespace) -> dict[str, Any]:
    # under torchrun a node's ranks are its LOCAL_WORLD_SIZE; spawned here, 2 "nodes" of 2
    shard: int | str = "node" if under_torchrun() else 2
    pgs = megabuf.init_distributed(device="cpu", dp_shard_size=shard)
    topo = pgs.topology
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=args.strategy, overlap_grad_reduce=True, bucket_size=2000
    )
    model = megabuf.DistributedDataParallel(make_model(), cfg, process_groups=pgs)
    opt = megabuf.DistributedOptimizer(model, torch.optim.AdamW, lr=LR)
    n = GLOBAL_BATCH // topo.dp_size
    lo = topo.dp_rank * n
    for step in range(args.steps):
        x, y = batch(step)
        opt.zero_grad()
        for i in range(args.micro):  # all but the last micro-batch inside no_sync()
            m = n // args.micro
            xs, ys = x[lo + i * m : lo + (i + 1) * m], y[lo + i * m : lo + (i + 1) * m]
            ctx = model.no_sync() if i < args.micro - 1 else torch.enable_grad()
            with ctx:
                (((model(xs) - ys) ** 2).mean() / args.micro).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sent = {
        name: sum(s.ring_nbytes.values())
        for name, s in model.engine.collectives.group_stats.items()
    }
    return {"rank": topo.rank, "split": (topo.dp_replicate_size, topo.dp_shard_size),
            "state": state, "ring_nbytes": sent}  # fmt: skip


def reference(steps: int) -> dict[str, torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return model.state_dict()


def say(line: str) -> None:
    """One write per line: the ranks of a node share one stdout, and print() writes the text and
    its newline separately, so two ranks' lines could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(result: dict[str, Any], args: argparse.Namespace) -> bool:
    r, s = result["split"]
    groups = ", ".join(f"{k} {v:,}" for k, v in sorted(result["ring_nbytes"].items()))
    say(f"rank {result['rank']}: {r} replicas x {s}-way shard; ring bytes per group: {groups}")
    if not args.check:
        return True
    want = reference(args.steps)
    diff = max((result["state"][k] - want[k]).abs().max().item() for k in want)
    ok = diff < 1e-5
    say(f"rank {result['rank']} check vs 1 process: max param diff {diff:.2e} -> "
        f"{'OK' if ok else 'FAILED'}")  # fmt: skip
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--strategy", default="optim_grads",
                   choices=["optim", "optim_grads", "optim_grads_params"])  # fmt: skip
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    results = spawn(train, 4, args)  # under torchrun: this rank only
    ok = all([report(result, args) for result in results])
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
