"""Rank side of tests/test_powersgd.py ([Note: PowerSGD in megabuf]): PowerSGD against torch's
`powerSGD_hook` on torch DDP, against exact reductions, its error-feedback invariant, its
reduce-scatter mode against its all-reduce mode, skipped steps, state round trips."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from comm_hook_cases import Capture, _dense_and_expert, _moe_model, _moe_step
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

import megabuf
from megabuf.comm_hooks import BatchedPowerSGD, GradBucket, PowerSGD, Reduce
from megabuf.optimizer.grad_scaler import DynamicGradScaler

BATCH, DIM = 16, 16
LR = 0.1


class Mlp(nn.Module):
    """Compressible matrices of three shapes (two of one shape, for batching) and 1-D biases."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, 24)
        self.l2 = nn.Linear(24, 24)
        self.l3 = nn.Linear(24, 24)
        self.l4 = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        return self.l4(torch.tanh(self.l3(h)))


class Aligned(nn.Module):
    """Every param a multiple of 128 elements: the RS layout (params at multiples of 64,
    buckets padded to multiples of 128) is the AR layout, so whole-bucket hooks compare."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, 32, bias=False)
        self.l2 = nn.Linear(32, 32, bias=False)
        self.l4 = nn.Linear(32, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l4(torch.tanh(self.l2(torch.tanh(self.l1(x)))))[:, :5]


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 5, generator=g)
    n = BATCH // dist.get_world_size()
    lo = dist.get_rank() * n
    return x[lo : lo + n], y[lo : lo + n]


def _loss(model: Any, step: int, scale: float = 1.0) -> torch.Tensor:
    x, y = _data(step)
    return torch.nn.functional.mse_loss(model(x), y) * scale


def _engine(net: nn.Module, hook: Any = None, **config: Any) -> Any:
    cfg = megabuf.DistributedDataParallelConfig(**config)
    model = megabuf.DistributedDataParallel(copy.deepcopy(net), cfg)
    if hook is not None:
        model.register_comm_hook(hook)
    return model


def _backward(model: Any, step: int) -> None:
    model.zero_grad_buffer()
    _loss(model, step).backward()
    model.finish_grad_sync()


def _sgd(model: Any) -> None:
    with torch.no_grad():
        for p in model.module.parameters():
            p.sub_(p.main_grad, alpha=LR)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _grads(model: Any) -> torch.Tensor:
    return torch.cat([p.main_grad.reshape(-1) for p in model.module.parameters()])


def _params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# ---- torch parity ----------------------------------------------------------------------------
class TorchSeeded(PowerSGD):
    """PowerSGD drawing each Q's seed as torch's hook does (numpy's legacy generator), so Q is
    torch's: the rest of the algorithm is megabuf's own."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._numpy = np.random.RandomState(self.seed)

    def _next_seed(self) -> int:
        return int(self._numpy.randint(1_000_000_000))


def torch_parity_case(rank: int, ef: bool, warm: bool, batch: bool, steps: int = 8) -> Any:
    """torch DDP + powerSGD_hook vs megabuf + PowerSGD, one bucket each, start at step 2 (after
    torch's bucket rebuild), SGD on the reduced grads: grads and params every step."""
    torch.manual_seed(0)
    net = Mlp()
    names = {id(p): n for n, p in net.named_parameters()}
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=1000)
    state = torch_psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
        use_error_feedback=ef, warm_start=warm, random_seed=0,
        batch_tensors_with_same_shape=batch,
    )  # fmt: skip
    torch_order: list[list[str]] = []
    copies = {id(p): names[id(q)] for p, q in zip(ref.module.parameters(), net.parameters())}

    def hook(st, bucket):  # type: ignore[no-untyped-def]  (torch checks these annotations)
        torch_order.append([copies[id(p)] for p in bucket.parameters()])
        return torch_psgd.powerSGD_hook(st, bucket)

    ref.register_comm_hook(state, hook)
    mine = TorchSeeded(rank=rank, start_step=2, error_feedback=ef, warm_start=warm,
                       batch_same_shape=batch)  # fmt: skip
    model = _engine(net, mine)
    grad_err, param_err = [], []
    for step in range(steps):
        ref.zero_grad()
        _loss(ref, step).backward()
        _backward(model, step)
        ref_grads = torch.cat([p.grad.reshape(-1) for p in ref.module.parameters()])
        grad_err.append(_rel(_grads(model), ref_grads))
        with torch.no_grad():
            for p in ref.module.parameters():
                p.sub_(p.grad, alpha=LR)
        _sgd(model)
        param_err.append(_rel(_params(model.module), _params(ref.module)))
    plan = mine._state[0].plan
    bucket_names = mine._buckets[0].param_names
    compressed = [bucket_names[i] for i in plan.compressed]
    return {
        "grad_err": grad_err,
        "param_err": param_err,
        "torch_order": [n for n in torch_order[-1] if n.endswith("weight")],
        "megabuf_order": compressed,
        "n_units": len(plan.units),
        "torch_buckets": len({len(o) for o in torch_order[-1:]}),
        "changed": _rel(ref_grads, _reduce_only(net, steps - 1)) > 1e-3,
    }


