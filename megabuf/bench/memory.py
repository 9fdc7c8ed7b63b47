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

# [Note: model-state formula]
# The benchmark trains fp32 params with AdamW, so per param: 4 B param, 4 B grad, 8 B moments.
# What each system keeps of those (sharded ones divided by dp), not counting activations, the
# caching allocator's slack, padding or FSDP2's unsharded params while a unit computes; peak
# CUDA memory minus this is roughly the activations and workspace:
#   no_comm, torch_ddp_gabv, megabuf_ar_*: 4 + 4 + 8 = 16 (grads in the buckets / main_grad)
#   torch_ddp: 20 (grads also copied into DDP's buckets: gradient_as_bucket_view=False)
#   zero_ddp: 4 + 4 + 4 (DDP buckets) + 8/dp (ZeroRedundancyOptimizer shards the moments)
#   fsdp2_*: 16/dp (params, grads and moments sharded)
#   megabuf_distopt_*: 4 + 4 + 8/dp (fp32 params are stepped in place: no main copy)
#   megabuf_zero3*: 16/dp (param shards, grad shards, moments; plus the transient units)
#   megabuf_zero2: 4 + 4/dp + 8/dp (grads kept as reduced shards; plus the transient buckets)
FP32_PARAM, FP32_GRAD, ADAM_MOMENTS = 4.0, 4.0, 8.0


def state_bytes_per_param(system: str, dp_size: int) -> float:
    """Model-state bytes per param one rank holds for benchmark `system` at `dp_size`; see
    [Note: model-state formula]."""
    if dp_size < 1:
        raise ValueError(f"megabuf.bench: dp_size must be >= 1, got {dp_size}")
    full = FP32_PARAM + FP32_GRAD + ADAM_MOMENTS
    if system == "torch_ddp":
        return full + FP32_GRAD
    if system == "zero_ddp":
        return FP32_PARAM + 2 * FP32_GRAD + ADAM_MOMENTS / dp_size
    if system.startswith("fsdp2_"):
        return full / dp_size
    if system.startswith("megabuf_zero3"):
        return full / dp_size
    if system.startswith("megabuf_distopt_"):
        return FP32_PARAM + FP32_GRAD + ADAM_MOMENTS / dp_size
    if system == "megabuf_zero2":
        return FP32_PARAM + (FP32_GRAD + ADAM_MOMENTS) / dp_size
    if system in ("no_comm", "torch_ddp_gabv") or system.startswith("megabuf_ar_"):
        return full
    raise ValueError(f"megabuf.bench: no memory formula for system {system!r}")


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
