"""Rank-side code for the grad-contract tests (runs inside DistPool workers).

Every case runs in the same worker process, one after another, through `dist_pool.run_each`
(RNG reset per case; an exception is returned, not raised, so one case never hides another).
References are single-process: the same model, each rank's batch pushed through its own
backward, summed in rank order after scaling by 1/dp (exact in binary floating point for dp = 2
and 4), so at dp = 2 the comparison can be bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint as checkpoint
from dist_pool import run_each
from torch import nn

import megabuf

DIM = 8
LOCAL_BATCH = 4


class BranchNet(nn.Module):
    """`head_b` is used only by ranks that pass use_b (rank 0); `never` by nobody."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, DIM)
        self.head_a = nn.Linear(DIM, 3)
        self.head_b = nn.Linear(DIM, 3)
        self.never = nn.Linear(DIM, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        out = self.head_a(h)
        if use_b:
            out = out + self.head_b(h)
        return out * self.scale


def data(step: int, rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(LOCAL_BATCH, DIM, generator=g).to(dtype)
    return x, torch.randn(LOCAL_BATCH, 3, generator=g).to(dtype)


def uses_b(rank: int) -> bool:
    return rank == 0


def loss_of(model: nn.Module, step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = data(step, rank, dtype)
    return ((model(x, uses_b(rank)).float() - y.float()) ** 2).mean()


def replay_average(
    ref: nn.Module, backward_of_rank: Callable[[nn.Module, int], Any], dp: int
) -> dict[str, torch.Tensor]:
    """Reference grads: every rank's backward replayed on `ref` in this process, summed over
    ranks r in order as fp32 grad_r * (1/dp) (zero where rank r left a param unused): what a dp
    all-reduce of pre-scaled grads computes, bitwise at dp 2."""
    total = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in ref.named_parameters()}
    for r in range(dp):
        ref.zero_grad(set_to_none=True)
        backward_of_rank(ref, r)
        for n, p in ref.named_parameters():
            if p.grad is not None:
                total[n] += p.grad.float() * (1.0 / dp)
    return total


def reference_grads(
    ref: nn.Module, step: int, dp: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """ref's .grad = `replay_average` of the contract loss (in ref's dtype), never None;
    returns the fp32 sums."""
    total = replay_average(ref, lambda m, r: loss_of(m, step, r, dtype).backward(), dp)
    for n, p in ref.named_parameters():
        p.grad = total[n].to(p.dtype)
    return total


def grad_errors_per_step(
    model: megabuf.DistributedDataParallel, ref: nn.Module, steps: int
) -> list[float]:
    """Train `steps` fp32 iterations; per step, max |param.grad - reference grad| over the
    trainable params (the wrapped module and `ref` must have the same param names)."""
    rank, dp = dist.get_rank(), dist.get_world_size()
    errors = []
    for step in range(steps):
        model.zero_grad_buffer()
        loss_of(model, step, rank, torch.float32).backward()
        model.finish_grad_sync()
        reference_grads(ref, step, dp, torch.float32)
        errors.append(
            max(
                (p.grad - ref.get_parameter(n).grad).abs().max().item()
                for n, p in model.module.named_parameters()
                if p.requires_grad
            )
        )
    return errors


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def divergent_unused(case: dict[str, Any]) -> dict[str, Any]:
    """Params used on some ranks only (and one on none), torch or megabuf optimizer, with an
    evaluation forward and a grad-enabled metrics forward between finish_grad_sync and step."""
    torch.manual_seed(0)
    dtype = torch.bfloat16 if case.get("bf16") else torch.float32
    net = BranchNet().to(dtype)
    ref = copy.deepcopy(net)
    rank, dp = dist.get_rank(), dist.get_world_size()
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case["ddp"])
    model = megabuf.DistributedDataParallel(net, cfg)
    if case["optimizer"] == "megabuf":
        opt_cfg = megabuf.OptimizerConfig(
            optimizer="sgd", lr=0.1, sgd_momentum=0.9, weight_decay=0.1
        )
        opt: Any = megabuf.build_optimizer(model, opt_cfg)
        ref_opt = make_optimizer("sgd", ref.parameters())
    else:
        opt = make_optimizer(case["optimizer"], model.parameters())
        ref_opt = make_optimizer(case["optimizer"], ref.parameters())
    grads_none = []
    for step in range(3):
        model.zero_grad_buffer()
        loss_of(model, step, rank, dtype).backward()
        model.finish_grad_sync()
        with torch.no_grad():
            model(data(step, rank, dtype)[0], True)  # evaluation pass
        model(data(step, rank, dtype)[0], True).sum()  # metrics pass, grad enabled, no backward
        grads_none.append([n for n, p in net.named_parameters() if p.grad is None])
        opt.step()
        reference_grads(ref, step, dp, dtype)
        ref_opt.step()
    model.publish_params()
    return {
        "params": {n: p.detach().clone() for n, p in net.named_parameters()},
        "ref": {n: p.detach().clone() for n, p in ref.named_parameters()},
        "grads_none": grads_none,
    }


class _Raise(torch.autograd.Function):
    """Identity whose backward raises while `armed` (an exception in the middle of backward)."""

    armed = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _Raise.armed:
            raise RuntimeError("planted failure in backward")
        return grad


class Stack(nn.Module):
    """Four layers; `reentrant` runs layers 1-2 (layer 1 twice) under reentrant checkpointing."""

    def __init__(self, reentrant: bool = False, fail_point: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(4))
        self.reentrant = reentrant
        self.fail_point = fail_point

    def _middle(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[1](h))
        return torch.tanh(self.layers[2](self.layers[1](h)))

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        if self.fail_point:
            h = _Raise.apply(h)  # after layers 1-3 got their grads, before layer 0
        if self.reentrant:
            h = checkpoint.checkpoint(self._middle, h, use_reentrant=True)
            h = checkpoint.checkpoint(self._middle, h, use_reentrant=True)
        else:
            h = self._middle(self._middle(h))
        return self.layers[3](h)[:, :3]


def reentrant_checkpointing() -> dict[str, Any]:
    """Layers 1 and 2 run inside two reentrant-checkpointed regions, so their grads arrive twice
    per backward (once per region's inner backward); overlap must wait for the last arrival, and
    still dispatch during backward from the second iteration on."""
    torch.manual_seed(0)
    net, ref = Stack(reentrant=True), Stack(reentrant=False)
    ref.load_state_dict(net.state_dict())
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    model = megabuf.DistributedDataParallel(net, cfg)
    timeline = model.enable_timeline()
    errors = grad_errors_per_step(model, ref, steps=3)
    ends = [t for g, e, t in timeline.events if e == "backward_end"]
    early = [sum(1 for g, e, t in timeline.events if e == "dispatch" and lo < t < hi)
             for lo, hi in zip([0.0, *ends[:-1]], ends)]  # fmt: skip
    return {"errors": errors, "early_dispatches": early, "groups": len(model.engine.bucket_groups)}


def branch_net_without_never() -> BranchNet:
    """BranchNet (seeded) with `never` frozen: every trainable param is used on some rank."""
    torch.manual_seed(0)
    net = BranchNet()
    net.never.requires_grad_(False)
    return net


def error_of(fn: Callable[[], Any]) -> str:
    """The message of the RuntimeError `fn` raises, or "no error"."""
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def strict_unused() -> str:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=1, error_on_unused_params=True
    )
    model = megabuf.DistributedDataParallel(branch_net_without_never(), cfg)

    def two_steps() -> None:
        for step in range(2):
            model.zero_grad_buffer()
            loss_of(model, step, dist.get_rank(), torch.float32).backward()
            model.finish_grad_sync()

    return error_of(two_steps)


def strict_mode_cost() -> dict[str, int]:
    """error_on_unused_params with every param used: the same collectives plus one all-reduce of
    dp_size x (number of trainable params) fp32 flags."""
    counts = {}
    for strict in (False, True):
        cfg = megabuf.DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size=1, error_on_unused_params=strict
        )
        model = megabuf.DistributedDataParallel(branch_net_without_never(), cfg)
        x, y = data(0, dist.get_rank())
        model.engine.collectives.stats.reset()
        ((model(x, True) - y) ** 2).mean().backward()  # every rank uses head_b
        model.finish_grad_sync()
        stats = model.engine.collectives.stats
        counts[f"calls_{strict}"] = stats.calls["all_reduce"]
        counts[f"bytes_{strict}"] = stats.input_nbytes["all_reduce"]
    counts["n_trainable"] = len(model.engine.param_to_name)
    return counts