def _reduce_only(net: nn.Module, step: int) -> torch.Tensor:
    """The exact mean grad of `net` at `step` (not the trained params: just a scale check)."""
    model = _engine(net)
    _backward(model, step)
    return _grads(model)


# ---- exact cases: full rank, invariant, RS vs AR ---------------------------------------------
def fullrank_case(config: dict[str, Any], hook_cls: str = "PowerSGD", steps: int = 3) -> Any:
    """rank >= min(n, m) and min_compression_rate=0 (BatchedPowerSGD: rank >= side): the
    projection is exact, so the result equals the exact reduction (Reduce)."""
    torch.manual_seed(0)
    net = Mlp()
    if hook_cls == "PowerSGD":
        hook: Any = PowerSGD(rank=64, start_step=0, min_compression_rate=0.0)
    else:
        hook = BatchedPowerSGD(rank=10_000, start_step=0)
    model, exact = _engine(net, Capture(hook), **config), _engine(net, **config)
    errs = []
    for step in range(steps):
        _backward(model, step)
        _backward(exact, step)
        errs.append(max(_rel(b, e) for b, e in zip(_targets(model), _targets(exact))))
    return {
        "errs": errs,
        "calls": model.comm_hooks()["dense"].calls,
        "n_buckets": len(_targets(model)),
    }


def _targets(model: Any) -> list[torch.Tensor]:
    """Every bucket's reduced part on this rank: data (AR) or the shard (RS)."""
    out = []
    for buffer in model.buffers + model.engine.expert_parallel_buffers:
        for b in buffer.buckets:
            if buffer.param_data is None:
                out.append(b.grad_data)
            else:
                out.append(buffer.grad_data[slice(*buffer.shard_range(b.bucket_id))])
    return out


def _error_flat(hook: Any, bucket: GradBucket, per_rank: dict[str, torch.Tensor]) -> torch.Tensor:
    """A bucket-shaped tensor of the residuals in `per_rank` (zeros elsewhere)."""
    flat = torch.zeros_like(bucket.data)
    base = bucket.data.storage_offset()
    for p, name, g in zip(bucket.params, bucket.param_names, bucket.gradients(), strict=True):
        error = per_rank.get(f"error/{name}")
        if error is not None:
            off = g.storage_offset() - base
            flat[off : off + p.numel()] = error.reshape(-1)
    return flat


def invariant_case(config: dict[str, Any], rank: int = 1, steps: int = 4) -> Any:
    """Every step, per bucket: sum_r (data_r + old e_r) = result + sum_r (new e_r), on the
    target elements (the whole bucket in AR mode, the shard in RS mode); and the residual is
    nonzero (compression did lose something)."""
    torch.manual_seed(0)
    hook = PowerSGD(rank=rank, start_step=1)
    cap = Capture(hook)
    model = _engine(Mlp(), cap, **config)
    group = None
    errs, nonzero = [], []
    for step in range(steps):
        old = hook.state_dict()["per_rank"]
        _backward(model, step)
        new = hook.state_dict()["per_rank"]
        worst = 0.0
        for bucket in cap.buckets:
            lhs = cap.seen[bucket.index] + _error_flat(hook, bucket, old)
            new_sum = _error_flat(hook, bucket, new)
            dist.all_reduce(lhs, group=group)
            dist.all_reduce(new_sum, group=group)
            lo, hi = bucket.shard_range if bucket.shard is not None else (0, lhs.numel())
            want = lhs[lo:hi] - new_sum[lo:hi]
            if bucket.average:  # the result is the mean: sum_r (M_r - e_r') / d
                want /= bucket.group_size
            worst = max(worst, _rel(bucket.target, want))
        errs.append(worst)
        nonzero.append(sum(float(e.abs().sum()) for e in new.values()) > 0)
    return {"errs": errs, "nonzero": nonzero, "n_buckets": len(cap.buckets)}


