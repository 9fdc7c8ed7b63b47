"""Loss curves of the demo GPT in FP8 (torchao float8) and in bf16, from the same init and data.

    python -m megabuf.bench.fp8_curves --steps 300 --jsonl docs/bench/fp8-loss-curves.jsonl
    python -m megabuf.bench.fp8_curves --steps 30 --dp 2 --strategy optim   # through megabuf

[Note: FP8 loss band]
Three precisions train examples/train_gpt.py's model (gpt_tiny, its corpus, global batch 16,
AdamW lr 3e-3, weight decay 0.01, the same seed and batches):
- `fp8`: torchao's float8 training model (fp32 weights, float8 matmuls with tensorwise dynamic
  scales; `to_float8` in fp8_systems.py, lm_head left in fp32 as it is tied);
- `bf16`: the model in bf16 with fp32 master weights (Megatron's bf16 recipe; megabuf's
  distributed optimizer keeps those main params, the single-process run here keeps them itself);
- `fp32`: the plain model, for scale.
The gap is `fp8 loss - bf16 loss` at each step (global-batch loss); the report gives its largest
absolute value and its value at the last step. `LOSS_BAND` is the band the tests assert on the
first `BAND_STEPS` steps at dp 2 through megabuf, under every sharding strategy: twice the
largest gap measured on a single process over 300 steps for seeds 0, 1 and 2 (0.065, 0.071
and 0.057), rounded up to a multiple of 0.05 (docs/fp8-peers.md gives the curves' figures), so
that a working FP8 path passes with margin while one that does not train its float8 weights
(megabuf without its FP8 param kind: 1.02 behind bf16 after 30 steps) or casts them with a wrong
scale does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import megabuf
from megabuf.bench.fp8_systems import STRATEGY_SYSTEMS, to_float8, torchao_unavailable_reason
from megabuf.testing import PRESETS, GPTConfig, build_model, corpus_tokens, gpt_loss, lm_batches
from megabuf.testing.launch import spawn

PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp8")
MODEL = "gpt_tiny"
GLOBAL_BATCH = 16
LR = 3e-3
WEIGHT_DECAY = 0.01
LOSS_BAND = 0.15  # [Note: FP8 loss band]
BAND_STEPS = 30


def build_precision_model(precision: str, seed: int = 0) -> nn.Module:
    """The demo GPT in `precision` (one of PRECISIONS), before any wrapper."""
    if precision not in PRECISIONS:
        raise ValueError(f"megabuf.bench.fp8_curves: precision {precision!r} not in {PRECISIONS}")
    module = build_model(MODEL, seed=seed)
    if precision == "fp8":
        return to_float8(module)
    return module.to(torch.bfloat16) if precision == "bf16" else module


def _tokens(steps: int, seed: int) -> Tensor:
    cfg = PRESETS[MODEL]
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"megabuf.bench.fp8_curves: {MODEL} is not a GPT preset")
    return corpus_tokens(max(10_000, steps * GLOBAL_BATCH * cfg.seq_len + 1), cfg.vocab_size, seed)


def _batch(tokens: Tensor, step: int) -> tuple[Tensor, Tensor]:
    return lm_batches(tokens, GLOBAL_BATCH, PRESETS[MODEL].seq_len, step)  # type: ignore[union-attr]


def single_process_losses(precision: str, steps: int, seed: int = 0) -> list[float]:
    """Global-batch losses of `steps` AdamW steps on one process; bf16 steps fp32 masters."""
    module = build_precision_model(precision, seed)
    params = [p for p in module.parameters() if p.requires_grad]
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    half = precision == "bf16"
    opt = torch.optim.AdamW(masters if half else params, lr=LR, weight_decay=WEIGHT_DECAY,
                            foreach=False)  # fmt: skip
    tokens, losses = _tokens(steps, seed), []
    for step in range(steps):
        x, y = _batch(tokens, step)
        loss = gpt_loss(module(x), y)
        loss.backward()
        if half:
            for p, m in zip(params, masters, strict=True):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if half:
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
        losses.append(float(loss.detach()))
    return losses


@dataclass(frozen=True)
class MegabufCurve:
    """A run through megabuf: global-batch losses, and the param all-gather bytes per step its
    collective layer counted (ring figure, op "all_gather")."""

    losses: list[float]
    gather_ring_nbytes_per_step: int


def megabuf_curve(
    precision: str, strategy: str, steps: int, pgs: megabuf.ProcessGroups, seed: int = 0
) -> MegabufCurve:
    """`steps` steps through megabuf under sharding `strategy`, this rank training its slice of
    every global batch (megabuf's distributed optimizer, AdamW)."""
    if strategy not in STRATEGY_SYSTEMS:
        raise ValueError(f"megabuf.bench.fp8_curves: strategy {strategy!r} not in "
                         f"{list(STRATEGY_SYSTEMS)}")  # fmt: skip
    config = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, overlap_grad_reduce=True
    )
    model = megabuf.DistributedDataParallel(build_precision_model(precision, seed), config,
                                            process_groups=pgs)  # fmt: skip
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(  # bf16: fp32 main params
        optimizer="adamw", lr=LR, weight_decay=WEIGHT_DECAY, bf16=precision == "bf16"))  # fmt: skip
    local = GLOBAL_BATCH // pgs.dp_size
    lo, hi = pgs.dp_rank * local, (pgs.dp_rank + 1) * local
    tokens, losses = _tokens(steps, seed), []
    stats = model.engine.collectives.stats
    stats.reset()
    for step in range(steps):
        x, y = _batch(tokens, step)
        opt.zero_grad()
        loss = gpt_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        model.finish_grad_sync()
        opt.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total, group=pgs.dp)
        losses.append(float(total) / pgs.dp_size)
    return MegabufCurve(losses, stats.ring_nbytes.get("all_gather", 0) // steps)


def megabuf_losses(
    precision: str, strategy: str, steps: int, pgs: megabuf.ProcessGroups, seed: int = 0
) -> list[float]:
    """The losses of `megabuf_curve`."""
    return megabuf_curve(precision, strategy, steps, pgs, seed).losses


def gaps(fp8: Sequence[float], bf16: Sequence[float]) -> dict[str, float]:
    """The largest |fp8 - bf16| over the steps (and where), and the gap at the last step."""
    diffs = [a - b for a, b in zip(fp8, bf16, strict=True)]
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    return {"max_abs_gap": abs(diffs[worst]), "max_gap_step": worst, "final_gap": diffs[-1]}


def _ranks(args: argparse.Namespace) -> dict[str, list[float]]:
    pgs = megabuf.init_distributed(device="cpu")
    return {
        p: megabuf_losses(p, args.strategy, args.steps, pgs, args.seed) for p in args.precisions
    }


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megabuf.bench.fp8_curves", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", default="0", help="comma list of seeds (model init and corpus)")
    p.add_argument("--dp", type=int, default=0, help="0: one process; else ranks through megabuf")
    p.add_argument("--strategy", default="optim", choices=list(STRATEGY_SYSTEMS))
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--jsonl", default="bench-fp8-curves.jsonl", help="one line per curve")
    args = p.parse_args(list(argv))
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.precisions = [s.strip() for s in args.precisions.split(",") if s.strip()]
    if args.steps < 1 or args.dp < 0 or (args.dp and GLOBAL_BATCH % args.dp):
        p.error(f"need --steps >= 1 and --dp 0 or a divisor of the global batch {GLOBAL_BATCH}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    reason = torchao_unavailable_reason()
    if reason is not None:
        print(f"megabuf.bench.fp8_curves: cannot train in FP8 here: {reason}")
        return 1
    records: list[dict[str, Any]] = []
    for seed in args.seeds:
        start = time.perf_counter()
        if args.dp:
            args.seed = seed
            curves = spawn(_ranks, args.dp, args)[0]
        else:
            curves = {p: single_process_losses(p, args.steps, seed) for p in args.precisions}
        where = f"dp {args.dp} megabuf {args.strategy}" if args.dp else "one process"
        record = {"seed": seed, "steps": args.steps, "where": where, "curves": curves,
                  "seconds": time.perf_counter() - start}  # fmt: skip
        if "fp8" in curves and "bf16" in curves:
            record["fp8_vs_bf16"] = gaps(curves["fp8"], curves["bf16"])
            g = record["fp8_vs_bf16"]
            finals = ", ".join(f"{p} final {c[-1]:.4f}" for p, c in curves.items())
            print(f"seed {seed} ({where}, {args.steps} steps): fp8 - bf16 max |gap| "
                  f"{g['max_abs_gap']:.4f} at step {g['max_gap_step']}, final "
                  f"{g['final_gap']:+.4f}; {finals}")  # fmt: skip
        records.append(record)
    os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
    with open(args.jsonl, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.jsonl}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
