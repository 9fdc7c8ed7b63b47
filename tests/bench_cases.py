"""Rank-side code for the byte-counter, timeline and inspector-vs-DDP tests (DistPool workers).

`KnownNet` has params of 100, 37, 64 and 5 elements (registration order), so layouts are easy
to work out by hand; see the expected figures in test_bench.py and test_inspect.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf
from megabuf.pure.overlap import analyze
from megabuf.transport.collectives import Collectives

NUMELS = (100, 37, 64, 5)
STEPS = 3


class KnownNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.p0 = nn.Parameter(torch.randn(10, 10, generator=gen))
        self.p1 = nn.Parameter(torch.randn(37, generator=gen))
        self.p2 = nn.Parameter(torch.randn(8, 8, generator=gen))
        self.p3 = nn.Parameter(torch.randn(5, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = sum((p.tanh() ** 2).sum() for p in (self.p0, self.p1, self.p2, self.p3))
        return x.mean() * total


def _step(model: megabuf.DistributedDataParallel, sharded: bool) -> None:
    model.zero_grad_buffer()
    model(torch.ones(4)).backward()
    model.finish_grad_sync()
    if sharded:  # what an optimizer does after updating its shard: gather the others
        for group in model.engine.all_bucket_groups:
            group.mark_params_stale()
        model.start_param_sync()


def count_bytes(values: dict[str, Any]) -> dict[str, Any]:
    """One config: bytes and calls per op over STEPS steps, and overlap figures."""
    config = megabuf.DistributedDataParallelConfig(**values)
    model = megabuf.DistributedDataParallel(KnownNet(), config)
    model.engine.collectives.stats.reset()  # drop the start-up broadcasts
    timeline = model.enable_timeline()
    for _ in range(STEPS):
        _step(model, config.use_distributed_optimizer)
    stats = model.engine.collectives.stats
    report = analyze(timeline.events)
    return {
        "input": dict(stats.input_nbytes),
        "output": dict(stats.output_nbytes),
        "ring": dict(stats.ring_nbytes),
        "calls": dict(stats.calls),
        "steps": len(report.steps),
        "groups": [len(s.groups) for s in report.steps],
        "early": [s.dispatched_before_backward_end for s in report.steps],
        "exposed": [s.exposed_s for s in report.steps],
    }


def wrapper_bytes() -> dict[str, dict[str, tuple[int, int, int, int]]]:
    """Each `Collectives` wrapper once on small tensors of known sizes (see test_bench.py for
    the figures by hand): per op (input, output, ring bytes, calls) on this rank."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    coll, coll_max = Collectives(), Collectives()
    coll.all_reduce(torch.ones(10), None, async_op=False)  # 40 B fp32
    coll.all_reduce(torch.ones(6, dtype=torch.bfloat16), None, async_op=False)  # 12 B
    coll.reduce_scatter(torch.empty(3), torch.ones(3 * dp), None, async_op=False)
    coll.all_gather(torch.empty(5 * dp), torch.ones(5), None, async_op=False)
    rows = torch.ones(2 * dp, 3, dtype=torch.float64)
    coll.all_to_all(torch.empty_like(rows), rows, None, async_op=False)
    coll.broadcast(torch.ones(7), 0, None)  # 28 B from rank 0
    if rank == 0:
        coll.send(torch.ones(9, dtype=torch.int64), 1, None, tag=3).wait()  # 72 B
    elif rank == 1:
        coll.recv(torch.empty(9, dtype=torch.int64), 0, None, tag=3).wait()
    coll.barrier(None)
    coll_max.all_reduce_max(torch.zeros(2), None)  # 8 B
    out = {}
    for name, c in (("", coll), ("max_", coll_max)):
        s = c.stats
        for op, calls in s.calls.items():
            out[name + op] = (s.input_nbytes[op], s.output_nbytes[op], s.ring_nbytes[op], calls)
    return out


def ddp_layouts(model_name: str, configs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a real DistributedDataParallel built: per buffer (numel, buckets as (start, end,
    param names)), and bucket groups in dispatch order as (buffer index, bucket id)."""
    from megabuf.testing import build_model

    out = {}
    for name, values in configs.items():
        module = build_model(model_name, seed=0)
        model = megabuf.DistributedDataParallel(
            module, megabuf.DistributedDataParallelConfig(**values)
        )
        names = {p: n for n, p in module.named_parameters()}
        buffers = []
        bucket_of: dict[int, tuple[int, int]] = {}
        for i, buf in enumerate(model.buffers):
            buckets = []
            for b in buf.buckets:
                bucket_of[id(b)] = (i, b.bucket_id)
                names_in = [names[p] for p in b.params_list]
                buckets.append((b.offset, b.offset + b.numel, names_in))
            buffers.append((buf.numel, buckets))
        order = [
            bucket_of[id(g.buckets[0])] for chain in model.engine.sync.chains for g in chain.groups
        ]
        out[name] = {"buffers": buffers, "order": order}
    return out


def memory_figures(bf16: bool) -> dict[str, int]:
    """KnownNet with the distributed optimizer (bucket_size 100, AdamW) after one step: this
    rank's `memory_report()` (figures by hand in test_oracles.py)."""
    module = KnownNet().to(torch.bfloat16) if bf16 else KnownNet()
    config = megabuf.DistributedDataParallelConfig(
        use_distributed_optimizer=True, bucket_size=100, grad_reduce_in_fp32=bf16
    )
    model = megabuf.DistributedDataParallel(module, config)
    opt = megabuf.build_optimizer(
        model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-3, bf16=bf16)
    )
    opt.zero_grad()
    model(torch.ones(4)).backward()
    model.finish_grad_sync()
    opt.step()
    report = opt.memory_report()
    return {
        "owned_numel": report.owned_numel,
        "shard_numel": report.shard_numel,
        "main_param_nbytes": report.main_param_nbytes,
        "state_nbytes": report.state_nbytes,
        "param_buffer_nbytes": report.param_buffer_nbytes,
        "grad_buffer_nbytes": report.grad_buffer_nbytes,
    }