def rs_vs_ar_case(
    config: dict[str, Any], hook_cls: str = "PowerSGD", steps: int = 4,
    options: dict[str, Any] | None = None,
) -> Any:  # fmt: skip
    """The same hook in RS and AR mode on the same grads (no update): each rank's shard equals
    the matching elements of the AR result, every step; some compressed matrix straddles a
    shard boundary. BatchedPowerSGD runs on `Aligned` (same bucket layout in both modes)."""
    torch.manual_seed(0)
    net: nn.Module = Mlp() if hook_cls == "PowerSGD" else Aligned()

    def make() -> Any:
        if hook_cls == "PowerSGD":
            return PowerSGD(rank=2, start_step=1, **(options or {}))
        return BatchedPowerSGD(rank=2, start_step=1, **(options or {}))

    ar_hook, rs_hook = make(), make()
    ar = _engine(net, ar_hook, **config)
    rs = _engine(net, rs_hook, use_distributed_optimizer=True, **config)
    ar_grads = dict(ar.module.named_parameters())
    errs = []
    for step in range(steps):
        _backward(ar, step)
        _backward(rs, step)
        worst = 0.0
        for r in rs_hook._buckets.values():
            lo, hi = r.shard_range
            base = r.data.storage_offset()
            for name, g in zip(r.param_names, r.gradients(), strict=True):
                off = g.storage_offset() - base
                a, b = max(lo, off), min(hi, off + g.numel())
                if b > a:
                    want = ar_grads[name].main_grad.reshape(-1)[a - off : b - off]
                    worst = max(worst, _rel(g.reshape(-1)[a - off : b - off], want))
        errs.append(worst)
    numels = [[b.data.numel() for b in h._buckets.values()] for h in (ar_hook, rs_hook)]
    return {"errs": errs, "straddles": _straddles(rs_hook), "numels": numels}


def _straddles(hook: Any) -> bool:
    """A compressed matrix has elements on both sides of some shard boundary (mid-row)."""
    if not isinstance(hook, PowerSGD):
        return True  # one matrix per bucket: every shard boundary falls inside it
    for index, st in hook._state.items():
        bucket = hook._buckets[index]
        size = bucket.data.numel() // bucket.group_size
        for unit in st.plan.units:
            for i in unit.members:
                off, numel = st.offsets[i], unit.n * unit.m
                if any(off < k * size < off + numel and (k * size - off) % unit.m for k in
                       range(1, bucket.group_size)):  # fmt: skip
                    return True
    return False


def q_identical_case(config: dict[str, Any]) -> Any:
    """After a few steps, every replicated entry of the state (Q per matrix, rng, step) is
    bitwise the same on every rank."""
    torch.manual_seed(0)
    hook = PowerSGD(rank=2, start_step=0, batch_same_shape=True)
    model = _engine(Mlp(), hook, **config)
    for step in range(3):
        _backward(model, step)
    replicated = hook.state_dict()["replicated"]
    same = True
    for value in replicated.values():
        t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        t = t.double() if t.dtype != torch.uint8 else t.to(torch.float64)
        gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, t)
        same &= all(torch.equal(g, gathered[0]) for g in gathered)
    return {"same": same, "q_keys": sorted(k for k in replicated if k.startswith("q/"))}


def no_sync_case(config: dict[str, Any]) -> Any:
    """3 micro-batches (2 under no_sync): the hook runs once per bucket, on the accumulated
    buffer (bitwise the accumulated buffer of a model without hook), and counts one step."""
    torch.manual_seed(0)
    net = Mlp()
    hook = PowerSGD(rank=1, start_step=0)
    cap = Capture(hook)
    model, plain = _engine(net, cap, **config), _engine(net, Capture(Reduce()), **config)
    for m in (model, plain):
        m.zero_grad_buffer()
        with m.no_sync():
            _loss(m, 0).backward()
            _loss(m, 1).backward()
        _loss(m, 2).backward()
        m.finish_grad_sync()
    plain_seen = plain.comm_hooks()["dense"].seen
    same = all(torch.equal(cap.seen[i], plain_seen[i]) for i in cap.seen)
    return {"calls": cap.calls, "n_buckets": len(cap.buckets), "same_input": same,
            "step": hook.step}  # fmt: skip


