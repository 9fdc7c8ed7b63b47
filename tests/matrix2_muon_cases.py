"""Rank-side code for tests/test_matrix2.py's whole-param owner cases (issue 46; 4 gloo
ranks, in the same pool run as matrix2_cases.py): MuonAdamW with per-group settings that differ
between groups and from the constructor's (lr, weight decay, Muon momentum / nesterov, AdamW
betas / eps), also with fp16 params and a DynamicGradScaler, at ep 2 and at pp 2, each against
torch.optim.Muon + torch.optim.AdamW given the same groups in one process.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import matrix_cases
import muon_cases
import torch
import torch.distributed as dist
from matrix2_cases import FP16_SCALE, STEPS, _model_step, counted_turns
from moe_cases import CFG

import megabuf
from megabuf.comm_hooks import Reduce
from megabuf.optimizer import MuonAdamW
from megabuf.optimizer.grad_scaler import DynamicGradScaler
from megabuf.testing.moe import MoEModel, moe_batch

# ---- MuonAdamW with per-group settings ---------------------------------------------------------
CTOR = {"lr": muon_cases.LR, "weight_decay": 0.1}


def _muon_groups(named: dict[str, Any]) -> list[dict[str, Any]]:
    """Four groups, each with settings of its own that differ from CTOR's; the last takes the
    constructor's."""
    rest = [n for n in named if n not in ("up.weight", "down.weight", "mix.weight", "embed.weight")]
    return [
        {"params": [named["up.weight"], named["down.weight"]], "use_muon": True,
         "lr": muon_cases.MUON_LR, "weight_decay": 0.05, "momentum": 0.8},
        {"params": [named["mix.weight"]], "use_muon": True, "lr": 0.03, "weight_decay": 0.0,
         "nesterov": False},
        {"params": [named["embed.weight"]], "use_muon": False, "lr": 5e-3, "weight_decay": 0.2,
         "betas": (0.8, 0.95)},
        {"params": [named[n] for n in rest], "use_muon": False, "eps": 1e-6},
    ]  # fmt: skip


def _torch_groups(groups: list[dict[str, Any]], muon: bool) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in g.items() if k != "use_muon"} for g in groups if g["use_muon"] == muon
    ]


class GroupsReference(muon_cases.Reference):
    """muon_cases' reference with _muon_groups' settings given to torch's optimizers."""

    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__(case)
        if case.get("fp16"):  # fp16 params; the masters start from their fp16 values
            self.model.to(torch.float16)
            self.masters = [p.detach().float().clone() for p in self.params]
        named = [n for n, p in self.model.named_parameters() if p.requires_grad]
        groups = _muon_groups(dict(zip(named, self.masters, strict=True)))
        self.muon = torch.optim.Muon(_torch_groups(groups, True), **CTOR)
        self.adamw = torch.optim.AdamW(_torch_groups(groups, False), **CTOR)
        self.loss_scale: float | None = None  # fp16: the step's loss scale

    def grads(self, step: int, dp: int) -> list[torch.Tensor]:
        """fp16 params: as megabuf makes them, each rank's fp16 grad of the scaled loss times
        1/dp (exact), summed in fp16 in rank order, then unscaled in fp32; else muon_cases'."""
        if self.loss_scale is None:
            return super().grads(step, dp)
        x, y = muon_cases.make_data(step)
        total = [torch.zeros_like(p) for p in self.params]
        for rank in range(dp):
            self.model.zero_grad()
            for lo, hi in muon_cases.batches(x, rank, dp, 1):
                logits = self.model(x[lo:hi])
                (muon_cases.loss_fn(logits, y[lo:hi], 1) * self.loss_scale).backward()
            for acc, p in zip(total, self.params, strict=True):
                acc.add_(p.grad * (1.0 / dp))
        return [acc.float() / self.loss_scale for acc in total]


