"""Rank-side code for the optimizer tests (runs inside DistPool workers).

Every case builds the same model on every rank, trains it with megabuf DDP + a megabuf optimizer
on this rank's slice of the global batch, trains a deep copy with the plain torch optimizer on the
whole global batch in one process, and returns the largest deviation per param.

[Note: bf16 optimizer bound]
A bf16 model's grads on the global batch and on a rank's slice round differently (one bf16
rounding of a different sum: ~2**-8 of the grad), and Adam turns a grad near 0 into a step of
+-lr whose sign that rounding decides, so a global-batch reference only bounds the params to a
few bf16 ulps: more than one optimizer step (lr 1e-2), which a dropped or doubled step would
hide in. So bf16 cases compare against a reference that performs the identical bf16 operations
(`Reference` with `slices`): every rank's slice goes through the same bf16 forward and backward
in this process (the same kernels on the same bits: the same local grads), their fp32 copies
are averaged, and torch's optimizer steps fp32 masters. The one free choice left is the order in
which the fp32 sum over dp ranks is taken (gloo's all-reduce, all-to-all + local sum or native
reduce-scatter); at dp <= 2 it is order-free. The bound per master element is
    BF16_MASTER_C * u32 * steps * (|master| + lr)
(u32 = 2**-24: a few fp32 roundings per step of the master and of an update of size ~lr).
Observed: 0 (bitwise) at dp 1, 2 and 4 on both gloo strategies. A dropped or doubled Adam step
moves elements by ~lr, about 10**4 times this bound. A different sum order at dp 4 could move a
master across a bf16 rounding boundary and change the next forward; the bound then fails and the
reference must sum in that order (it is bitwise today, so such a change is visible).
The bf16 params are their masters rounded: compared to within one bf16 ulp (2**-7 relative).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from adam_kernels import fused_cuda_bound, ran_fused_cuda
from case_devices import case_device, params_device, race_window
from grad_cases import NATIVE_GLOO
from torch import nn

import megabuf
from megabuf.buckets.bucket_group import ParamSyncState
from megabuf.optimizer import DynamicGradScaler
from megabuf.pure.layout import shard_pieces
from megabuf.transport.collectives import Collectives

GLOBAL_BATCH = 16
DIM = 12
OUT = 3
FP32_U = 2.0**-24  # fp32 unit roundoff
BF16_MASTER_C = 8.0  # [Note: bf16 optimizer bound]
TORCH_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
}


class Net(nn.Module):
    """Forward order = registration order; a tied weight and a param whose grad is always 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.block = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.ones(DIM))
        self.dead = nn.Parameter(torch.ones(DIM))  # multiplied by 0: grad is exactly 0
        self.tail = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.tail.weight.dtype)
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.block(h)) * self.scale + 0.0 * self.dead
        return self.tail(torch.tanh(self.head(h))).float()


class Permuted(nn.Module):
    """Registered a, b, c, d; run d, b, a, c."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(DIM, DIM) for _ in range(4))
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.out.weight.dtype)
        for layer in (self.d, self.b, self.a, self.c):
            h = torch.tanh(layer(h))
        return self.out(h).float()


class ParentReads(nn.Module):
    """The parent reads a child's weight through F.linear (the child's forward never runs) and
    an nn.ParameterList; Megatron-core would read these half-updated with overlap_param_gather."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.inner = nn.Linear(DIM, DIM)  # never called
        self.gains = nn.ParameterList([nn.Parameter(1 + 0.1 * torch.randn(DIM)) for _ in range(3)])
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.to(self.out.weight.dtype)))
        h = torch.tanh(F.linear(h, self.inner.weight, self.inner.bias))
        for gain in self.gains:
            h = h * gain
        return self.out(h).float()


class _Mixer(nn.Module):
    def forward(self, h: torch.Tensor, other: nn.Linear) -> torch.Tensor:
        return torch.tanh(F.linear(h, other.weight) + h)


class SiblingReads(nn.Module):
    """`mixer` reads `late`'s weight before `late`'s own forward runs: an ownership-based
    gather plan would let it read the stale weight."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.mixer = _Mixer()
        self.late = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.to(self.out.weight.dtype)))
        h = torch.tanh(self.late(self.mixer(h, self.late)))
        return self.out(h).float()


MODELS: dict[str, Callable[[], nn.Module]] = {
    "net": Net, "permuted": Permuted, "parent_reads": ParentReads, "sibling_reads": SiblingReads,
}  # fmt: skip


def make_data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def local_slice(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def param_groups(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """Two groups with different lr and weight decay (they must survive sharding)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
    vectors = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": vectors, "lr": lr * 0.5, "weight_decay": 0.0},
    ]


