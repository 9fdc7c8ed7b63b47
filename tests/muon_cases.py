"""Rank-side code for the matrix-optimizer tests (runs inside DistPool workers).

Each case trains the same small model with megabuf DDP (`whole_param_owners=True`) + a megabuf
optimizer stepping `MuonAdamW`, on this rank's slice of the global batch, and compares it with a
single process stepping torch's own `torch.optim.Muon` (2-D weights) and `torch.optim.AdamW`
(embedding, tied head, norm, biases) on the same global batch.

[Note: Muon reference]
The reference takes its grads as megabuf's ranks make them: the backward of every dp rank's
slice (and of each micro-batch, accumulated in order), run here one after another, summed in
fp32 in rank order and multiplied by 1/dp (a power of 2: exact). That is the order of gloo's
reduce-scatter (all-to-all + a local sum in rank order), so the full reduced grad each owner
holds is bitwise the reference's, and Newton-Schulz (bf16 matmuls in torch.optim.Muon) runs on
the same bits: params are compared bitwise. Clipping scales by a norm summed over ranks in
another order than `clip_grad_norm_`, which moves the momentum by an fp32 rounding and the bf16
Newton-Schulz input by at most a bf16 rounding: clipped cases are bounded by CLIP_ATOL instead
(observed: 6e-8), and so is the replicated no_shard case, whose all-reduce sums in ring order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import megabuf
from megabuf.optimizer import (
    DistributedOptimizer,
    FP32Optimizer,
    MegabufOptimizer,
    MixedPrecisionOptimizer,
    MuonAdamW,
    OptimizerConfig,
    build_optimizer,
)

VOCAB, DIM, HIDDEN, SEQ = 16, 8, 24, 4
GLOBAL_BATCH = 8
LR, MUON_LR = 1e-2, 2e-2
CLIP_ATOL = 1e-4


class MuonNet(nn.Module):
    """Embedding tied to the head, matrices of different costs (owners differ in load), a norm,
    biases and a frozen matrix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.mix = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.norm(self.up(h))))
        h = self.frozen(torch.tanh(self.mix(h)))
        return F.linear(h, self.embed.weight).float()  # tied output head


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (
        torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
    )


def loss_fn(logits: torch.Tensor, y: torch.Tensor, n_micro: int) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)) / n_micro


def batches(x: torch.Tensor, rank: int, dp: int, n_micro: int) -> list[tuple[int, int]]:
    """[lo, hi) of rank's micro-batches."""
    n = x.shape[0] // dp
    m = n // n_micro
    return [(rank * n + i * m, rank * n + (i + 1) * m) for i in range(n_micro)]


def is_muon(name: str, p: nn.Parameter) -> bool:
    return p.dim() == 2 and not name.startswith("embed")


def build(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    torch.manual_seed(0)
    net = MuonNet()
    if case.get("bf16"):
        net.to(torch.bfloat16)
    ddp = {"data_parallel_sharding_strategy": "optim", **case.get("ddp", {})}
    ddp.setdefault("whole_param_owners", ddp["data_parallel_sharding_strategy"] != "no_shard")
    model = megabuf.DistributedDataParallel(
        net, megabuf.DistributedDataParallelConfig.from_dict(ddp)
    )
    clip = case.get("clip", 0.0)
    if case.get("builder"):
        cfg = OptimizerConfig(
            optimizer="muon", lr=LR, muon_lr=MUON_LR, weight_decay=0.1, clip_grad=clip,
            bf16=bool(case.get("bf16")),
        )  # fmt: skip
        return model, build_optimizer(model, cfg)
    named = dict((p, n) for n, p in net.named_parameters() if p.requires_grad)
    groups = [
        {"params": [p for p, n in named.items() if is_muon(n, p)], "use_muon": True,
         "lr": MUON_LR},
        {"params": [p for p, n in named.items() if not is_muon(n, p)], "use_muon": False},
    ]  # fmt: skip
    cls: type[MegabufOptimizer] = DistributedOptimizer
    if not model.ddp_config.use_distributed_optimizer:
        cls = MixedPrecisionOptimizer if case.get("bf16") else FP32Optimizer
    return model, cls(model, MuonAdamW, groups, clip_grad=clip, lr=LR, weight_decay=0.1)


def train_step(model: Any, opt: Any, step: int, n_micro: int) -> Any:
    x, y = make_data(step)
    opt.zero_grad()
    spans = batches(x, dist.get_rank(), dist.get_world_size(), n_micro)
    for i, (lo, hi) in enumerate(spans):
        ctx = model.no_sync() if i < len(spans) - 1 else _null()
        with ctx:
            loss_fn(model(x[lo:hi]), y[lo:hi], n_micro).backward()
    model.finish_grad_sync()
    return opt.step()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


class Reference:
    """torch.optim.Muon + torch.optim.AdamW in one process; see [Note: Muon reference]."""

    def __init__(self, case: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.model = MuonNet()
        if case.get("bf16"):
            self.model.to(torch.bfloat16)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.masters = [p.detach().float().clone() for p in self.params]
        mains = dict(zip([n for n, _ in named], self.masters, strict=True))
        muon = [mains[n] for n, p in named if is_muon(n, p)]
        adam = [mains[n] for n, p in named if not is_muon(n, p)]
        self.muon = torch.optim.Muon(muon, lr=MUON_LR, weight_decay=0.1)
        self.adamw = torch.optim.AdamW(adam, lr=LR, weight_decay=0.1)
        self.clip = case.get("clip", 0.0)
        self.n_micro = case.get("micro", 1)

    def grads(self, step: int, dp: int) -> list[torch.Tensor]:
        x, y = make_data(step)
        total = [torch.zeros_like(m) for m in self.masters]
        for rank in range(dp):
            self.model.zero_grad()
            for lo, hi in batches(x, rank, dp, self.n_micro):
                loss_fn(self.model(x[lo:hi]), y[lo:hi], self.n_micro).backward()
            for acc, p in zip(total, self.params, strict=True):
                acc.add_(p.grad.float())
        return [acc.mul_(1.0 / dp) for acc in total]

    def step(self, step: int, dp: int) -> float:
        for master, grad in zip(self.masters, self.grads(step, dp), strict=True):
            master.grad = grad
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip or float("inf"))
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params, strict=True):
                p.copy_(master)
        return float(norm)