def overlap_case(config: dict[str, Any]) -> Any:
    """overlap_grad_reduce on and off, same bucket size: bitwise the same grads, 4 steps."""
    torch.manual_seed(0)
    net = Mlp()
    on = _engine(net, PowerSGD(rank=1, start_step=1), overlap_grad_reduce=True, **config)
    off = _engine(net, PowerSGD(rank=1, start_step=1), **config)
    same = []
    for step in range(4):
        for m in (on, off):
            _backward(m, step)
            _sgd(m)
        same.append(torch.equal(_params(on.module), _params(off.module)))
    return {"same": same, "n_groups": len(on.engine.all_bucket_groups)}


def expert_case(ep: int, config: dict[str, Any]) -> Any:
    """MoE model (dense + expert buffers), full-rank PowerSGD on all buffers == no hook
    (1e-5); expert buckets reduce over expt_dp."""
    hook = PowerSGD(rank=64, start_step=0, min_compression_rate=0.0)
    plain, hooked = _moe_model(ep, **config), _moe_model(ep, hook, "all", **config)
    errs = []
    for step in range(2):
        _moe_step(plain, step)
        _moe_step(hooked, step)
        (d0, e0), (d1, e1) = _dense_and_expert(plain), _dense_and_expert(hooked)
        errs.append(max(_rel(d1, d0), _rel(e1, e0)))
    expt_dp = hooked.process_groups.expt_dp
    experts = [b for b in hook._buckets.values() if b.expert]
    return {
        "errs": errs,
        "n_expert": len(experts),
        "groups_ok": all(b.group is expt_dp for b in experts),
        "compressed_expert": any(hook._state[b.index].plan.units for b in experts),
        "keys": sorted(hooked.comm_hooks()),
    }


def wire_case(config: dict[str, Any], hook_cls: str, factor: str | None = None) -> Any:
    """One compressing step at dp=2: the all-reduce bytes counted by Collectives.stats equal
    the hook's formula (sum r (n + m) factors + uncompressed elements), and nothing else is
    sent."""
    torch.manual_seed(0)
    dtype = getattr(torch, factor) if factor else None
    hook: Any = (
        PowerSGD(rank=2, start_step=0, factor_dtype=dtype)
        if hook_cls == "PowerSGD"
        else BatchedPowerSGD(rank=2, start_step=0, factor_dtype=dtype)
    )
    model = _engine(Mlp(), hook, **config)
    stats = model.engine.collectives.stats
    stats.reset()
    _backward(model, 0)
    expected = sum(hook.wire_nbytes(b) for b in hook._buckets.values())
    numel = [hook.wire_numel(b) for b in hook._buckets.values()]
    return {
        "counted": dict(stats.input_nbytes),
        "expected": expected,
        "numel": numel,
        "full_nbytes": sum(b.data.numel() * b.data.element_size() for b in hook._buckets.values()),
    }


# ---- skipped steps and the loss scale ------------------------------------------------------------
def _scaled_run(model: Any, opt: Any, steps: range, poison_step: int | None = None) -> list[bool]:
    oks = []
    for step in steps:
        opt.zero_grad()
        opt.scale_loss(_loss(model, step)).backward()
        if step == poison_step and dist.get_rank() == 0:
            model.module.l2.weight.main_grad[0, 0] = float("inf")  # a compressed matrix
        model.finish_grad_sync()
        oks.append(bool(opt.step()[0]))
    return oks


def _scaled_engine(net: nn.Module, scale: float, growth: int, config: dict[str, Any]) -> Any:
    hook = PowerSGD(rank=1, start_step=0)
    model = _engine(net, hook, sync_grads_at_backward_end=False, **config)
    scaler = DynamicGradScaler(scale, hysteresis=1, growth_interval=growth)
    opt = megabuf.FP32Optimizer(model, torch.optim.SGD, grad_scaler=scaler, lr=LR)
    return model, opt, hook


