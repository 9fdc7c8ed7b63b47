"""Host time of megabuf's hot path, for an A/B of two checkouts (BENCHMARKS.md, issue 25).

One process, gloo at world size 1: a model of 1000 small Linear modules (2000 params), first
plain, then wrapped with the distributed optimizer, overlap_grad_reduce and
overlap_param_gather, and the medians of 12 timed forwards and backwards (after 3 warm-up
steps) of each. Prints one JSON line: the extra backward host time per param grad hook and
the extra forward host time per module. Run each checkout alternately:

    PYTHONPATH=<checkout> python examples/hotpath_ab.py LABEL PORT
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

N_MODULES = 1000


class Many(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(N_MODULES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def timed(model: nn.Module, steps: int, opt: object | None = None) -> tuple[float, float]:
    x = torch.randn(4, 8)
    forward, backward = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        forward.append(t1 - t0)
        backward.append(t2 - t1)
        if opt is not None:
            opt.step()  # type: ignore[attr-defined]
            opt.zero_grad()  # type: ignore[attr-defined]
        else:
            for p in model.parameters():
                p.grad = None
    return statistics.median(forward[3:]), statistics.median(backward[3:])


def main(label: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    import megabuf

    torch.manual_seed(0)
    f0, b0 = timed(Many(), 15)
    cfg = megabuf.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        bucket_size=2000,
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(Many(), cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="sgd", lr=1e-3))
    f1, b1 = timed(model, 15, opt)
    print(json.dumps({
        "label": label, "forward_plain_ms": f0 * 1e3, "forward_ms": f1 * 1e3,
        "backward_plain_ms": b0 * 1e3, "backward_ms": b1 * 1e3,
        "us_per_grad_hook": (b1 - b0) / (2 * N_MODULES) * 1e6,
        "us_per_forward_module": (f1 - f0) / N_MODULES * 1e6,
    }))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "29511")