def changed_after_wrap(change: str) -> str:
    net = branch_net_without_never()
    model = megabuf.DistributedDataParallel(net)
    if change == "replace":
        net.head_a.weight = nn.Parameter(net.head_a.weight.detach().clone())
    elif change == "freeze":
        net.head_a.bias.requires_grad_(False)
    elif change == "unfreeze":
        net.never.weight.requires_grad_(True)
    elif change == "add_param":
        net.head_a.extra = nn.Parameter(torch.zeros(3))
    elif change == "add_module":
        net.head_c = nn.Linear(DIM, 3)
    elif change == "remove":
        net.head_a.bias = None  # F.linear runs without it
    elif change == "add_parameterless_module":
        net.act = nn.Tanh()  # harmless: no param megabuf would miss
    loss = loss_of(model, 0, dist.get_rank(), torch.float32)
    # the check runs when the grad sync finishes: at the end of backward by default
    return error_of(lambda: (loss.backward(), model.finish_grad_sync()))


def reset_after_exception() -> dict[str, Any]:
    """Backward raises on every rank after some groups were dispatched; reset_iter_state()
    then the next iteration equals the reference."""
    torch.manual_seed(0)
    net = Stack(fail_point=True)
    ref = copy.deepcopy(net)
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    model = megabuf.DistributedDataParallel(net, cfg)
    rank, dp = dist.get_rank(), dist.get_world_size()
    for step in range(2):  # learn arrivals, so the failing iteration dispatches during backward
        model.zero_grad_buffer()
        loss_of(model, step, rank, torch.float32).backward()
        model.finish_grad_sync()
    model.zero_grad_buffer()
    _Raise.armed = True
    try:
        loss_of(model, 2, rank, torch.float32).backward()
        raised = "no error"
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        _Raise.armed = False
    states = sorted({g.grad_state.name for g in model.engine.all_bucket_groups})
    model.reset_iter_state()
    model.zero_grad_buffer()
    loss_of(model, 3, rank, torch.float32).backward()
    model.finish_grad_sync()
    reference_grads(ref, 3, dp, torch.float32)
    error = max(
        (p.grad - ref.get_parameter(n).grad).abs().max().item() for n, p in net.named_parameters()
    )
    return {"raised": raised, "states_after_exception": states, "error": error}