def skip_case(config: dict[str, Any]) -> Any:
    """fp32 params, dynamic loss scale 2^10 (hysteresis 1, growth every 2 good steps): an inf
    in one rank's grad of a compressed matrix at step 3 poisons P, Q and the residuals; the
    step is skipped everywhere and the hook reset. Claims: (a) after the skip the hook state is
    a new hook's (zero residuals, no Q, fresh generator) with 3 counted steps; (b) steps 4-9
    are bitwise those of a NEW engine + NEW hook started from the same params at the backed-off
    scale; (c) without the reset the NaN stays in Q and every later step is skipped; (d) the
    scale changes (growth) are exact: a run whose scale doubles every 2 steps equals, bitwise,
    a constant-scale one."""
    torch.manual_seed(0)
    net = Mlp()
    model, opt, hook = _scaled_engine(net, 2.0**10, 2, config)
    oks = _scaled_run(model, opt, range(4), poison_step=3)
    state = hook.state_dict()
    fresh = PowerSGD(rank=1, start_step=0)
    reset_ok = (
        all(float(e.abs().max()) == 0 for e in state["per_rank"].values())
        and not any(k.startswith("q/") for k in state["replicated"])
        and torch.equal(state["replicated"]["rng"], fresh._rng.get_state())
        and state["replicated"]["step"] == 3
    )
    scale_after = float(opt.get_loss_scale().item())
    ref, ref_opt, _ = _scaled_engine(model.module, scale_after, 2, config)
    broken, broken_opt, broken_hook = _scaled_engine(net, 2.0**10, 2, config)
    broken_hook.on_step_skipped = lambda: None  # type: ignore[method-assign]
    _scaled_run(broken, broken_opt, range(4), poison_step=3)
    same, scales, broken_oks = [], [], []
    for step in range(4, 10):
        oks += _scaled_run(model, opt, range(step, step + 1))
        _scaled_run(ref, ref_opt, range(step, step + 1))
        broken_oks += _scaled_run(broken, broken_opt, range(step, step + 1))
        same.append(torch.equal(_params(model.module), _params(ref.module)))
        scales.append(float(opt.get_loss_scale().item()))
    growing, g_opt, _ = _scaled_engine(net, 2.0**10, 2, config)
    constant, c_opt, _ = _scaled_engine(net, 2.0**10, 1000, config)
    _scaled_run(growing, g_opt, range(6))
    _scaled_run(constant, c_opt, range(6))
    return {
        "oks": oks,
        "reset_ok": reset_ok,
        "scale_after_skip": scale_after,
        "scales": scales,
        "same": same,
        "broken_oks": broken_oks,
        "growth_scales": float(g_opt.get_loss_scale().item()),
        "growth_same": torch.equal(_params(growing.module), _params(constant.module)),
    }


# ---- state round trips ---------------------------------------------------------------------------
def _run(model: Any, steps: range) -> None:
    for step in steps:
        _backward(model, step)
        _sgd(model)


def roundtrip_case(config: dict[str, Any], other_bucket_size: int | None) -> Any:
    """6 steps uninterrupted vs 3 steps, state_dict, a NEW engine (+ new hook) loading it, 3
    more: params bitwise. Also into another bucket size (same per-matrix math: also bitwise at
    dp=2), and merged per-rank state (sum over ranks, /group size): the group's total residual
    is kept, and training continues close to the uninterrupted run."""
    torch.manual_seed(0)
    net = Mlp()

    def hook() -> PowerSGD:
        return PowerSGD(rank=1, start_step=1)

    whole = _engine(net, hook(), **config)
    _run(whole, range(6))
    first_hook = hook()
    first = _engine(net, first_hook, **config)
    _run(first, range(3))
    saved = first_hook.state_dict()
    results: dict[str, Any] = {}
    other = {**config, "bucket_size": other_bucket_size}
    for label, cfg in (("same_layout", config), ("other_layout", other)):
        new_hook = hook()
        second = _engine(first.module, new_hook, **cfg)
        new_hook.load_state_dict({**saved, "per_rank_merged": False})
        _run(second, range(3, 6))
        results[label] = torch.equal(_params(second.module), _params(whole.module))
    merged = {k: v.clone() for k, v in saved["per_rank"].items()}
    for t in merged.values():
        dist.all_reduce(t)
    counts = {k: dist.get_world_size() for k in merged}
    merged_hook = hook()
    third = _engine(first.module, merged_hook, **config)
    merged_hook.load_state_dict({**saved, "per_rank": merged, "per_rank_merged": True,
                                 "per_rank_counts": counts})  # fmt: skip
    loaded = merged_hook.state_dict()["per_rank"]
    total_err = 0.0
    for key, value in saved["per_rank"].items():
        total_saved, total_loaded = value.clone(), loaded[key].clone()
        dist.all_reduce(total_saved)
        dist.all_reduce(total_loaded)
        total_err = max(total_err, _rel(total_loaded, total_saved))
    _run(third, range(3, 6))
    results["merged_total_err"] = total_err
    results["merged_param_err"] = _rel(_params(third.module), _params(whole.module))
    results["keys"] = sorted(saved)
    results["n_errors"] = len(saved["per_rank"])
    return results


