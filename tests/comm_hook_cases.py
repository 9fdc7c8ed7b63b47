"""Rank side of tests/test_comm_hooks.py ([Note: comm hook contract]): the same model and global
batch with and without a hook, and against a single-process emulation of the hook's rounding."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from grad_cases import Net, local_slice, loss_fn, make_data

import megabuf
from megabuf.comm_hooks import Compress, GradBucket, Noop, Reduce

BF16_U = 2.0**-8  # bf16 unit roundoff


class Capture:
    """Wraps a hook: keeps a copy of each bucket's pre-scaled data as the hook received it, and
    counts calls."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.modes = inner.modes
        self.name = f"Capture({getattr(inner, 'name', type(inner).__name__)})"
        self.seen: dict[int, torch.Tensor] = {}
        self.calls = 0

    def setup(self, buckets: list[GradBucket]) -> None:
        self.buckets = buckets
        if hasattr(self.inner, "setup"):
            self.inner.setup(buckets)

    def __call__(self, bucket: GradBucket) -> Any:
        self.calls += 1
        self.seen[bucket.index] = bucket.data.clone()
        return self.inner(bucket)


def _model(net: torch.nn.Module, hook: Any = None, **config: Any) -> Any:
    cfg = megabuf.DistributedDataParallelConfig(**config)
    model = megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)
    if hook is not None:
        model.register_comm_hook(hook)
    return model


def _step(model: Any, step: int, *, finish: bool = True) -> None:
    model.zero_grad_buffer()
    x, y = make_data(step)
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    if finish:
        model.finish_grad_sync()


def _reduced(model: Any) -> torch.Tensor:
    return _reduced_of(model.buffers + model.engine.expert_parallel_buffers)


def _reduced_of(buffers: list[Any]) -> torch.Tensor:
    """This rank's reduced grads: every buffer whole, or its shard of every bucket (the rest of
    a reduce-scatter bucket is undefined, [Note: comm hook contract])."""
    parts = []
    for buffer in buffers:
        if buffer.param_data is None:
            parts.append(buffer.grad_data)
            continue
        parts += [buffer.grad_data[slice(*buffer.shard_range(b.bucket_id))] for b in buffer.buckets]
    return torch.cat(parts)


def reduce_case(config: dict[str, Any]) -> dict[str, Any]:
    """The Reduce hook vs no hook, 3 steps: the reduced grads bitwise, every step."""
    net = Net()
    plain, hooked = _model(net, **config), _model(net, Reduce(), **config)
    same = []
    for step in range(3):
        _step(plain, step)
        _step(hooked, step)
        same.append(torch.equal(_reduced(plain), _reduced(hooked)))
    n_buckets = sum(len(b.buckets) for b in hooked.buffers)
    return {"same": same, "n_buckets": n_buckets, "hooked": _hook_attached(hooked)}


def _hook_attached(model: Any) -> bool:
    return all(g.comm_hook is not None for g in model.engine.all_bucket_groups)


def _emulate(seen: list[torch.Tensor], accumulate: str, mode: str) -> torch.Tensor:
    """Every rank's pre-scaled bucket (rank order) -> what Compress(bf16) leaves in `data`
    ([Note: low-precision wire, fp32 sum]); at dp=2 the order of a sum does not matter."""
    low = [s.bfloat16() for s in seen]
    if accumulate == "wire":
        total = low[0]
        for t in low[1:]:
            total = total + t  # one bf16 rounding per add (torch and gloo: fp32 add, round)
        return total.float()
    fp32 = low[0].float()
    for t in low[1:]:
        fp32 = fp32 + t.float()
    return fp32 if mode == "reduce_scatter" else fp32.bfloat16().float()


def compress_case(config: dict[str, Any], accumulate: str) -> dict[str, Any]:
    """Compress(bf16, accumulate) vs (a) a single-process emulation of its rounding from every
    rank's pre-scaled buckets: bitwise; (b) the fp32 reduction of the same grads: within
    2u(|g_0| + ... ) per element (a cast per rank, one rounding of the sum)."""
    net = Net()
    hook = Capture(Compress(torch.bfloat16, accumulate))
    plain, hooked = _model(net, **config), _model(net, hook, **config)
    _step(plain, 0)
    _step(hooked, 0)
    world, bitwise, ratio = dist.get_world_size(), True, 0.0
    for bucket in hook.buckets:
        mine = hook.seen[bucket.index]
        seen = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(seen, mine)
        lo, hi = bucket.shard_range if bucket.shard is not None else (0, mine.numel())
        want = _emulate(seen, accumulate, bucket.mode)[lo:hi]
        bitwise &= torch.equal(bucket.target, want)
        exact = sum(s.double() for s in seen)[lo:hi]
        bound = 2 * BF16_U * sum(s.double().abs() for s in seen)[lo:hi] + 1e-30
        ratio = max(ratio, ((bucket.target.double() - exact).abs() / bound).max().item())
    return {
        "bitwise": bitwise,
        "bound_ratio": ratio,
        "differs_from_fp32": not torch.equal(_reduced(plain), _reduced(hooked)),
        "calls": hook.calls,
        "n_buckets": len(hook.buckets),
    }


