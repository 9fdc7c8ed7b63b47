"""Per-rank memory per parameter for every sharding strategy megabuf implements.

`python -m megabuf.bench.memory [--model gpt_small] [--dp 1,2,4]` builds the model with bf16
params, fp32 grads (`grad_reduce_in_fp32`) and AdamW on dp CPU ranks under each strategy in
`SHARDING_STRATEGIES`, takes one step (so the optimizer state exists), and prints the
persistent bytes rank 0 holds per model parameter, from `memory_report` (allocated tensors,
padding included), next to the exact formula from the padded layout ([Note: memory formula])
and the textbook figures of the design notes: 18 (no_shard: 2 param + 4 grad + 4 fp32 main
param + 8 Adam moments), 6 + 12/dp (optim), 2 + 16/dp (optim_grads), 18/dp
(optim_grads_params); and whether an independent walk over unique storages equals the report.
On gloo the sharded strategies also keep a reduce-scatter scratch (shown apart).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist

import megabuf
from megabuf.config import SHARDING_STRATEGIES
from megabuf.sharding.formula import (
    DEVICE_CATEGORIES,
    optimizer_spec,
    persistent_bytes,
    textbook,
)
from megabuf.sharding.walk import storage_walk, unique_storage_nbytes
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
#   megabuf_zero2*: 4 + (4 + 8)/dp (grads sharded too); megabuf_zero3*: 16/dp (as FSDP2)
# The exact figure of a megabuf system (padding, Adam's `step` scalars, gloo's reduce-scatter
# scratch) is `persistent_formula_nbytes` ([Note: memory formula]); `measured_persistent_nbytes`
# counts what each system really holds ([Note: measured model state]).
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
    if system.startswith(("megabuf_distopt_", "mcore_distopt_")):
        return FP32_PARAM + FP32_GRAD + ADAM_MOMENTS / dp_size
    if system.startswith("megabuf_zero2"):
        return FP32_PARAM + (FP32_GRAD + ADAM_MOMENTS) / dp_size
    if system.startswith("megabuf_zero3"):
        return full / dp_size
    if system in ("no_comm", "torch_ddp_gabv") or system.startswith(("megabuf_ar_", "mcore_ddp_")):
        return full
    raise ValueError(f"megabuf.bench: no memory formula for system {system!r}")


# [Note: measured model state]
# What one rank of a benchmarked system holds for params, grads and optimizer state, counted
# the same way for every system, by `storage_walk` ([Note: storage walk]): unique storages of
# the params (a DTensor's local shard), their `main_grad` and `.grad`, megabuf's grad buffers,
# scratch and main params, and every tensor of the optimizer's state (a
# ZeroRedundancyOptimizer's local optimizer's).
# Buffers a wrapper keeps elsewhere (torch DDP's own buckets, FSDP2's unsharded params between
# uses) are not reachable this way and not counted; module buffers are left out everywhere.


def measured_persistent_nbytes(engine: Any) -> int:
    """Bytes of model state this rank holds for `engine` (a bench `Engine`); see [Note:
    measured model state]."""
    walked = storage_walk(engine.ddp if engine.ddp is not None else engine.inner, engine.optimizer)
    buffers = unique_storage_nbytes(engine.inner.buffers())
    return sum(walked.values()) - sum(buffers.values())


def formula_is_exact(engine: Any) -> bool:
    """True for systems `persistent_formula_nbytes` knows exactly: megabuf with its own
    optimizer. The others get the textbook figure (no padding, no `step` scalars, buffers the
    walk cannot reach)."""
    return engine.ddp is not None and hasattr(engine.optimizer, "domains")


def persistent_formula_nbytes(engine: Any, system: str, dp_size: int, n_params: int) -> int:
    """This rank's model state by formula: exact for a megabuf system with megabuf's optimizer
    ([Note: memory formula]), the textbook figure times the params for the others."""
    model = engine.ddp
    if model is None or not formula_is_exact(engine):
        return int(n_params * state_bytes_per_param(system, dp_size))
    pgs, device = model.process_groups, next(model.parameters()).device
    scratch = model.engine.collectives.strategy(pgs.dp, device).reduce_scatter == "all_to_all"
    figures = persistent_bytes(
        model.engine.plan, model.ddp_config.sharding.name,
        optimizer_spec(engine.optimizer.domains[0].optimizer), dp_rank=pgs.dp_rank,
        expt_dp_rank=dist.get_rank(pgs.expt_dp), reduce_scatter_scratch=scratch,
        cpu_offload=bool(model.ddp_config.cpu_offload) and device.type != "cpu",
    )  # fmt: skip
    return sum(figures.values())


def _measure(model_name: str, strategy: str) -> dict[str, Any]:
    pgs = megabuf.init_distributed()
    ddp_cfg = megabuf.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, data_parallel_sharding_strategy=strategy
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
    figures = persistent_bytes(
        model.engine.plan, strategy, optimizer_spec(opt.domains[0].optimizer), dp_rank=pgs.dp_rank,
        reduce_scatter_scratch=bool(report.persistent["comm_scratch"]),
    )  # fmt: skip
    walked = sum(storage_walk(model, opt).values())
    return {
        "n_params": n_params,
        "bytes_per_param": report.total_nbytes / n_params,
        # the formula's categories: frozen params and module buffers are not model state
        "persistent_bytes_per_param": sum(report.persistent[c] for c in DEVICE_CATEGORIES)
        / n_params,
        "formula_bytes_per_param": sum(figures.values()) / n_params,
        "walk_equals_report": walked
        == report.persistent_nbytes + report.host_nbytes + report.transient_now_nbytes,
        "optimizer_bytes_per_param": report.optimizer_nbytes / n_params,
        "padding_numel": report.padding_numel,
        "scratch_bytes_per_param": report.persistent["comm_scratch"] / n_params,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--dp", default="1,2,4", help="comma list of data-parallel sizes")
    args = parser.parse_args(argv)
    print(f"{args.model}: bf16 params, fp32 grads, AdamW; bytes per model parameter, rank 0")
    print("| strategy | dp | measured B/param | exact formula | textbook | walk = report | "
          "optimizer B/param | gloo RS scratch B/param | padding |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for dp in (int(d) for d in args.dp.split(",")):
        for strategy in SHARDING_STRATEGIES:
            res = spawn(_measure, dp, args.model, strategy)[0]
            book = textbook(strategy, dp if strategy != "no_shard" else 1)
            print(
                f"| {strategy} | {dp} | {res['persistent_bytes_per_param']:.3f} | "
                f"{res['formula_bytes_per_param']:.3f} | {book:.3f} | "
                f"{'yes' if res['walk_equals_report'] else 'NO'} | "
                f"{res['optimizer_bytes_per_param']:.3f} | "
                f"{res['scratch_bytes_per_param']:.3f} | {res['padding_numel']} elements |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