def state_errors_case() -> Any:
    """Loading state that does not fit: named errors."""
    torch.manual_seed(0)
    net = Mlp()
    hook = PowerSGD(rank=1, start_step=0)
    model = _engine(net, hook, bucket_size=300)
    _backward(model, 0)
    saved = hook.state_dict()
    out: dict[str, Any] = {}

    def attempt(label: str, target: Any, state: dict[str, Any]) -> None:
        try:
            target.load_state_dict({"per_rank_merged": False, **state})
            out[label] = None
        except ValueError as exc:
            out[label] = str(exc)

    bogus = {**saved, "per_rank": {**saved["per_rank"], "error/nope.weight": torch.zeros(1)}}
    fresh = PowerSGD(rank=1, start_step=0)
    _engine(net, fresh, bucket_size=300)
    attempt("unknown_param", fresh, bogus)
    bias = {**saved, "per_rank": {**saved["per_rank"], "error/l1.bias": torch.zeros(24)}}
    attempt("uncompressed_param", fresh, bias)
    wrong_rank = PowerSGD(rank=2, start_step=0)
    _engine(net, wrong_rank, bucket_size=300)
    attempt("wrong_rank", wrong_rank, saved)
    batched = BatchedPowerSGD(rank=1, start_step=0)
    _run(_engine(net, batched, bucket_size=300), range(1))
    other = BatchedPowerSGD(rank=1, start_step=0)
    _engine(net, other)  # one bucket
    attempt("batched_layout", other, batched.state_dict())
    same = BatchedPowerSGD(rank=1, start_step=0)
    _engine(net, same, bucket_size=300)
    attempt("batched_same_layout", same, batched.state_dict())
    attempt("powersgd_from_batched", PowerSGD(rank=1, start_step=0), batched.state_dict())
    return out


def batched_invariant_case(config: dict[str, Any]) -> Any:
    """BatchedPowerSGD rank 1: the error-feedback invariant on the bucket (its residual covers
    the padded square; on the bucket's elements), every step."""
    torch.manual_seed(0)
    hook = BatchedPowerSGD(rank=1, start_step=0)
    cap = Capture(hook)
    model = _engine(Mlp(), cap, **config)
    errs = []
    for step in range(3):
        old = {i: st.error.clone() for i, st in hook._state.items()}
        _backward(model, step)
        worst = 0.0
        for bucket in cap.buckets:
            numel = bucket.data.numel()
            st = hook._state[bucket.index]
            lhs = cap.seen[bucket.index] + old[bucket.index][:numel]
            new_sum = st.error[:numel].clone()
            dist.all_reduce(lhs)
            dist.all_reduce(new_sum)
            lo, hi = bucket.shard_range if bucket.shard is not None else (0, numel)
            worst = max(worst, _rel(bucket.target, lhs[lo:hi] - new_sum[lo:hi]))
        errs.append(worst)
    return {"errs": errs}


def config_case(config: dict[str, Any]) -> Any:
    """`comm_hook = {name = "powersgd", ...}` in the config == the same hook registered by hand
    (bitwise, 3 steps)."""
    torch.manual_seed(0)
    net = Mlp()
    spec = {"name": "powersgd", "rank": 2, "start_step": 1, "factor_dtype": "float64"}
    from_config = _engine(net, comm_hook=spec, **config)
    by_hand = _engine(net, PowerSGD(rank=2, start_step=1, factor_dtype=torch.float64), **config)
    same = []
    for step in range(3):
        for m in (from_config, by_hand):
            _backward(m, step)
            _sgd(m)
        same.append(torch.equal(_params(from_config.module), _params(by_hand.module)))
    hooks = from_config.comm_hooks()
    return {"same": same, "types": sorted(type(h).__name__ for h in hooks.values())}


def reduce_hook_sanity() -> Any:
    """Reduce is the reference of start_step: before it PowerSGD is bitwise Reduce."""
    torch.manual_seed(0)
    net = Mlp()
    a, b = _engine(net, PowerSGD(rank=1, start_step=2)), _engine(net, Reduce())
    same = []
    for step in range(3):
        _backward(a, step)
        _backward(b, step)
        same.append(torch.equal(_grads(a), _grads(b)))
    return {"same": same}