def optimizer_kwargs(name: str, case: dict[str, Any]) -> dict[str, Any]:
    lr = case.get("lr", 1e-2)
    if name == "sgd":
        return {"lr": lr, "momentum": 0.9}
    return {"lr": lr, "eps": case.get("eps", 1e-8)}


def build_model(case: dict[str, Any], **ddp_overrides: Any) -> megabuf.DistributedDataParallel:
    torch.manual_seed(0)
    net = MODELS[case.get("model", "net")]()
    if case.get("bf16") or case.get("fp16"):
        net.to(torch.bfloat16 if case.get("bf16") else torch.float16)
    net.to(case_device(case))
    if case.get("expert"):  # ep=1: expert params replicated over expt_dp == dp
        megabuf.mark_expert_parallel(net.tail.parameters())
    cfg = megabuf.DistributedDataParallelConfig.from_dict({**case["ddp"], **ddp_overrides})
    collectives = Collectives(NATIVE_GLOO) if case.get("native") else None
    return megabuf.DistributedDataParallel(net, cfg, collectives=collectives)


def build_opt(model: megabuf.DistributedDataParallel, case: dict[str, Any]) -> Any:
    name = case.get("optimizer", "adam")
    kwargs = optimizer_kwargs(name, case)
    groups = param_groups(model.module, kwargs["lr"])
    if case.get("builder"):
        config = megabuf.OptimizerConfig(
            optimizer=name, lr=kwargs["lr"], adam_eps=kwargs.get("eps", 1e-8),
            sgd_momentum=0.9, clip_grad=case.get("clip", 0.0), bf16=bool(case.get("bf16")),
            log_num_zeros_in_grad=True,
        )  # fmt: skip
        return megabuf.build_optimizer(model, config, groups)
    if model.ddp_config.use_distributed_optimizer:
        cls: type[megabuf.MegabufOptimizer] = megabuf.DistributedOptimizer
    else:
        cls = megabuf.MixedPrecisionOptimizer
    return cls(
        model, TORCH_OPTIMIZERS[name], groups, clip_grad=case.get("clip", 0.0),
        grad_scaler=_scaler(case), log_num_zeros_in_grad=True, **kwargs,
    )  # fmt: skip


def _scaler(case: dict[str, Any]) -> DynamicGradScaler | None:
    kwargs = case.get("scaler")
    return None if kwargs is None else DynamicGradScaler(**kwargs)


def train_step(
    model: Any, opt: Any, step: int, poison: bool = False, case: dict[str, Any] | None = None
) -> Any:
    """One step on this rank's slice, on the model's device; `case` may open race windows
    before finish_grad_sync() and step() ([Note: race windows] in case_devices.py)."""
    device = params_device(model.module)
    x, y = (t.to(device) for t in make_data(step))
    opt.zero_grad()
    opt.scale_loss(loss_fn(model(local_slice(x)), local_slice(y))).backward()
    race_window(case or {}, "finish_grad_sync")
    model.finish_grad_sync()
    if poison and dist.get_rank() == dist.get_world_size() - 1:
        _poison_own_grad(model)
    race_window(case or {}, "step")
    return opt.step()


def _poison_own_grad(model: megabuf.DistributedDataParallel) -> None:
    """An inf only this rank sees: one element of a reduced grad this rank owns."""
    buf = model.buffers[0]
    if model.ddp_config.use_distributed_optimizer:
        piece = shard_pieces(buf.layout, buf.dp_rank, buf.dp_size)[0]
        buf.grad_data[piece.buffer_start] = float("inf")
    else:
        buf.params[0].main_grad.view(-1)[0] = float("inf")