def noop_case() -> dict[str, Any]:
    """Noop: warns once over several steps, communicates nothing, leaves the local pre-scaled
    grads."""
    hook = Capture(Noop())
    model = _model(Net(), hook, bucket_size=64, overlap_grad_reduce=True)
    model.engine.collectives.stats.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            _step(model, step)
    noop_warnings = [w for w in caught if "Noop" in str(w.message)]
    local = all(torch.equal(b.data, hook.seen[b.index]) for b in hook.buckets)
    return {
        "warnings": len(noop_warnings),
        "category": noop_warnings[0].category.__name__ if noop_warnings else None,
        "local": local,
        "calls": dict(model.engine.collectives.stats.calls),
    }


def overlap_case(config: dict[str, Any]) -> dict[str, Any]:
    """overlap_grad_reduce with a two-stage hook (Compress fp32 all-reduce: all-to-all, then
    all-gather): after the learning step, what was issued before backward returned, and after
    finish_grad_sync."""
    hook = Capture(Compress(torch.bfloat16, "fp32"))
    cfg = {"overlap_grad_reduce": True, "sync_grads_at_backward_end": False, **config}
    model = _model(Net(), hook, **cfg)
    _step(model, 0)  # the learning iteration dispatches at finish ([Note: grad readiness])
    stats = model.engine.collectives.stats
    stats.reset()
    hook.calls = 0
    _step(model, 1, finish=False)
    at_backward_end = {
        "hook_calls": hook.calls,
        "all_to_all": stats.calls.get("all_to_all", 0),
        "all_gather": stats.calls.get("all_gather", 0),
        "dispatched": sum(
            g.grad_state.name == "DISPATCHED" for g in model.engine.all_bucket_groups
        ),
    }
    model.finish_grad_sync()
    return {
        "at_backward_end": at_backward_end,
        "after_finish": {"hook_calls": hook.calls, **dict(stats.calls)},
        "n_buckets": len(hook.buckets),
        "n_groups": len(model.engine.all_bucket_groups),
    }


