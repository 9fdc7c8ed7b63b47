"""Per-rank memory per parameter: plain data parallelism vs the distributed optimizer.

`python -m megabuf.bench.memory [--model gpt_small] [--dp 1,2,4]` builds the model with bf16
params, fp32 grads (`grad_reduce_in_fp32`) and AdamW on dp CPU ranks, takes one step (so the
optimizer state exists), and prints the exact bytes each rank holds per model parameter, from
`memory_report` (allocated tensors, padding included), next to the textbook figures: 18 bytes for
plain data parallelism (2 param + 4 grad + 4 fp32 main param + 8 Adam moments) and 6 + 12/dp for
a ZeRO-1 distributed optimizer.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import megabuf
from megabuf.testing.launch import spawn
from megabuf.testing.models import build_model, loss_fn, make_batch


def _measure(model_name: str, distributed: bool) -> dict[str, Any]:
    pgs = megabuf.init_distributed()
    ddp_cfg = megabuf.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
    )
    model = megabuf.DistributedDataParallel(
        build_model(model_name, seed=0, dtype=torch.bfloat16), ddp_cfg, process_groups=pgs
    )
    opt = megabuf.build_optimizer(
        model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-4, bf16=True)
    )
    x, y = make_batch(model_name, 2, seed=pgs.dp_rank)
    opt.zero_grad()
    loss_fn(model_name)(model(x), y).backward()
    model.finish_grad_sync()
    opt.step()
    report = opt.memory_report()
    n_params = sum(p.numel() for p in model.module.parameters())
    return {
        "n_params": n_params,
        "bytes_per_param": report.total_nbytes / n_params,
        "optimizer_bytes_per_param": report.optimizer_nbytes / n_params,
        "padding_numel": report.padding_numel,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--dp", default="1,2,4", help="comma list of data-parallel sizes")
    args = parser.parse_args(argv)
    print(f"{args.model}: bf16 params, fp32 grads, AdamW; bytes per model parameter, rank 0")
    print("| system | dp | measured B/param | theory B/param | optimizer B/param | padding |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dp in (int(d) for d in args.dp.split(",")):
        for distributed, theory in ((False, 18.0), (True, 6 + 12 / dp)):
            res = spawn(_measure, dp, args.model, distributed)[0]
            name = "distributed optimizer" if distributed else "plain DP (mixed precision)"
            print(
                f"| {name} | {dp} | {res['bytes_per_param']:.3f} | {theory:.3f} | "
                f"{res['optimizer_bytes_per_param']:.3f} | {res['padding_numel']} elements |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