def fp16_reduce_scatter_no_overflow() -> dict[str, float]:
    """fp16 grads of 40000 on each of 2 ranks: their sum (80000) overflows fp16, the mean does
    not. The distributed optimizer's reduce-scatter must scale before summing."""
    net = nn.Linear(64, 1, bias=False).half()
    nn.init.zeros_(net.weight)  # forward stays 0; the weight's grad is x = 40000 everywhere
    cfg = megabuf.DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = megabuf.DistributedDataParallel(net, cfg)
    x = torch.full((1, 64), 40000.0, dtype=torch.float16)
    model(x).sum().backward()
    model.finish_grad_sync()
    buf = model.buffers[0]
    lo, hi = buf.shard_range(0)
    shard = buf.grad_data[lo:hi]
    return {"max": shard.float().abs().max().item(), "min": shard.float().abs().min().item()}


def one_chain_when_groups_match() -> dict[str, Any]:
    """ep_size 1: expert-parallel params reduce over the dp group itself, so dense and expert
    bucket groups share one dispatch chain."""
    net = branch_net_without_never()
    megabuf.mark_expert_parallel(net.head_b.parameters())
    ref = copy.deepcopy(net)
    pgs = megabuf.ProcessGroups.build(ep_size=1)
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=1)
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    errors = grad_errors_per_step(model, ref, steps=2)
    chains = {id(g.chain) for g in model.engine.all_bucket_groups}
    return {"chains": len(chains), "expert_groups": len(model.engine.expert_parallel_bucket_groups),
            "errors": errors}  # fmt: skip


def bf16_accumulate_after_sync() -> dict[str, float]:
    """bf16 params, fp32 grads: a second backward after finish_grad_sync() (no zero_grad_buffer)
    accumulates on top of the reduced grad, not on top of the exposed bf16 copy."""
    torch.manual_seed(0)
    net = Stack().to(torch.bfloat16)
    cfg = megabuf.DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = megabuf.DistributedDataParallel(net, cfg)
    rank, dp = dist.get_rank(), dist.get_world_size()
    loss_of(model, 0, rank, torch.bfloat16).backward()
    model.finish_grad_sync()
    first = {n: p.main_grad.clone() for n, p in net.named_parameters()}
    loss_of(model, 1, rank, torch.bfloat16).backward()
    model.finish_grad_sync()
    expected = reference_grads(copy.deepcopy(net), 1, dp, torch.bfloat16)
    # second reduction of (first + local grad): first is already averaged, so it maps to itself
    err = max(
        (p.main_grad - first[n] - expected[n]).abs().max().item() for n, p in net.named_parameters()
    )
    copy_ok = all(torch.equal(p.grad, p.main_grad.to(torch.bfloat16)) for p in net.parameters())
    return {"error": err, "copy_matches_main_grad": float(copy_ok)}