class Reference:
    """Single process; bf16/fp16 models keep fp32 master copies (mixed precision).

    fp32 and fp16 models take their grads from one backward on the global batch. bf16 models
    (`sliced`) take them as megabuf's ranks do: the bf16 backward of every dp rank's slice, run
    here one after another (the same kernels on the same inputs: the same bits), converted to
    fp32 and averaged in rank order; see [Note: bf16 optimizer bound]."""

    def __init__(self, case: dict[str, Any]) -> None:
        torch.manual_seed(0)
        self.model = MODELS[case.get("model", "net")]()
        if case.get("bf16") or case.get("fp16"):
            self.model.to(torch.bfloat16 if case.get("bf16") else torch.float16)
        self.model.to(case_device(case))
        self.params = list(self.model.parameters())
        self.names = [name for name, _ in self.model.named_parameters()]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.slices = dist.get_world_size() if case.get("bf16") else 1
        name = case.get("optimizer", "adam")
        kwargs = optimizer_kwargs(name, case)
        by_param = dict(zip(self.params, self.masters, strict=True))
        groups = [
            {**g, "params": [by_param[p] for p in g["params"]]}
            for g in param_groups(self.model, kwargs["lr"])
        ]
        self.opt = TORCH_OPTIMIZERS[name](groups, **kwargs)
        self.clip = case.get("clip", 0.0)

    def _grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        n = x.shape[0] // self.slices
        total = [torch.zeros_like(m) for m in self.masters]
        for r in range(self.slices):
            self.model.zero_grad()
            loss_fn(self.model(x[r * n : (r + 1) * n]), y[r * n : (r + 1) * n]).backward()
            for acc, p in zip(total, self.params, strict=True):
                acc.add_(p.grad.float())
        return [acc.mul_(1.0 / self.slices) for acc in total]  # a power of 2: exact

    def step(self, step: int) -> tuple[float, int]:
        device = self.masters[0].device
        x, y = (t.to(device) for t in make_data(step))
        for master, grad in zip(self.masters, self._grads(x, y), strict=True):
            master.grad = grad
        zeros = sum(int((m.grad == 0).sum()) for m in self.masters)
        norm = torch.nn.utils.clip_grad_norm_(self.masters, self.clip or math.inf)
        self.opt.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params, strict=True):
                p.copy_(master)
        return float(norm), zeros


def param_errors(model: megabuf.DistributedDataParallel, ref: Reference) -> dict[str, float]:
    model.publish_params()
    ref_params = dict(ref.model.named_parameters())
    return {
        name: (p.detach().float() - ref_params[name].detach().float()).abs().max().item()
        for name, p in model.module.named_parameters()
    }


def bf16_param_ulps(model: megabuf.DistributedDataParallel, ref: Reference) -> dict[str, float]:
    """Per bf16 param: max |megabuf param - reference param| in bf16 ulps of the reference value
    (at most 2**-7 of it): both are their fp32 masters rounded to bf16."""
    model.publish_params()
    ref_params = dict(ref.model.named_parameters())
    out = {}
    for name, p in model.module.named_parameters():
        want = ref_params[name].detach().float()
        diff = (p.detach().float() - want).abs()
        out[name] = (diff / (want.abs() * 2.0**-7 + 1e-30)).max().item()
    return out


def master_errors(opt: Any, ref: Reference, steps: int) -> dict[str, tuple[float, float]]:
    """Per param: (max |megabuf fp32 main param - reference master|, max of that over the
    element's bound), on the pieces this rank steps; see [Note: bf16 optimizer bound], and
    [Note: fused CUDA Adam bound] where megabuf stepped with torch's fused CUDA kernel."""
    masters = dict(zip(ref.names, ref.masters, strict=True))
    groups = {id(m): g for g in ref.opt.param_groups for m in g["params"]}
    fused = ran_fused_cuda([d.optimizer for d in opt.domains])  # [Note: fused CUDA Adam bound]
    out: dict[str, tuple[float, float]] = {}
    for mp in opt.main_params:
        master, group = masters[mp.key], groups[id(masters[mp.key])]
        want = master.flatten()[mp.param_start : mp.param_end]
        diff = (mp.main.detach().flatten() - want).abs()
        bound = BF16_MASTER_C * FP32_U * steps * (want.abs() + group["lr"])
        if fused and "betas" in group:
            sq = ref.opt.state[master]["exp_avg_sq"].flatten()[mp.param_start : mp.param_end]
            bound = bound + fused_cuda_bound(group, steps, want.abs(), sq)
        err, ratio = diff.max().item(), (diff / bound).max().item()
        old = out.get(mp.key, (0.0, 0.0))
        out[mp.key] = (max(old[0], err), max(old[1], ratio))
    return out


def _strategy(model: megabuf.DistributedDataParallel) -> tuple[str, str]:
    strategy = model.engine.collectives.strategy(
        model.process_groups.dp, params_device(model.module)
    )
    return strategy.reduce_scatter, strategy.all_gather


def equality_case(case: dict[str, Any]) -> dict[str, Any]:
    """N steps of megabuf vs the single-process torch optimizer."""
    model = build_model(case)
    opt = build_opt(model, case)
    ref = Reference(case)
    norms, zeros = [], []
    for step in range(case.get("steps", 3)):
        ok, norm, n_zeros = train_step(model, opt, step, case=case)
        ref_norm, ref_zeros = ref.step(step)
        if not ok:
            raise RuntimeError(f"step {step} unexpectedly skipped")
        norms.append((norm, ref_norm))
        zeros.append((n_zeros, ref_zeros))
    scale = max(p.abs().max().item() for p in ref.model.parameters())
    domains = [d.kind for d in opt.domains]
    bf16 = case.get("bf16")
    masters = master_errors(opt, ref, case.get("steps", 3)) if bf16 else {}
    return {
        "errors": param_errors(model, ref), "norms": norms, "zeros": zeros, "scale": scale,
        "domains": domains, "masters": masters, "ulps": bf16_param_ulps(model, ref) if bf16 else {},
        "strategy": _strategy(model), "final": _kept_params(model, case),
    }  # fmt: skip


