"""Train a small mixture-of-experts model with expert parallelism (EP=2) on 4 CPU ranks.

    python examples/train_moe.py                          # spawns 4 CPU ranks by itself
    torchrun --nproc-per-node 4 examples/train_moe.py     # or let torchrun start them
    python examples/train_moe.py --check                  # and compare with one process

What every rank does (configs/moe.toml):

1. `megabuf.init_distributed(ep_size=2)`: dp = all 4 ranks, ep groups [0, 1] [2, 3] (ranks that
   exchange tokens), expt_dp groups [0, 2] [1, 3] (replicas of the same experts).
2. `megabuf.testing.moe.MoEModel` keeps 2 of the 4 experts on each ep rank and marks their params
   expert-parallel; `megabuf.DistributedDataParallel` puts them in separate buffers reduced over
   expt_dp (scaled so every grad is still the average over all 4 data-parallel ranks: see
   [Note: gradient scaling] in megabuf/training/finalize.py).
3. Each step `megabuf.pipeline.forward_backward_no_pipelining` accumulates grads over the
   micro-batches (no_sync on all but the last) and calls `megabuf.finalize_model_grads`; the
   optimizer (distributed over dp for dense params and over expt_dp for experts) steps.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

try:
    import megabuf
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import megabuf
from megabuf.config import tomllib
from megabuf.testing import spawn
from megabuf.testing.moe import MoEConfig, MoEModel, moe_batch

REPO = Path(__file__).resolve().parents[1]
WORLD_SIZE = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "moe.toml")
    parser.add_argument("--steps", type=int, default=None, help="override [moe] steps")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    return parser.parse_args(argv)


def _mse(out: torch.Tensor, y: torch.Tensor) -> Any:
    loss = ((out - y) ** 2).mean()
    return loss, {"loss": float(loss.detach())}


def forward_step(data_iterator: Any, model: Any) -> Any:
    x, y = next(data_iterator)
    return model(x), lambda out: _mse(out, y)


def _load(config_path: Path) -> tuple[dict[str, Any], MoEConfig]:
    with open(config_path, "rb") as f:
        raw = tomllib.load(f)
    return raw, MoEConfig(**raw["model"])


def train(config_path: Path, steps_override: int | None) -> list[float]:
    raw, cfg = _load(config_path)
    moe = raw["moe"]
    pgs = megabuf.init_distributed(ep_size=moe["ep_size"])
    net = MoEModel(cfg, ep_group=pgs.ep, seed=0)
    model = megabuf.DistributedDataParallel(
        net, megabuf.DistributedDataParallelConfig.from_toml(config_path), process_groups=pgs
    )
    net.moe.collectives = model.engine.collectives  # count the token all-to-all bytes with the rest
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig.from_toml(config_path))
    hooks = megabuf.default_schedule_hooks([model])
    m_count, mbs = moe["microbatches"], moe["micro_batch_size"]
    losses, steps = [], steps_override or moe["steps"]
    for step in range(steps):
        opt.zero_grad()
        x, y = moe_batch(cfg, pgs.dp_size * m_count * mbs, seed=step)
        lo = pgs.dp_rank * m_count * mbs
        batches = [(x[lo + i * mbs : lo + (i + 1) * mbs], y[lo + i * mbs : lo + (i + 1) * mbs])
                   for i in range(m_count)]  # fmt: skip
        metrics = megabuf.pipeline.forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model,
            num_microbatches=m_count, hooks=hooks,
        )  # fmt: skip
        _, grad_norm, _ = opt.step()
        loss = torch.tensor([sum(m["loss"] for m in metrics) / m_count], dtype=torch.float64)
        model.engine.collectives.all_reduce(loss, pgs.dp, average=True, async_op=False)
        losses.append(float(loss.item()))
        if pgs.dp_rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}  grad norm {grad_norm:.4f}", flush=True)
    sent = model.engine.collectives.stats.ring_nbytes
    if pgs.dp_rank == 0:
        print(f"rank 0 sent {sent.get('all_to_all', 0)} B of tokens (all-to-all), "
              f"{model.engine.collectives.stats.total_ring_nbytes} B in all")  # fmt: skip
    return losses


def reference(config_path: Path, steps_override: int | None) -> list[float]:
    """The whole model (all experts) in one process on the global batch, plain torch Adam."""
    raw, cfg = _load(config_path)
    moe, lr = raw["moe"], raw["optimizer"]["lr"]
    net = MoEModel(cfg, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    rows = WORLD_SIZE * moe["microbatches"] * moe["micro_batch_size"]
    losses = []
    for step in range(steps_override or moe["steps"]):
        x, y = moe_batch(cfg, rows, seed=step)
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = spawn(train, WORLD_SIZE, args.config, args.steps)
    if not args.check:
        return
    ref = reference(args.config, args.steps)
    worst = max(abs(a - b) for a, b in zip(results[0], ref, strict=True))
    print(f"--check: largest |EP loss - one-process loss| over {len(ref)} steps: {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("--check failed: expert-parallel training diverged from one process")


if __name__ == "__main__":
    main()
