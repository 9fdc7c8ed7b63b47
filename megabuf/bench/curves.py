"""Loss curves of the demo GPT with and without communication hooks, megabuf vs torch DDP.

    python -m megabuf.bench.curves --steps 300 --out docs/bench/hook-loss-curves.png
    make bench-curves

Spawns `--world-size` gloo ranks (default 2) that train examples/train_gpt.py's model (`--model`,
default gpt_tiny) on its corpus, from the same seed and on the same global batches, once per
variant: megabuf (`megabuf_ar_overlap`) with no hook, Compress(bf16), PowerSGD r=1 and r=4, and
torch DDP (`torch_ddp_gabv`) with no hook, torch's bf16_compress_hook and powerSGD_hook r=1/4
(the specs of megabuf/bench/hooks.py; PowerSGD compresses from step `POWERSGD_START` on in both).
AdamW (lr `--lr`, weight decay 0.01). The global-batch loss of every step goes to JSON lines
(`--jsonl`, one line per curve), then to a PNG if matplotlib is installed (else the command that
renders it is printed). A megabuf variant whose hook `megabuf.comm_hooks.build` does not know is
skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import megabuf
from megabuf.bench.hooks import (
    HOOK_VARIANTS,
    MEGABUF_BASE,
    POWERSGD_START,
    TORCH_BASE,
    register_torch_hook,
    torch_bucket_cap_mb,
    unavailable_reason,
)
from megabuf.bench.plot import matplotlib_available
from megabuf.testing import PRESETS, GPTConfig, build_model, corpus_tokens, gpt_loss, lm_batches
from megabuf.testing.launch import spawn

HOOKS = ("bf16", "powersgd_r1", "powersgd_r4")
VARIANTS: tuple[str, ...] = (
    MEGABUF_BASE,
    *(f"{MEGABUF_BASE}+{h}" for h in HOOKS),
    TORCH_BASE,
    *(f"{TORCH_BASE}+{h}" for h in HOOKS),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megabuf.bench.curves", description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", choices=["gpt_tiny", "gpt_small"], default="gpt_tiny")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma list of megabuf_ar_overlap / torch_ddp_gabv [+hook] (megabuf/bench/hooks.py)",
    )
    p.add_argument("--jsonl", default="bench-curves.jsonl", help="losses, one line per curve")
    p.add_argument("--out", default="bench-curves.png", help="the PNG")
    args = p.parse_args(list(argv))
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = {MEGABUF_BASE, TORCH_BASE, *HOOK_VARIANTS}
    unknown = [v for v in args.variants if v not in known]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {sorted(known)}")
    if args.steps < 1 or args.global_batch % args.world_size:
        p.error("need --steps >= 1 and --global-batch divisible by --world-size")
    return args


def _engine(name: str, module: torch.nn.Module, pgs: megabuf.ProcessGroups) -> Any:
    """The model to train for variant `name`: megabuf or torch DDP, with its hook."""
    base, _, _ = name.partition("+")
    variant = HOOK_VARIANTS.get(name)
    if base == MEGABUF_BASE:
        cfg = megabuf.DistributedDataParallelConfig(
            overlap_grad_reduce=True, comm_hook=variant.spec if variant is not None else None
        )
        return megabuf.DistributedDataParallel(module, cfg, process_groups=pgs)
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    model = TorchDDP(
        module,
        process_group=pgs.dp,
        gradient_as_bucket_view=True,
        bucket_cap_mb=torch_bucket_cap_mb(variant.spec) if variant is not None else None,
    )
    if variant is not None:
        register_torch_hook(model, variant.spec, pgs.dp)
    return model


def train_curve(args: argparse.Namespace, name: str, pgs: megabuf.ProcessGroups) -> dict[str, Any]:
    """Train variant `name` for `args.steps` steps on this rank; the global-batch losses."""
    cfg = PRESETS[args.model]
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"megabuf.bench.curves: {args.model} is not a GPT preset")
    tokens = corpus_tokens(max(10_000, args.steps * args.global_batch * cfg.seq_len + 1),
                           cfg.vocab_size, seed=args.seed)  # fmt: skip
    local = args.global_batch // pgs.dp_size
    lo, hi = pgs.dp_rank * local, (pgs.dp_rank + 1) * local
    model = _engine(name, build_model(args.model, seed=args.seed), pgs)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    losses, seconds = [], 0.0
    for step in range(args.steps):
        x, y = lm_batches(tokens, args.global_batch, cfg.seq_len, step)
        start = time.perf_counter()
        if isinstance(model, megabuf.DistributedDataParallel):
            model.zero_grad_buffer()
        else:
            opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model(x[lo:hi]), y[lo:hi])
        loss.backward()
        if isinstance(model, megabuf.DistributedDataParallel):
            model.finish_grad_sync()
        opt.step()
        seconds += time.perf_counter() - start if step else 0.0  # step 0: one-off costs
        total = loss.detach().clone()
        dist.all_reduce(total, group=pgs.dp)
        losses.append(total.item() / pgs.dp_size)
    out: dict[str, Any] = {"losses": losses, "ms_per_step": 1e3 * seconds / max(1, args.steps - 1)}
    if isinstance(model, megabuf.DistributedDataParallel):
        report = model.engine.hooks.comm_hook_report()
        out["hook_wire_bytes_per_step"] = report.ring_nbytes_per_step if report.buckets else None
    return out


def run_ranks(args: argparse.Namespace, names: list[str]) -> list[dict[str, Any]]:
    """Rank entry point: every variant in turn, in the same processes."""
    pgs = megabuf.init_distributed(device="cpu")
    results = []
    for name in names:
        result = train_curve(args, name, pgs)
        if dist.get_rank() == 0:
            print(f"  {name}: loss {result['losses'][0]:.3f} -> {result['losses'][-1]:.3f}, "
                  f"{result['ms_per_step']:.1f} ms/step", flush=True)  # fmt: skip
        results.append(result)
    return results


def curve_record(name: str, result: dict[str, Any]) -> dict[str, Any]:
    base, _, hook = name.partition("+")
    engine = "megabuf" if base == MEGABUF_BASE else "torch"
    return {"kind": "curve", "variant": name, "engine": engine, "hook": hook or "none",
            "spec": HOOK_VARIANTS[name].spec if name in HOOK_VARIANTS else None,
            **result}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    names = []
    for name in args.variants:
        reason = unavailable_reason(name) if name in HOOK_VARIANTS else None
        if reason is None:
            names.append(name)
        else:
            print(f"megabuf.bench.curves: skipping {name}: {reason}")
    print(f"{len(names)} curves x {args.steps} steps of {args.model}, dp={args.world_size} gloo")
    started = time.perf_counter()
    results = spawn(run_ranks, args.world_size, args, names)[0]
    title = (f"{args.model}, dp={args.world_size} (gloo), global batch {args.global_batch}, "
             f"AdamW lr {args.lr}; PowerSGD from step {POWERSGD_START}")  # fmt: skip
    header = {"kind": "run", "title": title, "argv": sys.argv, "options": vars(args),
              "torch": torch.__version__, "seconds": time.perf_counter() - started}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
    with open(args.jsonl, "w") as f:
        f.write(json.dumps(header) + "\n")
        for name, result in zip(names, results, strict=True):
            f.write(json.dumps(curve_record(name, result)) + "\n")
    print(f"wrote {args.jsonl} ({header['seconds']:.0f} s)")
    if matplotlib_available():
        from megabuf.bench.curves_plot import plot_curves

        plot_curves(args.jsonl, args.out)
        print(f"wrote {args.out}")
    else:
        print("matplotlib is not installed (pip install 'megabuf[plot]'); render the PNG with "
              f"a Python that has it: python megabuf/bench/curves_plot.py {args.jsonl} "
              f"{args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
