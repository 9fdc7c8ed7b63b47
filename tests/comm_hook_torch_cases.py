"""Rank side of tests/test_comm_hook_torch.py: torch DDP hooks through `from_torch` against torch
DDP itself, `CompressWrapper` against `Compress`, and the bounded hook wait ([Note: torch hooks
on megabuf buckets], [Note: bounded hook wait])."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from comm_hook_cases import Capture, _model, _moe_model, _moe_step, _raises, _reduced, _step
from grad_cases import Net, local_slice, loss_fn, make_data
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

from megabuf.comm_hooks import (
    Compress,
    CompressWrapper,
    GradBucket,
    Reduce,
    build,
    from_torch,
)
from megabuf.comm_hooks.contract import MODES


def _powersgd_state(**options: Any) -> ps.PowerSGDState:
    defaults = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "random_seed": 7}
    return ps.PowerSGDState(process_group=None, **{**defaults, **options})


def user_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch DDP checks annotations
    """A torch-style hook as users write them: divide, all-reduce, then a callback that hands
    back the bucket's buffer."""
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def bf16_on_gloo(state, bucket):  # type: ignore[no-untyped-def]  # torch DDP checks annotations
    """torch's bf16_compress_hook under another name: torch DDP refuses that name unless on
    CUDA/NCCL (a check by name; gloo reduces bf16 on the CPU fine). The torch DDP side only."""
    return dh.bf16_compress_hook(state, bucket)


TORCH_HOOKS: dict[str, tuple[Callable[..., Any], Callable[[], Any]]] = {
    "allreduce": (dh.allreduce_hook, lambda: None),
    "allreduce_world": (dh.allreduce_hook, lambda: dist.group.WORLD),
    "fp16": (dh.fp16_compress_hook, lambda: None),
    "bf16": (dh.bf16_compress_hook, lambda: None),
    "powersgd": (ps.powerSGD_hook, _powersgd_state),
    "powersgd_no_ef": (
        ps.powerSGD_hook,
        lambda: _powersgd_state(use_error_feedback=False, warm_start=False),
    ),
    "fp16_wrapper_powersgd": (dh.fp16_compress_wrapper(ps.powerSGD_hook), _powersgd_state),
    "user": (user_hook, lambda: None),
}


def _torch_step(ddp: Any, step: int) -> None:
    x, y = make_data(step)
    loss_fn(ddp(local_slice(x)), local_slice(y)).backward()


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, t in a.items():
        scale = t.abs().max().item() + 1e-30
        worst = max(worst, (t - b[name]).abs().max().item() / scale)
    return worst


def vs_torch_case(hook: str, config: dict[str, Any], steps: int = 5) -> dict[str, Any]:
    """The same torch hook (fresh state each side) in torch DDP (one bucket) and through
    from_torch in megabuf (`config`): grads every step and params after each SGD step."""
    fn, make_state = TORCH_HOOKS[hook]
    net = Net()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=100)
    ref.register_comm_hook(make_state(), bf16_on_gloo if fn is dh.bf16_compress_hook else fn)
    model = _model(net, from_torch(fn, make_state()), **config)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads_same, params_same, worst = [], [], 0.0
    for step in range(steps):
        opt_ref.zero_grad()
        model.zero_grad_buffer()
        _torch_step(ref, step)
        _step(model, step)
        g_ref, g = _grads(ref.module), _grads(model.module)
        grads_same.append(g_ref.keys() == g.keys() and all(torch.equal(g_ref[n], g[n]) for n in g))
        worst = max(worst, _max_rel(g_ref, g))
        opt_ref.step()
        opt.step()
        p_ref, p = dict(ref.module.named_parameters()), dict(model.module.named_parameters())
        params_same.append(all(torch.equal(p_ref[n], p[n]) for n in p))
    n_buckets = sum(len(b.buckets) for b in model.buffers)
    return {"grads_same": grads_same, "params_same": params_same, "worst_rel": worst,
            "n_buckets": n_buckets}  # fmt: skip


