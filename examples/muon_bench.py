"""Muon + AdamW: megabuf's whole-param owners vs the same optimizer replicated on every rank.

    python examples/muon_bench.py --dp 2 --repeats 3 --steps 3      # gloo ranks on CPU

Systems, interleaved in every repeat (same model, data and optimizer hyperparameters):
- `torch DDP + Muon replicated`: torch's DistributedDataParallel, `torch.optim.Muon` on the 2-D
  weights and `torch.optim.AdamW` on the rest, every rank stepping every param;
- `megabuf owners (optim)`, `megabuf owners (optim_grads)`: `whole_param_owners=True`,
  `OptimizerConfig(optimizer="muon")`: each rank steps only the params it owns.
Printed per system: median step ms (the slowest rank per step), x torch, optimizer state MiB on
the most loaded rank (measured: the optimizer's state tensors and, for megabuf, fp32 main params
that are copies), grad+param buffer MiB per rank (megabuf; torch DDP: its grads + buckets), and
for megabuf the owner balance (max/mean cost, [Note: whole-param owners]) and the buffers'
padding. Step time on shared CPU cores is noisy: compare ratios within one run.
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

if importlib.util.find_spec("megabuf") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.optimizer import OptimizerConfig, build_optimizer
from megabuf.testing import build_model, loss_fn, make_batch, spawn

MIB = 2**20
SYSTEMS = ("torch DDP + Muon replicated", "megabuf owners (optim)", "megabuf owners (optim_grads)")


def _state_nbytes(opts: list[torch.optim.Optimizer]) -> int:
    seen: set[int] = set()
    total = 0
    for opt in opts:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                    seen.add(v.data_ptr())
                    total += v.numel() * v.element_size()
    return total


def _torch_system(args: Any) -> tuple[nn.Module, Any, int, dict[str, float]]:
    net = build_model(args.model)
    model = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
    embeds = {id(m.weight) for m in net.modules() if isinstance(m, nn.Embedding)}
    if isinstance(getattr(net, "lm_head", None), nn.Linear):  # the output head: AdamW, as megabuf
        embeds.add(id(net.lm_head.weight))
    params = list(net.parameters())
    muon = [p for p in params if p.dim() == 2 and id(p) not in embeds]
    adam = [p for p in params if not (p.dim() == 2 and id(p) not in embeds)]
    opts = [torch.optim.Muon(muon, lr=0.02, weight_decay=0.1),
            torch.optim.AdamW(adam, lr=3e-4, weight_decay=0.1)]  # fmt: skip

    def step() -> None:
        for o in opts:
            o.step()

    # params + grads (bucket views of DDP's buckets), fp32
    return model, (opts, step), sum(p.numel() * 8 for p in params), {}


def _megabuf_system(args: Any, strategy: str) -> tuple[nn.Module, Any, int, dict[str, float]]:
    net = build_model(args.model)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, whole_param_owners=True,
        overlap_grad_reduce=True, bucket_size=args.bucket_size,
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(net, cfg)
    opt = build_optimizer(model, OptimizerConfig(optimizer="muon", lr=3e-4, muon_lr=0.02,
                                                 weight_decay=0.1))  # fmt: skip

    def step() -> None:
        model.finish_grad_sync()
        opt.step()

    plan = model.engine.plan
    balance = plan.owner_balance[0].max_over_mean
    numel = sum(b.layout.numel for b in plan.buffers)
    payload = sum(b.layout.numel_unpadded for b in plan.buffers)
    report = opt.memory_report()
    buffers = report.param_buffer_nbytes + report.grad_buffer_nbytes
    extra = {"balance": balance, "padding": numel / payload - 1.0}
    return model, ([d.optimizer for d in opt.domains], step, opt), buffers, extra


def _run(args: Any) -> dict[str, Any]:
    megabuf.init_distributed()
    rank, dp = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {s: {"ms": []} for s in SYSTEMS}
    for _ in range(args.repeats):
        for name in SYSTEMS:
            strategy = "optim_grads" if "optim_grads" in name else "optim"
            torch.manual_seed(0)
            model, (opts, step, *keep), buffers, extra = (
                _torch_system(args) if name.startswith("torch") else _megabuf_system(args, strategy)
            )
            for i in range(args.warmup + args.steps):
                x, y = make_batch(args.model, args.batch * dp, seed=i)
                mine = slice(rank * args.batch, (rank + 1) * args.batch)
                if keep:
                    keep[0].zero_grad()  # megabuf: the grad buffers
                else:
                    model.zero_grad(set_to_none=False)
                dist.barrier()
                t0 = time.perf_counter()
                loss_fn(args.model)(model(x[mine]), y[mine]).backward()
                step()
                ms = torch.tensor([(time.perf_counter() - t0) * 1e3])
                dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                if i >= args.warmup:
                    out[name]["ms"].append(float(ms))
            state = torch.tensor([float(_state_nbytes(opts))])
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            out[name].update(state_mib=float(state) / MIB, buffers_mib=buffers / MIB, **extra)
            del model, opts, keep
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-size", type=int, default=4_000_000)
    args = parser.parse_args()
    res = spawn(_run, args.dp, args)[0]
    base = statistics.median(res[SYSTEMS[0]]["ms"])
    print(f"{args.model}, dp {args.dp}, {args.batch} seq/rank, {args.repeats} interleaved repeats "
          f"x {args.steps} steps")  # fmt: skip
    print("| system | step ms (median) | x torch | opt state MiB (max rank) | buffers MiB/rank | "
          "balance max/mean | padding |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in SYSTEMS:
        r = res[name]
        ms = statistics.median(r["ms"])
        bal = f"{r['balance']:.2f}" if "balance" in r else ""
        pad = f"{100 * r['padding']:.1f} %" if "padding" in r else ""
        print(f"| {name} | {ms:.0f} | {ms / base:.2f} | {r['state_mib']:.1f} | "
              f"{r['buffers_mib']:.1f} | {bal} | {pad} |")  # fmt: skip


if __name__ == "__main__":
    main()
