"""Rank side of the LR-scheduler tests: a megabuf optimizer (dense and expert domains) under a
torch scheduler, against a torch optimizer with as many param groups under the same one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import megabuf

STEPS = 6


def make_scheduler(kind: str, opt: Any) -> Any:
    sched = torch.optim.lr_scheduler
    if kind == "lambda":
        return sched.LambdaLR(opt, lambda step: 0.5**step)
    if kind == "cosine":
        return sched.CosineAnnealingLR(opt, T_max=4)
    if kind == "one_cycle":
        return sched.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS + 1)
    warmup = sched.LinearLR(opt, start_factor=0.1, total_iters=2)
    return sched.SequentialLR(opt, [warmup, sched.CosineAnnealingLR(opt, T_max=4)], [2])


def scheduled_lrs(kind: str, distributed: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    megabuf.mark_expert_parallel(net[1].parameters())  # a second (expert) domain, ep_size 1
    cfg = megabuf.DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    model = megabuf.DistributedDataParallel(net, cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw", lr=0.01))
    ref_opt = torch.optim.AdamW(
        [{"params": [nn.Parameter(torch.zeros(1))]} for _ in opt.param_groups], lr=0.01
    )
    scheduler, ref_scheduler = make_scheduler(kind, opt), make_scheduler(kind, ref_opt)
    lrs, ref_lrs = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        model.finish_grad_sync()
        opt.step()
        ref_opt.step()
        scheduler.step()
        ref_scheduler.step()
        lrs.append([g["lr"] for g in opt.param_groups])
        ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
    resumed = make_scheduler(kind, megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=0.01)))
    resumed.load_state_dict(scheduler.state_dict())
    return {
        "lrs": lrs,
        "ref_lrs": ref_lrs,
        "groups": len(opt.param_groups),
        "resumed_last_lr": resumed.get_last_lr(),
        "last_lr": scheduler.get_last_lr(),
    }


def amp_grad_scaler(bf16: bool) -> dict[str, Any]:
    """torch.amp.GradScaler.step(megabuf optimizer): a named error, params untouched."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2).to(torch.bfloat16 if bf16 else torch.float32)
    model = megabuf.DistributedDataParallel(
        net, megabuf.DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
    )
    opt = megabuf.build_optimizer(
        model, megabuf.OptimizerConfig(optimizer="sgd", lr=0.1, bf16=bf16)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = net.weight.detach().clone()
    opt.zero_grad()
    scaler.scale(model(torch.ones(3, 4, dtype=net.weight.dtype)).float().sum()).backward()
    model.finish_grad_sync()
    try:
        scaler.step(opt)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    return {"message": message, "unchanged": bool(torch.equal(before, net.weight))}
