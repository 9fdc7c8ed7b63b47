"""A torch-DDP training script, run unchanged on megabuf: only the import differs.

    python examples/train_torch_ddp.py                    # megabuf, 2 CPU ranks spawned here
    python examples/train_torch_ddp.py --ddp torch        # the same script on torch DDP
    python examples/train_torch_ddp.py --check            # both, and compare bit for bit
    torchrun --nproc-per-node 2 examples/train_torch_ddp.py

The loop is the usual minimal-GPT one: gradient accumulation by toggling
`model.require_backward_grad_sync`, `clip_grad_norm_`, AdamW with a warmup/cosine `LambdaLR`,
`optimizer.zero_grad(set_to_none=True)`, evaluation on rank 0 only and a rank-0 checkpoint of
`model.module.state_dict()`. There is no `finish_grad_sync()` and no `zero_grad_buffer()`:
megabuf finishes the grad sync at the end of backward, as torch DDP does, and the optimizer's
`zero_grad` starts the next accumulation fresh (docs/porting-from-torch-ddp.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if importlib.util.find_spec("megabuf") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megabuf.testing import corpus_tokens, gpt_loss, gpt_tiny, lm_batches, spawn


def ddp_class(engine: str) -> Any:
    if engine == "megabuf":
        from megabuf import DistributedDataParallel as DDP  # the one line that changes
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP


def train(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """The torch-DDP script body: every rank runs it."""
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    device = device if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    model = gpt_tiny().to(device)
    DDP = ddp_class(engine)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def lr_lambda(step: int) -> float:  # linear warmup, then cosine decay
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    cfg = model.module.config
    tokens = corpus_tokens(20_000, cfg.vocab_size, args.seed)
    draws = iter(range(10**9))

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:  # this rank's rows of a global batch
        x, y = lm_batches(tokens, args.batch * world, cfg.seq_len, next(draws))
        rows = slice(rank * args.batch, (rank + 1) * args.batch)
        return x[rows].to(device), y[rows].to(device)

    losses = []
    for step in range(args.steps):
        for micro in range(args.accum):
            model.require_backward_grad_sync = micro == args.accum - 1
            x, y = next_batch()
            loss = gpt_loss(model(x), y) / args.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item() * args.accum)
        if rank == 0 and step % 5 == 4:  # rank 0 alone: an evaluation and a checkpoint
            model.eval()
            with torch.no_grad():
                ex, ey = next_batch()
                eval_loss = gpt_loss(model(ex), ey).item()
            model.train()
            with tempfile.TemporaryDirectory() as tmp:
                torch.save(model.module.state_dict(), Path(tmp) / "ckpt.pt")
            print(f"[{engine}] step {step}: train {losses[-1]:.4f} eval {eval_loss:.4f}")
    params = [p.detach().cpu().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "world": world}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every rank: train with one engine (or both, and compare here, bit for bit)."""
    engines = ["torch", "megabuf"] if args.check else [args.ddp]
    results = {engine: train(engine, args) for engine in engines}
    out: dict[str, Any] = {
        e: {"losses": r["losses"], "world": r["world"]} for e, r in results.items()
    }
    if args.check:
        ref, got = results["torch"], results["megabuf"]
        out["same"] = ref["losses"] == got["losses"] and all(
            torch.equal(a, b) for a, b in zip(ref["params"], got["params"], strict=True)
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ddp", choices=["megabuf", "torch"], default="megabuf")
    parser.add_argument("--check", action="store_true", help="run both, compare bitwise")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (no torchrun)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    per_rank = spawn(run, args.world_size, args)  # under torchrun: just run(args) here
    for engine in ["torch", "megabuf"] if args.check else [args.ddp]:
        res = per_rank[0][engine]
        print(f"[{engine}] done: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f} "
              f"in {args.steps} steps on {res['world']} ranks")  # fmt: skip
    if not args.check:
        return 0
    same = all(r["same"] for r in per_rank)
    print(f"check: megabuf vs torch DDP, {args.steps} steps, params and losses on every rank: "
          f"{'bitwise equal -> OK' if same else 'DIFFERENT -> FAIL'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