def _kept_params(model: megabuf.DistributedDataParallel, case: dict[str, Any]) -> dict[str, Any]:
    """Every param on CPU if the case asks (`keep_params`), to compare runs with each other."""
    if not case.get("keep_params"):
        return {}
    model.publish_params()
    return {n: p.detach().cpu() for n, p in model.module.named_parameters()}


def overlap_case(case: dict[str, Any]) -> dict[str, Any]:
    """overlap_param_gather off and on must give bitwise equal params; with it on, step()
    leaves every group's gather in flight (dispatched, not waited) for the next forward."""
    finals, in_flight = [], True
    for overlap in (False, True):
        model = build_model(case, overlap_param_gather=overlap)
        opt = build_opt(model, case)
        for step in range(case.get("steps", 4)):
            train_step(model, opt, step, case=case)
            if overlap:
                states = {g.param_state for g in model.engine.all_bucket_groups}
                in_flight &= states == {ParamSyncState.DISPATCHED}
        model.publish_params()
        finals.append([p.detach().clone() for p in model.module.parameters()])
    bitwise = all(torch.equal(a, b) for a, b in zip(*finals, strict=True))
    ref = Reference(case)
    for step in range(case.get("steps", 4)):
        ref.step(step)
    errors = {
        name: (p - q).abs().max().item()
        for (name, q), p in zip(ref.model.named_parameters(), finals[1], strict=True)
    }
    bf16 = case.get("bf16")
    return {
        "bitwise": bitwise, "in_flight": in_flight, "errors": errors,
        "masters": master_errors(opt, ref, case.get("steps", 4)) if bf16 else {},
        "ulps": bf16_param_ulps(model, ref) if bf16 else {},
        "strategy": _strategy(model), "final": _kept_params(model, case),
    }  # fmt: skip


def memory_case(case: dict[str, Any]) -> dict[str, Any]:
    """Exact per-rank bytes after Adam has created its state."""
    model = build_model(case)
    opt = build_opt(model, case)
    train_step(model, opt, 0)
    report = opt.memory_report()
    ref = Reference(case)
    ref.step(0)
    ref_state = sum(
        t.numel() * t.element_size()
        for st in ref.opt.state.values()
        for t in st.values()
        if t.dim() > 0
    )
    bufs = list(model.buffers) + model.engine.expert_parallel_buffers
    return {
        "report": report,
        "ref_state_nbytes": ref_state,
        "numel_unpadded": sum(b.numel_unpadded for b in bufs),
        "numel_padded": sum(b.numel for b in bufs),
    }


def scaler_case(case: dict[str, Any]) -> dict[str, Any]:
    """Dynamic loss scaling: an inf on one rank at `poison_step` skips that step everywhere."""
    model = build_model(case)
    opt = build_opt(model, case)
    ref = Reference(case)
    oks, scales = [], []
    for step in range(case["steps"]):
        poison = step == case.get("poison_step")
        ok, _, _ = train_step(model, opt, step, poison=poison)
        oks.append(ok)
        scales.append(float(opt.get_loss_scale().item()))
        if ok:
            ref.step(step)
    scale = max(p.abs().max().item() for p in ref.model.parameters())
    return {"oks": oks, "scales": scales, "errors": param_errors(model, ref), "scale": scale}


def _no_group() -> Any:
    model = build_model({"ddp": {"use_distributed_optimizer": True}})
    return megabuf.DistributedOptimizer(model, torch.optim.Adam, [model.module.tail.weight])


MISUSES: dict[str, Callable[[], Any]] = {
    "distopt_on_plain_ddp": lambda: megabuf.DistributedOptimizer(
        build_model({"ddp": {}}), torch.optim.Adam
    ),
    "mixed_on_distopt": lambda: megabuf.MixedPrecisionOptimizer(
        build_model({"ddp": {"use_distributed_optimizer": True}}), torch.optim.Adam
    ),
    "param_in_no_group": _no_group,
    "fp32_optimizer_bf16": lambda: megabuf.FP32Optimizer(
        build_model({"bf16": True, "ddp": {}}), torch.optim.Adam
    ),
}


def misuse_error(label: str) -> str:
    """Misuse must raise a ValueError that says what to do: its message."""
    try:
        MISUSES[label]()
    except ValueError as exc:
        return str(exc)
    return "no error"