def compare(model: megabuf.DistributedDataParallel, ref: Reference) -> dict[str, float]:
    theirs = dict(ref.model.named_parameters())
    with model.summon_full_params():  # ZeRO-3: every unit gathered; else publish_params()
        return {
            n: (p.detach().float() - theirs[n].detach().float()).abs().max().item()
            for n, p in model.module.named_parameters()
        }


def equality_case(case: dict[str, Any]) -> dict[str, Any]:
    """N steps of megabuf vs the reference: per-param max deviation, norms, owners."""
    model, opt = build(case)
    ref = Reference(case)
    dp, n_micro = dist.get_world_size(), case.get("micro", 1)
    norms = []
    for step in range(case.get("steps", 3)):
        ok, norm, _ = train_step(model, opt, step, n_micro)
        if not ok:
            raise RuntimeError(f"step {step} unexpectedly skipped")
        norms.append((norm, ref.step(step, dp)))
    owned = {mp.key: tuple(mp.main.shape) for d in opt.domains for mp in d.main_params}
    return {"errors": compare(model, ref), "norms": norms, "owned": owned}


def checkpoint_case(case: dict[str, Any], path: str, phase: str) -> dict[str, Any]:
    """phase "save": 2 steps at this dp, save. phase "load": load at this dp, 2 more steps,
    compare with a reference that took steps 0-1 at the saving dp and 2-3 at this one."""
    model, opt = build(case)
    dp = dist.get_world_size()
    if phase == "save":
        for step in range(2):
            train_step(model, opt, step, 1)
        megabuf.save_checkpoint(path, model, opt).wait()
        return {}
    megabuf.load_checkpoint(path, model, opt)
    for step in (2, 3):
        train_step(model, opt, step, 1)
    ref = Reference(case)
    for step in range(4):
        ref.step(step, case["saved_dp"] if step < 2 else dp)
    return {"errors": compare(model, ref)}


def misuse_case(label: str) -> str:
    """The error a misuse raises on this rank (or "no error")."""
    torch.manual_seed(0)
    net = MuonNet()
    try:
        if label == "muon_on_element_shards":
            cfg = megabuf.DistributedDataParallelConfig(use_distributed_optimizer=True)
            model = megabuf.DistributedDataParallel(net, cfg)
            build_optimizer(model, OptimizerConfig(optimizer="muon"))
        elif label == "muon_on_1d_param":
            cfg = megabuf.DistributedDataParallelConfig(
                use_distributed_optimizer=True, whole_param_owners=True
            )
            model = megabuf.DistributedDataParallel(net, cfg)
            megabuf.DistributedOptimizer(model, torch.optim.Muon, lr=0.02)
        elif label == "owner_tables_differ":
            cfg = megabuf.DistributedDataParallelConfig(
                use_distributed_optimizer=True, whole_param_owners=True
            )
            model = megabuf.DistributedDataParallel(net, cfg)
            if dist.get_rank() == 1:  # as if this rank had planned other owners
                buf = model.engine.plan.buffers[0]
                flipped = tuple((r + 1) % 2 for r in buf.layout.owner_of or ())
                object.__setattr__(buf.layout, "owner_of", flipped)
            build_optimizer(model, OptimizerConfig(optimizer="muon"))
        else:
            raise KeyError(label)
    except Exception as exc:  # the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"