def _raises(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:  # the test checks the class and the message
        return type(exc).__name__, str(exc)
    return None


class _AllReduceOnly(Reduce):
    name = "AllReduceOnly"
    modes = frozenset({"all_reduce"})


class _WrongShape:
    name = "WrongShape"
    modes = frozenset({"all_reduce", "reduce_scatter"})

    def __call__(self, bucket: GradBucket) -> torch.Tensor:
        return torch.zeros(bucket.target.numel() + 1)


class _YieldsJunk:
    name = "YieldsJunk"
    modes = frozenset({"all_reduce", "reduce_scatter"})

    def __call__(self, bucket: GradBucket) -> Any:
        yield 42


def _finish_with(hook: Any) -> None:
    """One step with `hook`; its error is re-raised after checking that reset_iter_state()
    recovers (it waits for the failed work again, which must not raise twice)."""
    model = _model(Net(), hook, sync_grads_at_backward_end=False)
    try:
        _step(model, 0)
    except Exception:
        try:
            model.reset_iter_state()
        except Exception as exc:
            raise RuntimeError(f"reset_iter_state() after a hook error raised: {exc}") from exc
        raise


def _after_backward() -> None:
    model = _model(Net())
    _step(model, 0)
    model.register_comm_hook(Reduce())


def _twice() -> None:
    model = _model(Net(), Reduce())
    model.register_comm_hook(Compress(torch.bfloat16), buffers="dense")


def errors_case() -> dict[str, Any]:
    """Every named error of registration and of a hook's result."""
    bf16 = Net().to(torch.bfloat16)
    return {
        "twice": _raises(_twice),
        "after_backward": _raises(_after_backward),
        "mode": _raises(lambda: _model(Net(), _AllReduceOnly(), use_distributed_optimizer=True)),
        "no_modes": _raises(lambda: _model(Net(), lambda bucket: None)),
        "bad_buffers": _raises(lambda: _model(Net()).register_comm_hook(Reduce(), buffers="x")),
        "no_expert_buffers": _raises(
            lambda: _model(Net()).register_comm_hook(Reduce(), buffers="expert")
        ),
        "wrong_shape": _raises(lambda: _finish_with(_WrongShape())),
        "yields_junk": _raises(lambda: _finish_with(_YieldsJunk())),
        "bf16_to_bf16": _raises(lambda: _model(bf16, Compress(torch.bfloat16))),
        "fp16_on_bf16": _raises(lambda: _model(bf16, Compress(torch.float16))),
        "bad_dtype": _raises(lambda: Compress(torch.float32)),
        # allowed: bf16 params with fp32 grads (grad_reduce_in_fp32) compress to bf16
        "bf16_fp32_grads": _raises(
            lambda: _model(bf16, Compress(torch.bfloat16), grad_reduce_in_fp32=True)
        ),
    }


# ---- expert buffers, and the hook from the config ------------------------------------------------
def _moe_model(ep: int, hook: Any = None, buffers: str = "all", **config: Any) -> Any:
    from moe_cases import CFG, groups

    from megabuf.testing.moe import MoEModel

    pgs = groups(ep_size=ep)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(bucket_size=256, **config)
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    if hook is not None:
        model.register_comm_hook(hook, buffers=buffers)
    return model


def _moe_step(model: Any, step: int) -> None:
    from moe_cases import run_step

    model.zero_grad_buffer()
    run_step(model, step, per_token=False)


def _dense_and_expert(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's reduced dense and expert grads (whole buffers, or shards)."""
    return _reduced_of(model.buffers), _reduced_of(model.engine.expert_parallel_buffers)


def expert_case(ep: int, config: dict[str, Any]) -> dict[str, Any]:
    """MoE model (dense + expert buffers): Reduce on all buffers is bitwise no hook; Compress on
    the expert buffers only leaves the dense grads bitwise and changes the expert ones; every
    expert bucket reduces over expt_dp."""
    plain = _moe_model(ep, **config)
    reduce_all = _moe_model(ep, Capture(Reduce()), "all", **config)
    expert_only = Capture(Compress(torch.bfloat16))
    compressed = _moe_model(ep, expert_only, "expert", **config)
    for model in (plain, reduce_all, compressed):
        for step in range(2):
            _moe_step(model, step)
    (d0, e0), (d1, e1), (d2, e2) = map(_dense_and_expert, (plain, reduce_all, compressed))
    expt_dp = compressed.process_groups.expt_dp
    two_kinds = _moe_model(ep, Reduce(), "dense", **config)
    two_kinds.register_comm_hook(Compress(torch.bfloat16), buffers="expert")  # not "twice"
    return {
        "two_kinds": sorted(
            {type(g.comm_hook).__name__ for g in two_kinds.engine.all_bucket_groups}
        ),
        "reduce_same": torch.equal(d0, d1) and torch.equal(e0, e1),
        "dense_same": torch.equal(d0, d2),
        "expert_changed": not torch.equal(e0, e2),
        "expert_close": bool((e0 - e2).abs().max() <= 2**-7 * e0.abs().max()),
        "expert_views": [b.expert for b in expert_only.buckets],
        "groups_ok": all(
            b.group is expt_dp and b.group_size == dist.get_world_size(expt_dp)
            for b in expert_only.buckets
        ),
        "dense_hooked": [g.comm_hook is not None for g in compressed.engine.bucket_groups],
        "n_expert_buckets": len(expert_only.buckets),
    }


def config_case(config: dict[str, Any]) -> dict[str, Any]:
    """comm_hook from the config == the same hook registered by hand, bitwise."""
    net = Net()
    spec = {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32", "buffers": "dense"}
    from_config = _model(net, comm_hook=spec, **config)
    by_hand = _model(net, Compress(torch.bfloat16, "fp32"), **config)
    _step(from_config, 0)
    _step(by_hand, 0)
    hooks = [g.comm_hook for g in from_config.engine.all_bucket_groups]
    return {
        "hooks": sorted({getattr(h, "name", None) for h in hooks}),
        "same": torch.equal(_reduced(from_config), _reduced(by_hand)),
    }
