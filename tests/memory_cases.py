"""Rank-side code for the memory accounting tests (runs inside DistPool workers).

Every case trains a small model (a frozen LayerNorm and a module buffer included; or the MoE
model, whose experts live in expert buffers) for two steps under one sharding strategy and
returns this rank's `memory_report()`, the pure formula's figures for the same plan and rank
([Note: memory formula]) and an independent walk over unique storages ([Note: storage walk]).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from moe_cases import groups
from torch import nn

import megabuf
from megabuf.sharding.formula import optimizer_spec, persistent_bytes, transient_bounds
from megabuf.sharding.walk import storage_walk
from megabuf.testing.moe import MoEConfig, MoEModel, moe_batch

MOE = MoEConfig(d_in=8, d_model=16, d_ff=24, d_out=4, num_experts=4, top_k=2)
BATCH = 8


class Small(nn.Module):
    """Two Linears around a frozen LayerNorm, and a module buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 20)
        self.norm = nn.LayerNorm(20)
        self.norm.requires_grad_(False)
        self.b = nn.Linear(20, 4)
        self.register_buffer("gain", torch.full((20,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the dtype from the module buffer: under optim_grads_params the root may not read a
        # unit's param outside that unit's forward
        h = self.norm(torch.tanh(self.a(x.to(self.gain.dtype)))) * self.gain
        return self.b(h).float()


def _model(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, torch.Tensor]:
    torch.manual_seed(0)
    if case.get("expert"):
        ep = 2 if dist.get_world_size() == 4 else 1
        pgs = groups(ep_size=ep)
        module: nn.Module = MoEModel(MOE, ep_group=pgs.ep, seed=1)
        x, _ = moe_batch(MOE, BATCH, seed=pgs.dp_rank)
    else:
        pgs = groups()
        module = Small()
        x = torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(pgs.dp_rank))
    if case.get("bf16"):
        module = module.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    config = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=case["strategy"],
        grad_reduce_in_fp32=bool(case.get("bf16")),
        bucket_size=case.get("bucket_size"),
        overlap_grad_reduce=case.get("bucket_size") is not None,
        cpu_offload=bool(case.get("cpu_offload")),
    )
    return megabuf.DistributedDataParallel(module, config, process_groups=pgs), x


def train(case: dict[str, Any], steps: int = 2) -> tuple[Any, Any]:
    """The wrapped model and its optimizer after `steps` steps."""
    model, x = _model(case)
    opt = megabuf.build_optimizer(
        model,
        megabuf.OptimizerConfig(
            optimizer=case["optimizer"], lr=1e-2, bf16=bool(case.get("bf16")), sgd_momentum=0.9
        ),
    )
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    return model, opt


def memory_case(case: dict[str, Any]) -> dict[str, Any]:
    """This rank's report, formula and walk after two steps; see the module docstring."""
    model, opt = train(case)
    report = opt.memory_report()
    pgs = model.process_groups
    device = next(model.parameters()).device
    scratch = model.engine.collectives.strategy(pgs.dp, device).reduce_scatter == "all_to_all"
    cfg = model.ddp_config
    formula = persistent_bytes(
        model.engine.plan, case["strategy"], optimizer_spec(opt.domains[0].optimizer),
        dp_rank=pgs.dp_rank, expt_dp_rank=dist.get_rank(pgs.expt_dp),
        reduce_scatter_scratch=scratch, cpu_offload=cfg.cpu_offload and device.type != "cpu",
    )  # fmt: skip
    bounds = transient_bounds(
        model.engine.plan, cfg.sharding, prefetch_units=cfg.prefetch_units
    )  # fmt: skip
    return {
        "skipped": False,
        "persistent": dict(report.persistent),
        "host": dict(report.host),
        "transient_now": dict(report.transient_now),
        "transient_peak": dict(report.transient_peak),
        "formula": formula,
        "bounds": bounds,
        "walk": storage_walk(model, opt),
        "frozen_nbytes": sum(
            p.numel() * p.element_size() for p in model.module.parameters() if not p.requires_grad
        ),
        "buffer_nbytes": sum(b.numel() * b.element_size() for b in model.module.buffers()),
    }


def _optimizer_tensors(opt: Any) -> list[torch.Tensor]:
    """Main params and every state tensor, in a fixed order."""
    out = [mp.main for mp in opt.main_params]
    for domain in opt.domains:
        for mp in domain.main_params:
            state = domain.optimizer.state.get(mp.main, {})
            out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def offload_case(strategy: str) -> dict[str, Any]:
    """cpu_offload=True on CPU params: the warnings it gives, and whether three bf16 AdamW steps
    give bitwise the main params and state of cpu_offload=False."""
    case = {"strategy": strategy, "optimizer": "adamw", "bf16": True, "bucket_size": 100}
    _, plain = train(case, steps=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, offloaded = train({**case, "cpu_offload": True}, steps=3)
    a, b = _optimizer_tensors(plain), _optimizer_tensors(offloaded)
    return {
        "skipped": False,
        "warnings": [
            (w.category.__name__, str(w.message)) for w in caught if "cpu_offload" in str(w.message)
        ],
        "n_tensors": len(b),
        "bitwise": len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)),
        "host": dict(offloaded.memory_report().host),
        "cpu_offload": model.ddp_config.cpu_offload,
    }