class _InFlight:
    """A torch hook wrapper counting, at each call, this hook's earlier Futures not yet done."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.futures: list[Any] = []
        self.busy_at_call: list[int] = []
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, state: Any, bucket: Any) -> Any:
        self.busy_at_call.append(sum(not f.done() for f in self.futures))
        self.calls.append((bucket.index(), bucket.is_last()))
        fut = self.fn(state, bucket)
        self.futures.append(fut)
        return fut


def multi_bucket_powersgd_case(overlap: bool) -> dict[str, Any]:
    """powerSGD_hook over several buckets and groups, overlap on or off: at most one torch
    Future in flight when a hook is called, is_last once per step, and the grads (identical on
    every rank) for comparison across overlap on/off."""
    spy = _InFlight(ps.powerSGD_hook)
    cfg = {"bucket_size": 64, "overlap_grad_reduce": overlap}
    model = _model(Net(), from_torch(spy, _powersgd_state(start_powerSGD_iter=2)), **cfg)
    for step in range(5):
        _step(model, step)
    mine = _reduced(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    n = len(model.engine.all_bucket_groups)
    n_buckets = sum(len(g.buckets) for g in model.engine.all_bucket_groups)
    per_step = [spy.calls[i : i + n_buckets] for i in range(0, len(spy.calls), n_buckets)]
    return {
        "busy_at_call": spy.busy_at_call,
        "last_flags": [[last for _, last in calls] for calls in per_step],
        "same_on_all_ranks": all(torch.equal(mine, t) for t in everyone),
        "grads": mine,
        "n_groups": n,
        "n_buckets": n_buckets,
    }


def is_last_case(ep: int) -> dict[str, Any]:
    """MoE model (dense + expert buffers, several bucket groups, overlap on): which calls see
    is_last(), per adapter, over 3 steps; ep=2 needs one adapter per group and allow_prescale
    for the expert buffers (scaled 1/dp, reduced over expt_dp). Grads vs no hook."""
    pgs_model = _moe_model(ep, overlap_grad_reduce=True)
    spies = {"all": _InFlight(dh.allreduce_hook)} if ep == 1 else {
        "dense": _InFlight(dh.allreduce_hook), "expert": _InFlight(dh.allreduce_hook)
    }  # fmt: skip
    model = _moe_model(ep, overlap_grad_reduce=True)
    pgs = model.process_groups
    for kind, spy in spies.items():
        group = pgs.expt_dp if kind == "expert" else pgs.dp
        model.register_comm_hook(from_torch(spy, group, allow_prescale=ep > 1), buffers=kind)
    for step in range(3):
        _moe_step(pgs_model, step)
        _moe_step(model, step)
    same = all(
        torch.equal(a.grad_data, b.grad_data)
        for a, b in zip(
            pgs_model.buffers + pgs_model.engine.expert_parallel_buffers,
            model.buffers + model.engine.expert_parallel_buffers,
            strict=True,
        )
    )
    return {kind: [last for _, last in spy.calls] for kind, spy in spies.items()} | {
        "same_as_no_hook": same,
        "n_groups": len(model.engine.all_bucket_groups),
    }


def _resizing_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """Handles its buffer as torch's batched_powerSGD_hook does: pads it in place with
    resize_, zero-fills the padding, reduces, resizes back."""
    buffer = bucket.buffer()
    numel = buffer.numel()
    buffer.resize_(numel + 100)
    buffer[numel:].fill_(0.0)
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda f: buffer.resize_(numel))


def batched_case() -> dict[str, Any]:
    """A hook that resizes its buffer (copy_buffer=True), and batched_powerSGD_hook before its
    start_powerSGD_iter (its all-reduce path; torch 2.13's compressed path raises an
    AssertionError in torch DDP too: it hands a 2-D matrix to its 3-D `_orthogonalize`), on
    several buckets: bitwise no hook, so no bucket wrote into its neighbour."""
    net = Net()
    cfg = {"bucket_size": 64, "overlap_grad_reduce": True}
    plain = _model(net, **cfg)
    resizing = _model(net, from_torch(_resizing_hook, copy_buffer=True), **cfg)
    batched = _model(
        net, from_torch(ps.batched_powerSGD_hook, _powersgd_state(start_powerSGD_iter=10)), **cfg
    )
    same = []
    for step in range(2):
        for model in (plain, resizing, batched):
            _step(model, step)
        want = _reduced(plain)
        same.append([torch.equal(want, _reduced(resizing)), torch.equal(want, _reduced(batched))])
    return {"same": same, "n_buckets": sum(len(b.buckets) for b in plain.buffers)}


# ---- CompressWrapper ---------------------------------------------------------------------------
def wrapper_case(config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """CompressWrapper(Reduce(), dtype) vs Compress(dtype, "wire"): bitwise, 2 steps; and the
    inner hook saw `dtype` buckets with the layout (gradients() views into the copy)."""
    net = Net()
    inner = Capture(Reduce())
    wrapped = _model(net, CompressWrapper(inner, dtype), **config)
    direct = _model(net, Compress(dtype, "wire"), **config)
    plain = _model(net, **config)
    same = []
    for step in range(2):
        for model in (wrapped, direct, plain):
            _step(model, step)
        same.append(torch.equal(_reduced(wrapped), _reduced(direct)))
    low = inner.buckets
    views_ok = all(
        g.dtype == dtype and g.data_ptr() == b.data[o:].data_ptr()
        for b in low
        for g, o in zip(b.gradients(), b.param_offsets(), strict=True)
    )
    return {
        "same": same,
        "differs_from_fp32": not torch.equal(_reduced(wrapped), _reduced(plain)),
        "inner_dtypes": sorted({str(b.data.dtype) for b in low}),
        "views_ok": views_ok,
        "n_buckets": len(low),
        "shards": all((b.shard is not None) == (b.mode == "reduce_scatter") for b in low),
    }


def wrapper_config_case(config: dict[str, Any]) -> dict[str, Any]:
    """comm_hook = {name = "compress_wrapper", inner = "reduce"} == the hook built by hand."""
    spec = {"name": "compress_wrapper", "inner": "reduce", "dtype": "bfloat16"}
    net = Net()
    from_config = _model(net, comm_hook=spec, **config)
    by_hand = _model(net, CompressWrapper(Reduce(), torch.bfloat16), **config)
    _step(from_config, 0)
    _step(by_hand, 0)
    names = sorted({getattr(g.comm_hook, "name", "") for g in from_config.engine.all_bucket_groups})
    return {"same": torch.equal(_reduced(from_config), _reduced(by_hand)), "names": names}


# ---- the bounded wait --------------------------------------------------------------------------
class _NeverDone:
    """Returns a torch Future nobody completes."""

    name = "NeverDone"
    modes = MODES

    def __call__(self, bucket: GradBucket) -> Any:
        return torch.futures.Future()


class _NeverDoneLater:
    """Stage one all-reduces (completes); stage two yields a Future nobody completes."""

    name = "NeverDoneLater"
    modes = MODES

    def __call__(self, bucket: GradBucket) -> Any:
        yield bucket.collectives.all_reduce(bucket.data, bucket.group)
        yield torch.futures.Future()


def _never_done_torch(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    return torch.futures.Future()


def _timeout_then_recover(hook: Any) -> tuple[str, str] | None:
    """One step with a hook that never completes: the error (checked by the test); then
    reset_iter_state() must not raise or hang (the failed hook is closed)."""
    model = _model(Net(), hook, comm_hook_timeout_s=0.2, sync_grads_at_backward_end=False)
    got = _raises(lambda: _step(model, 0))
    model.reset_iter_state()
    return got


def timeout_case() -> dict[str, Any]:
    return {
        "first_return": _timeout_then_recover(_NeverDone()),
        "later_stage": _timeout_then_recover(_NeverDoneLater()),
        "torch_future": _timeout_then_recover(from_torch(_never_done_torch)),
    }


# ---- named errors ------------------------------------------------------------------------------
def _wrong_shape(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer()[:-1].clone())
    return fut


def _wrong_shape_step() -> None:
    model = _model(Net(), from_torch(_wrong_shape), sync_grads_at_backward_end=False)
    try:
        _step(model, 0)
    finally:
        model.reset_iter_state()


def errors_case() -> dict[str, Any]:
    pgs = _moe_model(2).process_groups  # expt_dp: one rank each at dp=2, ep=2
    bf16 = Net().to(torch.bfloat16)
    rs = {"use_distributed_optimizer": True}
    return {
        "rs_allreduce": _raises(lambda: _model(Net(), from_torch(dh.allreduce_hook), **rs)),
        "rs_bf16": _raises(lambda: _model(Net(), from_torch(dh.bf16_compress_hook), **rs)),
        "wrong_group": _raises(
            lambda: _model(Net(), from_torch(ps.powerSGD_hook, _powersgd_state_on(pgs.expt_dp)))
        ),
        "expert_on_world": _raises(
            lambda: _moe_model(2, from_torch(dh.allreduce_hook, None), "expert")
        ),
        "two_groups": _raises(lambda: _moe_model(2, from_torch(dh.allreduce_hook), "all")),
        "scaling": _raises(
            lambda: _moe_model(2, from_torch(dh.allreduce_hook, pgs.expt_dp), "expert")
        ),
        "wrong_shape": _raises(_wrong_shape_step),
        "wrap_same_dtype": _raises(lambda: _model(bf16, CompressWrapper(Reduce()))),
        "wrap_fp16_on_bf16": _raises(
            lambda: _model(bf16, CompressWrapper(Reduce(), torch.float16))
        ),
        "wrap_torch": _raises(lambda: CompressWrapper(from_torch(dh.allreduce_hook))),
        "wrap_bad_dtype": _raises(lambda: CompressWrapper(Reduce(), torch.float32)),
        "build_wrapper": type(
            build({"name": "compress_wrapper", "inner": {"name": "reduce"}})
        ).__name__,
    }


def _powersgd_state_on(group: Any) -> ps.PowerSGDState:
    return ps.PowerSGDState(process_group=group, start_powerSGD_iter=2)