def _muon_step(model: Any, opt: Any, step: int, inf: bool) -> bool:
    """One step on this rank's slice, the loss scaled by the optimizer's loss scale; with
    `inf`, rank 1's grad of up.weight is made inf (a tensor hook: before megabuf sees it)."""
    x, y = muon_cases.make_data(step)
    n = x.shape[0] // dist.get_world_size()
    lo = dist.get_rank() * n
    opt.zero_grad()
    handle = None
    if inf and dist.get_rank() == 1:
        param = model.module.get_parameter("up.weight")
        handle = param.register_hook(lambda g: torch.full_like(g, math.inf))
    opt.scale_loss(muon_cases.loss_fn(model(x[lo : lo + n]), y[lo : lo + n], 1)).backward()
    if handle is not None:
        handle.remove()
    model.finish_grad_sync()
    return bool(opt.step()[0])


def muon_groups_case(strategy: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """STEPS steps of MuonAdamW with _muon_groups against GroupsReference; per-param max
    deviation. `extra`: "ddp" fields, "hook" (Reduce() on every buffer), "scaler" (a
    DynamicGradScaler, and an inf on rank 1 at step 1: skipped, the reference skips it too)."""
    extra = extra or {}
    torch.manual_seed(0)
    net = muon_cases.MuonNet()
    if extra.get("fp16"):
        net.to(torch.float16)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, whole_param_owners=strategy != "no_shard",
        **extra.get("ddp", {}),
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(net, cfg)
    if extra.get("hook"):
        model.register_comm_hook(Reduce())
    named = {n: p for n, p in net.named_parameters() if p.requires_grad}
    cls = megabuf.DistributedOptimizer if strategy != "no_shard" else megabuf.FP32Optimizer
    if extra.get("fp16") and strategy == "no_shard":
        cls = megabuf.MixedPrecisionOptimizer
    scaler = DynamicGradScaler(FP16_SCALE, hysteresis=1) if extra.get("scaler") else None
    opt = cls(model, MuonAdamW, _muon_groups(named), grad_scaler=scaler, **CTOR)
    ref = GroupsReference({"fp16": extra.get("fp16")})
    applied = []
    for step in range(STEPS):
        skip = bool(extra.get("scaler")) and step == 1
        if extra.get("fp16"):
            ref.loss_scale = float(opt.get_loss_scale())
        applied.append(_muon_step(model, opt, step, skip))
        if not skip:
            ref.step(step, dist.get_world_size())
    counted = counted_turns(model)
    return {"errors": muon_cases.compare(model, ref), "applied": applied, "counted": counted}


# ---- MuonAdamW with expert-parallel params (ep 2) ----------------------------------------------
def _moe_groups(named: dict[str, Any]) -> list[dict[str, Any]]:
    """Muon on the router and the experts' matrices, AdamW on the rest; settings differ."""
    muon = [n for n, p in named.items() if p.dim() == 2 and n.startswith("moe.")]
    return [
        {"params": [named[n] for n in muon], "use_muon": True, "lr": 0.02, "momentum": 0.9},
        {"params": [named[n] for n in named if n not in muon], "use_muon": False, "lr": 5e-3,
         "betas": (0.8, 0.95)},
    ]  # fmt: skip


def muon_expert_case(strategy: str) -> dict[str, Any]:
    """ep 2 (expert dp 2 != dp 4), MuonAdamW with _moe_groups, 3 steps of 3 micro-batches;
    the params against the whole MoEModel stepped by torch.optim.Muon + AdamW given the same
    groups on the global batch."""
    import warnings

    from moe_cases import groups as moe_groups

    pgs = moe_groups(ep_size=2)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, whole_param_owners=strategy != "no_shard",
        overlap_grad_reduce=True, bucket_size=64,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    named = {n: p for n, p in net.named_parameters() if p.requires_grad}
    cls = megabuf.DistributedOptimizer if strategy != "no_shard" else megabuf.FP32Optimizer
    opt = cls(model, MuonAdamW, _moe_groups(named), **CTOR)
    ref = MoEModel(CFG, seed=3)
    ref_groups = _moe_groups(dict(ref.named_parameters()))
    ref_muon = torch.optim.Muon(_torch_groups(ref_groups, True), **CTOR)
    ref_adamw = torch.optim.AdamW(_torch_groups(ref_groups, False), **CTOR)
    applied = []
    for step in range(STEPS):
        applied.append(_model_step(model, opt, step))
        ref.zero_grad()
        x, y = moe_batch(CFG, matrix_cases.BATCH, seed=100 + step)
        ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
        ref_muon.step()
        ref_adamw.step()
    return {"applied": applied, "errors": matrix_cases._param_errors(model, ref)}


# ---- MuonAdamW at pp 2 ---------------------------------------------------------------------------
def _pp_muon_groups(named: dict[str, Any]) -> list[dict[str, Any]]:
    """Muon on every 2-D weight (stage 0: the in-projection, router, experts; stage 1: the
    head), AdamW on the biases; the groups' settings differ from each other and from CTOR's. A
    stage passes only the params it holds."""
    muon = [p for n, p in named.items() if p.dim() == 2]
    adam = [p for n, p in named.items() if p.dim() != 2]
    return [
        {"params": muon, "use_muon": True, "lr": 0.02, "momentum": 0.9, "weight_decay": 0.05},
        {"params": adam, "use_muon": False, "lr": 5e-3, "betas": (0.8, 0.95)},
    ]  # fmt: skip


def pp_muon_case(strategy: str, ep: int) -> dict[str, Any]:
    """1F1B over 2 stages (x ep `ep`), 3 micro-batches (matrix_cases' pp case): each stage's
    MuonAdamW (_pp_muon_groups over that stage's params; owners among the stage's dp ranks)
    for 3 steps against the whole MoEModel stepped by torch.optim.Muon + AdamW given the same
    groups on the global batch."""
    from functools import partial

    from moe_cases import groups as moe_groups

    from megabuf.pipeline import (
        default_schedule_hooks,
        get_forward_backward_func,
        wrap_model_chunks,
    )

    pgs = moe_groups(pp_size=2, ep_size=ep)
    whole = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    stage = matrix_cases.MoEStage(whole, first=pgs.pp_rank == 0)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=64, data_parallel_sharding_strategy=strategy,
        whole_param_owners=strategy != "no_shard",
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = wrap_model_chunks([stage], cfg, pgs)
    if stage.moe is not None:
        stage.moe.collectives = model.engine.collectives
    named = {n: p for n, p in stage.named_parameters() if p.requires_grad}
    cls = megabuf.DistributedOptimizer if strategy != "no_shard" else megabuf.FP32Optimizer
    opt = cls([model], MuonAdamW, _pp_muon_groups(named), **CTOR)
    ref = MoEModel(CFG, seed=3)
    ref_groups = _pp_muon_groups(dict(ref.named_parameters()))
    ref_opts = (
        torch.optim.Muon(_torch_groups(ref_groups, True), **CTOR),
        torch.optim.AdamW(_torch_groups(ref_groups, False), **CTOR),
    )
    n = matrix_cases.BATCH // pgs.dp_size
    k = n // matrix_cases.MICRO
    applied = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = moe_batch(CFG, matrix_cases.BATCH, seed=100 + step)
        mine = [(x[pgs.dp_rank * n + i * k :][:k], y[pgs.dp_rank * n + i * k :][:k])
                for i in range(matrix_cases.MICRO)]  # fmt: skip
        get_forward_backward_func(2, 1)(
            forward_step_func=partial(matrix_cases._pp_forward_step, (None, False, [])),
            data_iterator=iter(mine), model=model, num_microbatches=matrix_cases.MICRO,
            tensor_shape=(k, CFG.d_model), hooks=default_schedule_hooks([model]),
        )  # fmt: skip
        applied.append(bool(opt.step()[0]))
        ref.zero_grad()
        ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
        for ref_opt in ref_opts:
            ref_opt.step()
    return {
        "applied": applied, "errors": matrix_cases._param_errors(model, ref),
        "pp_rank": pgs.pp_rank, "counted": counted_turns(model),
    }  # fmt: skip