def step_without_backward(bf16: bool) -> bool:
    """A torch optimizer stepped after zero_grad_buffer() with no backward since: params stay as
    they were (the buffer still holds last iteration's grads, lazily zeroed)."""
    torch.manual_seed(0)
    net = Stack().to(torch.bfloat16 if bf16 else torch.float32)
    cfg = megabuf.DistributedDataParallelConfig(grad_reduce_in_fp32=bf16)
    model = megabuf.DistributedDataParallel(net, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, 0, dist.get_rank(), net.layers[0].weight.dtype).backward()
    model.finish_grad_sync()
    opt.step()
    before = [p.detach().clone() for p in net.parameters()]
    model.zero_grad_buffer()
    opt.step()
    return all(torch.equal(a, p) for a, p in zip(before, net.parameters()))


def broadcast_then_step(distributed: bool) -> dict[str, Any]:
    """Rank 0 edits its bf16 params through `.data` (invisible to version tracking), then
    `model.broadcast_params()`: every rank's fp32 main params must follow the broadcast values,
    or the next step would write the stale main params back over them."""
    torch.manual_seed(0)
    net = Stack().to(torch.bfloat16)
    cfg = megabuf.DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
    )
    model = megabuf.DistributedDataParallel(net, cfg)
    opt = megabuf.build_optimizer(
        model, megabuf.OptimizerConfig(optimizer="sgd", lr=1e-30, bf16=True)
    )
    if dist.get_rank() == 0:
        for p in net.parameters():
            p.data.copy_(torch.full_like(p, 0.5))
    model.broadcast_params()
    model.zero_grad_buffer()
    loss_of(model, 0, dist.get_rank(), torch.bfloat16).backward()
    model.finish_grad_sync()
    result = opt.step()  # lr 1e-30: params must stay exactly what was broadcast
    model.publish_params()
    return {
        "ok": result.update_successful,
        "all_half": all(bool((p == 0.5).all()) for p in net.parameters()),
    }


DIVERGENT: dict[str, dict[str, Any]] = {
    "sync_torch_sgd": {"optimizer": "sgd", "ddp": {}},
    "overlap_torch_sgd": {
        "optimizer": "sgd",
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 1},
    },
    "overlap_torch_adamw": {"optimizer": "adamw", "ddp": {"overlap_grad_reduce": True}},
    "overlap_bf16_torch_sgd": {
        "optimizer": "sgd",
        "bf16": True,
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 8, "grad_reduce_in_fp32": True},
    },
    "sync_megabuf_sgd": {"optimizer": "megabuf", "ddp": {}},
    "overlap_megabuf_sgd": {"optimizer": "megabuf", "ddp": {"overlap_grad_reduce": True}},
    "overlap_distopt_sgd": {
        "optimizer": "megabuf",
        "ddp": {"overlap_grad_reduce": True, "use_distributed_optimizer": True, "bucket_size": 1},
    },
}

SINGLE: dict[str, Callable[[], Any]] = {
    "reentrant_checkpointing": reentrant_checkpointing,
    "strict_unused": strict_unused,
    "replace": lambda: changed_after_wrap("replace"),
    "freeze": lambda: changed_after_wrap("freeze"),
    "unfreeze": lambda: changed_after_wrap("unfreeze"),
    "add_param": lambda: changed_after_wrap("add_param"),
    "add_module": lambda: changed_after_wrap("add_module"),
    "remove": lambda: changed_after_wrap("remove"),
    "add_parameterless_module": lambda: changed_after_wrap("add_parameterless_module"),
    "reset_after_exception": reset_after_exception,
    "fp16_reduce_scatter": fp16_reduce_scatter_no_overflow,
    "one_chain": one_chain_when_groups_match,
    "bf16_accumulate_after_sync": bf16_accumulate_after_sync,
    "step_without_backward_fp32": lambda: step_without_backward(False),
    "step_without_backward_bf16": lambda: step_without_backward(True),
    "strict_mode_cost": strict_mode_cost,
    "broadcast_then_step_mixed": lambda: broadcast_then_step(False),
    "broadcast_then_step_distopt": lambda: broadcast_then_step(True),
}


def run_divergent() -> dict[str, Any]:
    return run_each({name: (divergent_unused, case) for name, case in DIVERGENT.items()})


def run_single() -> dict[str, Any]:  # built rank-side: SINGLE holds lambdas
    return run_each({name: (fn,) for name, fn in SINGLE.items()})
