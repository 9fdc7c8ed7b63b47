"""GPU tier: the memory planner's predicted peak against CUDA's measured one ([Note: planner
proof after the first step] in megabuf/training/budget.py). Skipped without a CUDA device.

A 134M-param fp32 MLP (8 Linear(4096, 4096)) on one GPU, SGD without momentum (torch's foreach
step allocates no temporaries, which the planner does not model), activations measured by one
warm-up step: `check_peak` after the first real step compares `torch.cuda.max_memory_allocated`
(reset after construction) with the planner's device total for the chosen configuration, and
must be within the 10 % margin. Not yet run on a GPU (none on this machine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import megabuf
from megabuf.testing import spawn
from megabuf.training.budget import check_peak

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs CUDA (no CUDA device on this machine)"),
]


def _peak_run() -> dict[str, Any]:
    pgs = megabuf.init_distributed(device="cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    module = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(8)]).to(device)
    x = torch.randn(64, 4096, device=device)

    def step(m: nn.Module) -> None:
        m(x).square().mean().backward()

    opt_cfg = megabuf.OptimizerConfig(optimizer="sgd", sgd_momentum=0.0, lr=1e-3)
    choice = megabuf.plan_for_budget(
        module, 100 * 2**30, optimizer=opt_cfg, process_groups=pgs, step_fn=step, gloo=False
    )
    model = megabuf.DistributedDataParallel(module, choice.config, process_groups=pgs)
    opt = megabuf.build_optimizer(model, choice.optimizer_config)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    opt.zero_grad()
    step(model)
    opt.step()
    torch.cuda.synchronize()
    check = check_peak(choice, model, opt)
    return {
        "predicted": check.predicted_nbytes,
        "measured": check.measured_nbytes,
        "within": check.within_margin,
        "source": check.source,
        "candidate": choice.chosen.candidate.describe() if choice.chosen else None,
    }


def test_predicted_peak_within_margin_on_cuda() -> None:
    for rank, res in enumerate(spawn(_peak_run, 1, timeout_s=300)):
        assert res["source"] == "cuda max_memory_allocated", res
        assert res["within"], (rank, res)
