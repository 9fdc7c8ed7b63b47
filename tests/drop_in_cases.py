"""Rank-side cases for test_drop_in.py: a torch-DDP training script run on megabuf, compared with
stock torch DDP in the same processes (gloo, fp32: bitwise)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf
from megabuf.testing.models import gpt_loss, gpt_tiny

ITERS, ACCUM, BATCH = 5, 2, 2
VOCAB = 64


def _batch(it: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * it + 10 * micro + dist.get_rank())
    return torch.randint(0, VOCAB, (BATCH, 16), generator=gen)


def _warmup_cosine(step: int) -> float:
    warmup, total = 2, ITERS
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def torch_ddp_script(wrap: Callable[[nn.Module], nn.Module], loop: str) -> dict[str, Any]:
    """nanoGPT's loop: accumulation by toggling require_backward_grad_sync (or no_sync()),
    clip_grad_norm_, AdamW, warmup/cosine LambdaLR, zero_grad(set_to_none=True), and with
    loop 'grad_scaler' torch.amp.GradScaler (scale, unscale_, step, update). `loop` adds the
    variations users bring from Megatron ('finish': an explicit finish_grad_sync()) or other
    scripts ('zero_after_forward': zero_grad between forward and backward)."""
    model = wrap(gpt_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=loop == "grad_scaler")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup_cosine)
    losses, norms = [], []
    for it in range(ITERS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            if loop == "no_sync" and not last:
                with model.no_sync():  # type: ignore[operator]
                    scaler.scale(gpt_loss(model(x := _batch(it, micro)), x) / ACCUM).backward()
                continue
            if loop != "no_sync":
                model.require_backward_grad_sync = last  # type: ignore[assignment]
            x = _batch(it, micro)
            loss = gpt_loss(model(x), x) / ACCUM
            if loop == "zero_after_forward" and micro == 0:
                opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if loop == "finish" and last and hasattr(model, "finish_grad_sync"):
                model.finish_grad_sync()  # megabuf only (torch DDP has no such call)
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        scaler.step(opt)
        scaler.update()
        sched.step()
        if loop != "zero_after_forward":
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "norms": norms, "params": params}


def drop_in_vs_torch(loop: str, config: dict[str, Any]) -> dict[str, Any]:
    """The same script on torch DDP and on megabuf (only the class, plus `config`)."""
    ref = torch_ddp_script(lambda m: nn.parallel.DistributedDataParallel(m), loop)
    cfg = megabuf.DistributedDataParallelConfig(**config)
    got = torch_ddp_script(lambda m: megabuf.DistributedDataParallel(m, cfg, device_ids=None), loop)
    return {
        "losses": got["losses"], "ref_losses": ref["losses"],
        "norms": got["norms"], "ref_norms": ref["norms"],
        "params_equal": all(
            torch.equal(a, b) for a, b in zip(got["params"], ref["params"], strict=True)
        ),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(got["params"], ref["params"])),
    }  # fmt: skip


class _SometimesUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + self.c(h) if use_c else self.b(h)


def clear_like_torch(how: str, dtype: str) -> dict[str, Any]:
    """Grads cleared through the torch optimizer (`set_to_none`, in-place zero) must start the
    next iteration fresh, exactly like zero_grad_buffer(); fp32 (grads are main_grad views) and
    bf16 params with fp32 grads (grads are copies). `c` is unused on odd iterations."""
    finals = {}
    for clear in ("zero_grad_buffer", how):
        torch.manual_seed(0)
        net = _SometimesUnused()
        if dtype == "bf16":
            net.to(torch.bfloat16)
        cfg = megabuf.DistributedDataParallelConfig(grad_reduce_in_fp32=dtype == "bf16")
        model = megabuf.DistributedDataParallel(net, cfg)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for it in range(4):
            gen = torch.Generator().manual_seed(it * 7 + dist.get_rank())
            x = torch.randn(4, 8, generator=gen).to(net.a.weight.dtype)
            model(x, it % 2 == 0).float().pow(2).mean().backward()
            opt.step()
            if clear == "zero_grad_buffer":
                model.zero_grad_buffer()
            else:
                opt.zero_grad(set_to_none=how == "set_to_none")
        finals[clear] = [p.detach().float().clone() for p in net.parameters()]
    a, b = finals.values()
    return {"equal": all(torch.equal(x, y) for x, y in zip(a, b, strict=True))}


def distopt_with_torch_optimizer() -> dict[str, Any]:
    """use_distributed_optimizer with the script's own AdamW and clip_grad_norm_."""
    cfg = megabuf.DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = megabuf.DistributedDataParallel(gpt_tiny(), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = _batch(0, 0)
    gpt_loss(model(x), x).backward()
    grads_hidden = all(p.grad is None for p in model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        opt.step()
        message = "no error"
    except RuntimeError as exc:
        message = str(exc)
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return {"grads_hidden": grads_hidden, "norm": norm, "message": message, "unchanged": unchanged}


def _distopt_run(rank0_reads: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = megabuf.DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_param_gather=True, overlap_grad_reduce=True,
        bucket_size=4000,
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(gpt_tiny(), cfg)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(lr=1e-2))
    seen: dict[str, Any] = {}
    for it in range(3):
        opt.zero_grad()
        x = _batch(it, 0)
        gpt_loss(model(x), x).backward()
        opt.step()
        if rank0_reads and it == 1 and dist.get_rank() == 0:  # rank-local code, peers go on
            with torch.no_grad():
                seen["eval_loss"] = gpt_loss(model(x), x).item()
            state = model.state_dict()
            unique = {t.data_ptr(): t for t in state.values()}  # tied embeddings: one tensor
            seen["state_sum"] = sum(t.double().sum().item() for t in unique.values())
        if it == 1:
            model.publish_params()  # rank-local too: only waits
            seen["param_sum"] = sum(p.double().sum().item() for p in model.parameters())
    model.publish_params()
    seen["params"] = [p.detach().clone() for p in model.parameters()]
    return seen


def rank0_only_reads() -> dict[str, Any]:
    """Rank 0 alone evaluates and calls state_dict() after step() with overlap_param_gather,
    while the other ranks go straight on training; nothing hangs and training is unchanged."""
    with_reads = _distopt_run(True)
    without = _distopt_run(False)
    same = all(
        torch.equal(a, b) for a, b in zip(with_reads["params"], without["params"], strict=True)
    )
    return {
        "same_training": same,
        "param_sum": with_reads["param_sum"],
        "state_sum": with_reads.get("state_sum"),
        "eval_loss": with_reads.get("eval_loss"),
    }


def buffers_like_torch() -> dict[str, Any]:
    """BatchNorm running stats: broadcast_buffers (torch's default) makes every forward start
    from rank 0's buffers, on torch DDP and on megabuf alike."""
    out = {}
    for name, cls in (("torch", nn.parallel.DistributedDataParallel),
                      ("megabuf", megabuf.DistributedDataParallel)):  # fmt: skip
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        model: Any = cls(net, broadcast_buffers=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for it in range(3):
            gen = torch.Generator().manual_seed(it + 10 * dist.get_rank())
            model(torch.randn(8, 4, generator=gen) * (1 + dist.get_rank())).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name] = [t.detach().clone() for t in [*net.parameters(), *net.buffers()]]
    return {"equal": all(torch.equal(a, b) for a, b in zip(*out.values(), strict=True))}


def torch_groups(kind: str) -> dict[str, Any]:
    """process_group= / device_mesh= (torch's) reduce over that group."""
    if kind == "process_group":
        model = megabuf.DistributedDataParallel(nn.Linear(4, 2), process_group=dist.group.WORLD)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = megabuf.DistributedDataParallel(nn.Linear(4, 2), device_mesh=mesh)
    x = torch.full((2, 4), float(dist.get_rank() + 1))
    model(x).sum().backward()
    world = dist.get_world_size()
    mean_x = sum(range(1, world + 1)) / world
    return {"grad": model.module.weight.grad.tolist(), "expected": [[2 * mean_x] * 4] * 2}


# ---- run in fresh processes (megabuf.testing.spawn): a crash at exit must be seen ---------------
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "overlap_grad_reduce": {"overlap_grad_reduce": True, "bucket_size": 4000},
    "distopt": {"use_distributed_optimizer": True},
    "distopt_overlap_grad_reduce": {
        "use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 4000,
    },
    "distopt_overlap_param_gather": {
        "use_distributed_optimizer": True, "overlap_grad_reduce": True,
        "overlap_param_gather": True, "bucket_size": 4000,
    },
}  # fmt: skip


def _train(model: Any, inner: megabuf.DistributedDataParallel, steps: range) -> list[float]:
    opt = megabuf.build_optimizer(inner, megabuf.OptimizerConfig(lr=1e-2))
    losses = []
    for it in steps:
        opt.zero_grad()
        x = _batch(it, 0)
        loss = gpt_loss(model(x), x)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def profiled_windows() -> dict[str, Any]:
    """Every mode, a torch.profiler window around steps 1-2 of 4; the process must then exit
    cleanly (spawn checks the exit code) and the trace holds megabuf's labels."""
    megabuf.init_distributed()
    out = {}
    for name, cfg in MODES.items():
        torch.manual_seed(0)
        model = megabuf.DistributedDataParallel(
            gpt_tiny(), megabuf.DistributedDataParallelConfig(**cfg)
        )
        opt_losses = _train(model, model, range(1))
        with torch.profiler.profile() as prof:
            opt_losses += _train(model, model, range(1, 3))
        opt_losses += _train(model, model, range(3, 4))
        labels = {e.name for e in prof.events() if e.name.startswith("megabuf::")}
        out[name] = {"losses": opt_losses, "labels": sorted(labels)}
    return out


def compiled(runs: list[tuple[str, str]], backend: str) -> dict[str, Any]:
    """torch.compile before wrapping ('inner'; 'inplace': module.compile(); 'submodule': one
    block's compile()) and of the wrapper ('outer'), per (placement, mode) in `runs`, with the
    eager run of each mode as reference ('eager-<mode>')."""
    megabuf.init_distributed()

    def run(placement: str, mode: str) -> list[float]:
        torch.manual_seed(0)
        net: Any = gpt_tiny()
        if placement == "inner":
            net = torch.compile(net, backend=backend)
        elif placement == "submodule":
            net.blocks[0].compile(backend=backend)
        inner = megabuf.DistributedDataParallel(
            net, megabuf.DistributedDataParallelConfig(**MODES[mode])
        )
        if placement == "inplace":
            inner.module.compile(backend=backend)
        model = torch.compile(inner, backend=backend) if placement == "outer" else inner
        return _train(model, inner, range(4))

    out = {f"eager-{mode}": run("none", mode) for mode in dict.fromkeys(m for _, m in runs)}
    for placement, mode in runs:
        out[f"{placement}-{mode}"] = run(placement, mode)
    return out
