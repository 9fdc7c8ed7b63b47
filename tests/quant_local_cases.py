"""Rank side of tests/test_comm_hook_quant_local.py: `Quantize` against a single-process
emulation of its int8 rounding and rank-order fp32 sum ([Note: int8 wire, fp32 sum]), and
`LocalSGD` + `PeriodicAverager` against emulated subgroup and group averages ([Note: local SGD])."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from comm_hook_cases import Capture, _model, _moe_model, _moe_step, _raises, _reduced, _step
from grad_cases import Net, local_slice, loss_fn, make_data

import megabuf
from megabuf.comm_hooks import GradBucket, LocalSGD, Noop, PeriodicAverager, Quantize, Reduce

BLOCK = 16  # small blocks: several per chunk, and chunks that end inside a block


# ---- the emulation ---------------------------------------------------------------------------
def emulate_shards(seen: list[torch.Tensor], block: int, average: bool) -> torch.Tensor:
    """Every rank's pre-scaled bucket (group-rank order) -> every destination chunk's fp32 sum
    (concatenated, padded to group_size chunks): dequantise each rank's int8 round trip of the
    chunk and add them in rank order; written without the hook's workspaces."""
    d, numel = len(seen), seen[0].numel()
    chunk = -(-numel // d)
    shards = []
    for r in range(d):
        acc = None
        for src in seen:
            piece = torch.zeros(chunk, dtype=torch.float32)
            part = src.float()[r * chunk : (r + 1) * chunk]
            piece[: part.numel()] = part
            row = _roundtrip(piece, block)
            acc = row if acc is None else acc + row
        assert acc is not None
        shards.append(acc / d if average else acc)
    return torch.cat(shards)


def emulate_quantize(
    shards: torch.Tensor, d: int, block: int, mode: str, numel: int
) -> torch.Tensor:
    """What Quantize leaves: the shards (RS), or each shard's int8 round trip (AR)."""
    if mode == "reduce_scatter":
        return shards
    return torch.cat([_roundtrip(s, block) for s in shards.view(d, -1)])[:numel]


def _roundtrip(x: torch.Tensor, block: int) -> torch.Tensor:
    """int8 symmetric per-block quantise + dequantise of a 1-D fp32 chunk."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block)
    padded[:n] = x
    rows = padded.view(blocks, block)
    scale = (rows.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    codes = (rows / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return (codes.float() * scale[:, None]).reshape(-1)[:n]


def _scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element, the scale of its block (for the error bound)."""
    n = x.numel()
    blocks = -(-n // block)
    padded = torch.zeros(blocks * block, dtype=torch.float64)
    padded[:n] = x.double()
    per_block = padded.view(blocks, block).abs().amax(dim=1) / 127
    return per_block.repeat_interleave(block)[:n]


def _gather(t: torch.Tensor, group: Any) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def check_quantized(hook: Capture, block: int) -> dict[str, Any]:
    """Every bucket's result vs the emulation (bitwise) and vs the exact sum, within the
    documented bound: per element, sum over ranks of scale/2 of its block (plus the re-quantised
    shard's scale/2 in all-reduce mode) plus fp32 rounding."""
    bitwise, ratio = True, 0.0
    for bucket in hook.buckets:
        seen = _gather(hook.seen[bucket.index], bucket.group)
        d, numel = len(seen), seen[0].numel()
        chunk = -(-numel // d)
        shards = emulate_shards(seen, block, bucket.average)
        want = emulate_quantize(shards, d, block, bucket.mode, numel)
        lo, hi = bucket.shard_range if bucket.shard is not None else (0, numel)
        if bucket.shard is not None:
            want = want[lo:hi]
        bitwise &= torch.equal(bucket.target, want.to(bucket.target.dtype))
        bound = torch.zeros(d * chunk, dtype=torch.float64)
        for src in seen:
            padded = torch.zeros(d * chunk, dtype=torch.float64)
            padded[:numel] = src.double()
            for r in range(d):
                bound[r * chunk : (r + 1) * chunk] += (
                    _scales(padded[r * chunk :][:chunk], block) / 2
                )
        if bucket.average:
            bound /= d
        if bucket.shard is None:
            for r in range(d):
                bound[r * chunk : (r + 1) * chunk] += _scales(shards.view(d, -1)[r], block) / 2
        exact = sum(s.double() for s in seen) / (d if bucket.average else 1)
        fp32 = 4 * d * 2**-24 * sum(s.double().abs() for s in seen)
        total = bound[:numel] * (1 + 2**-20) + fp32 + 1e-30
        err = (bucket.target.double() - exact[lo:hi]).abs() / total[lo:hi]
        if bucket.target.dtype == torch.float32:  # the bound is for fp32 results
            ratio = max(ratio, err.max().item())
    return {"bitwise": bitwise, "bound_ratio": ratio}


# ---- Quantize ------------------------------------------------------------------------------
def quantize_case(config: dict[str, Any], bf16_tail: bool = False) -> dict[str, Any]:
    """Quantize(block=16): bitwise its emulation, within the documented bound, wire bytes as
    `wire_nbytes`, and different from the exact fp32 reduction (the rounding happened).
    `bf16_tail`: a second buffer with bf16 grads (the fp32 sum is rounded into them)."""
    net = Net(bf16_tail=bf16_tail)
    hook = Capture(Quantize(bits=8, block=BLOCK))
    plain, hooked = _model(net, **config), _model(net, hook, **config)
    _step(plain, 0)
    hooked.zero_grad_buffer()
    stats = hooked.engine.collectives.stats
    stats.reset()
    x, y = make_data(0)
    loss_fn(hooked(local_slice(x)), local_slice(y)).backward()
    hooked.finish_grad_sync()
    ring, calls = stats.total_ring_nbytes, dict(stats.calls)
    hook_calls, differs = hook.calls, not torch.equal(_reduced(plain), _reduced(hooked))
    before = _workspace_ptrs(hook.buckets)
    _step(hooked, 1)  # the checks below read this step
    wire = sum(hook.inner.wire_nbytes(b) for b in hook.buckets)
    return {
        **check_quantized(hook, BLOCK),
        "same_workspaces": before == _workspace_ptrs(hook.buckets) and len(before) > 0,
        "ring_nbytes": ring,
        "wire_nbytes": wire,
        "bucket_numels": [b.data.numel() for b in hook.buckets],
        "group_size": dist.get_world_size(),
        "calls": calls,
        "hook_calls": hook_calls,
        "n_buckets": len(hook.buckets),
        "differs_from_fp32": differs,
        "modes": sorted({b.mode for b in hook.buckets}),
        "grad_dtypes": sorted({str(b.data.dtype) for b in hook.buckets}),
    }


def _workspace_ptrs(buckets: list[GradBucket]) -> dict[Any, int]:
    """Every bucket's persistent workspaces: (bucket, key) -> storage address."""
    return {(b.index, k): t.data_ptr() for b in buckets for k, t in b._workspace.items()}


def quantize_no_sync_case(config: dict[str, Any]) -> dict[str, Any]:
    """3 micro-batches (2 under no_sync): the hook runs once per bucket, on the summed buffer
    (the buffer a Noop-hooked twin hands its hook), and is bitwise its emulation on it."""
    net = Net()
    hook, twin = Capture(Quantize(block=BLOCK)), Capture(Noop())
    hooked, summed = _model(net, hook, **config), _model(net, twin, **config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Noop's warning
        for model in (hooked, summed):
            model.zero_grad_buffer()
            for micro in range(3):
                x, y = make_data(micro)
                if micro < 2:
                    with model.no_sync():
                        loss_fn(model(local_slice(x)), local_slice(y)).backward()
                else:
                    loss_fn(model(local_slice(x)), local_slice(y)).backward()
            model.finish_grad_sync()
    same_input = all(torch.equal(hook.seen[b.index], twin.seen[b.index]) for b in hook.buckets)
    return {
        **check_quantized(hook, BLOCK),
        "same_input": same_input,
        "hook_calls": hook.calls,
        "n_buckets": len(hook.buckets),
    }


def quantize_expert_case(ep: int, config: dict[str, Any]) -> dict[str, Any]:
    """MoE model: Quantize on dense and expert buffers, each over its own group."""
    hook = Capture(Quantize(block=BLOCK))
    model = _moe_model(ep, hook, "all", **config)
    _moe_step(model, 0)
    expt_dp = model.process_groups.expt_dp
    return {
        **check_quantized(hook, BLOCK),
        "n_expert_buckets": sum(b.expert for b in hook.buckets),
        "expert_groups_ok": all(b.group is expt_dp for b in hook.buckets if b.expert),
        "expert_group_size": dist.get_world_size(expt_dp),
    }


# ---- LocalSGD ------------------------------------------------------------------------------
def _subgroup_mean(bucket: GradBucket, seen: list[torch.Tensor], size: int) -> torch.Tensor:
    """What LocalSGD(subgroup_size=size) leaves after start: the pre-scaled data summed over
    the subgroup, times group_size / size (a mean over the subgroup); under
    average_in_collective (no pre-scale) that sum / size."""
    r = bucket.group_rank
    members = range(r - r % size, r - r % size + size)
    total = seen[members[0]].clone()
    for m in members[1:]:
        total += seen[m]
    return total / size if bucket.average else total * (bucket.group_size / size)


def local_sgd_case(
    size: int, reduce_in_subgroup: bool, moe_ep: int = 0, average: bool = False
) -> dict[str, Any]:
    """start_step=2: steps 0-1 bitwise the Reduce hook; steps 2-3 the subgroup mean (emulated,
    bitwise), identical inside a subgroup and different across subgroups."""
    hook = Capture(LocalSGD(2, 2, subgroup_size=size, reduce_in_subgroup=reduce_in_subgroup))
    if moe_ep:
        local, ref = _moe_model(moe_ep, hook, "all"), _moe_model(moe_ep, Reduce(), "all")
        run: Callable[[Any, int], None] = _moe_step
    else:
        net = Net()
        cfg = {"bucket_size": 64, "average_in_collective": average}
        local, ref = _model(net, hook, **cfg), _model(net, Reduce(), **cfg)
        run = _step
    before, after, collectives_after = [], [], []
    for step in range(4):
        stats = local.engine.collectives.stats
        stats.reset()
        run(local, step)
        run(ref, step)
        if step < 2:
            before.append(torch.equal(_flat(local), _flat(ref)))
            continue
        collectives_after.append(dict(stats.calls))
        for bucket in hook.buckets:
            seen = _gather(hook.seen[bucket.index], bucket.group)
            want = _subgroup_mean(bucket, seen, size if reduce_in_subgroup else 1)
            after.append(torch.equal(bucket.data, want))
    flats = _gather(_flat(local), None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4, 7):  # no averager: a warning once 2 periods have passed
            run(local, step)
    return {
        "before_equal": before,
        "after_equal": after,
        "same_as_rank": [torch.equal(flats[dist.get_rank()], f) for f in flats],
        "step": hook.inner.step,
        "collectives_after": collectives_after,
        "warnings": [str(w.message) for w in caught if "LocalSGD" in str(w.message)],
        "n_buckets": len(hook.buckets),
        "n_expert_buckets": sum(b.expert for b in hook.buckets),
    }


def _flat(model: Any) -> torch.Tensor:
    return torch.cat([b.grad_data for b in model.buffers + model.engine.expert_parallel_buffers])


def _mains(opt: Any) -> list[torch.Tensor]:
    return [mp.main.detach().clone() for mp in opt.main_params]


def averager_case(reduce_in_subgroup: bool = True) -> dict[str, Any]:
    """LocalSGD(start_step=1, period=2, subgroup_size=2) + MixedPrecisionOptimizer(Adam) on a
    model with bf16 params (fp32 main copies) and fp32 params: averaging every 2 local steps
    makes every rank's main params the rank-order fp32 mean of all ranks' (bitwise), the model
    params the rounded main params, and the replicas identical; between averagings the
    subgroups differ."""
    net = Net(bf16_tail=True)
    hook = LocalSGD(1, 2, subgroup_size=2, reduce_in_subgroup=reduce_in_subgroup)
    model = _model(net, hook, bucket_size=64, grad_reduce_in_fp32=True)
    opt = megabuf.MixedPrecisionOptimizer(model, torch.optim.Adam, lr=1e-2)
    averager = PeriodicAverager(opt)
    log = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _averaged_steps(model, opt, averager, hook, log)
    again = averager.step()  # same step: no second averaging
    try:  # one local step after the last averaging: the replicas differ
        state: Any = hook.state_dict()
    except ValueError as exc:
        state = str(exc)
    return {
        "log": log,
        "again": again,
        "state": state,
        "warnings": [str(w.message) for w in caught if "LocalSGD" in str(w.message)],
    }


def _averaged_steps(model: Any, opt: Any, averager: Any, hook: Any, log: list[Any]) -> None:
    for step in range(6):
        opt.zero_grad()
        x, y = make_data(step)
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
        opt.step()
        stepped = _mains(opt)  # this rank's replica before averaging
        averaged = averager.step()
        entry: dict[str, Any] = {"step": step, "hook_step": hook.step, "averaged": averaged}
        all_stepped = [_gather(t, None) for t in stepped]
        entry["replicas_differ"] = any(
            not torch.equal(ts[0], ts[2]) for ts in all_stepped
        )  # subgroups {0,1} and {2,3}
        if averaged:
            want = [_rank_order_mean(ts) for ts in all_stepped]
            entry["mean_bitwise"] = all(
                torch.equal(mp.main, w) for mp, w in zip(opt.main_params, want, strict=True)
            )
            entry["identical"] = all(
                all(torch.equal(t[0], u) for u in t)
                for t in (_gather(p, None) for p in _mains(opt))
            )
            entry["model_is_rounded_main"] = all(
                torch.equal(mp.model_param.detach(), mp.main.to(mp.model_param.dtype))
                for mp in opt.main_params
            )
            entry["n_copies"] = sum(mp.is_copy for mp in opt.main_params)
            first = opt.main_params[0].main
            moments = _gather(opt.domains[0].optimizer.state[first]["exp_avg"], None)
            entry["moments_differ"] = not torch.equal(moments[0], moments[2])
        log.append(entry)


def _rank_order_mean(ts: list[torch.Tensor]) -> torch.Tensor:
    total = ts[0] + ts[1]
    for t in ts[2:]:
        total = total + t
    return total / len(ts)


def checkpoint_case() -> dict[str, Any]:
    """The hook's counters round-trip into a new hook on a new model: the reloaded model's next
    step reduces in the subgroup (bitwise the original's), not over the whole group."""
    net = Net()
    first = LocalSGD(2, 2, subgroup_size=2)
    a = _model(net, first, bucket_size=64)
    for step in range(2):  # the global phase (start_step 2): the replicas are equal
        _step(a, step)
    state = first.state_dict()
    second = LocalSGD(2, 2, subgroup_size=2)
    b = _model(net, second, bucket_size=64)
    second.load_state_dict({**state, "per_rank_merged": False})
    loaded_step = second.step
    _step(a, 2)
    _step(b, 2)
    fresh = _model(net, LocalSGD(2, 2, subgroup_size=2), bucket_size=64)
    _step(fresh, 2)  # a fresh hook at step 0 all-reduces globally
    return {
        "state": state,
        "loaded_step": loaded_step,
        "same": torch.equal(_flat(a), _flat(b)),
        "fresh_differs": not torch.equal(_flat(a), _flat(fresh)),
        "bad_key": _raises(
            lambda: second.load_state_dict(
                {"replicated": {"step": 1, "x": 2}, "per_rank": {}, "layout": {}}
            )
        ),
    }


def local_sgd_errors_case() -> dict[str, Any]:
    """The named errors and the warning of a LocalSGD set-up that cannot work."""

    def averager_without_hook() -> None:
        model = _model(Net(), Reduce())
        PeriodicAverager(megabuf.FP32Optimizer(model, torch.optim.SGD, lr=0.1))

    def averager_other_model() -> None:
        hook = LocalSGD(0, 1, subgroup_size=2)
        _model(Net(), hook)
        other = _model(Net())
        PeriodicAverager(megabuf.FP32Optimizer(other, torch.optim.SGD, lr=0.1), hook)

    def distributed_optimizer() -> None:
        model = _model(Net(), use_distributed_optimizer=True)
        PeriodicAverager(megabuf.DistributedOptimizer(model, torch.optim.SGD, lr=0.1))

    return {
        "not_dividing": _raises(lambda: _model(Net(), LocalSGD(0, 1, subgroup_size=3))),
        "not_partition": _raises(lambda: _model(Net(), LocalSGD(0, 1, subgroups=[[0, 1], [1, 2]]))),
        "rs_mode": _raises(
            lambda: _model(Net(), LocalSGD(0, 1, subgroup_size=2), use_distributed_optimizer=True)
        ),
        "averager_without_hook": _raises(averager_without_hook),
        "averager_other_model": _raises(averager_other_model),
        "distributed_optimizer": _raises(distributed_optimizer),
        "explicit_subgroups": _explicit_subgroups(),
    }


def _explicit_subgroups() -> bool:
    """subgroups=[[0, 2], [1, 3]]: after start the grads are the mean over {0,2} / {1,3}."""
    hook = Capture(LocalSGD(0, 4, subgroups=[[0, 2], [1, 3]]))
    model = _model(Net(), hook, bucket_size=64)
    _step(model, 0)
    ok = True
    for bucket in hook.buckets:
        seen = _gather(hook.seen[bucket.index], bucket.group)
        partner = {0: 2, 2: 0, 1: 3, 3: 1}[bucket.group_rank]
        lo, hi = sorted((bucket.group_rank, partner))
        ok &= torch.equal(bucket.data, (seen[lo] + seen[hi]) * 2)
    return ok


def quantize_dp1_case() -> dict[str, Any]:
    """dp=1: nothing crosses the wire; the result is the bucket's own int8 round trip (twice in
    all-reduce mode), bitwise the emulation."""
    hook = Capture(Quantize(block=BLOCK))
    model = _model(Net(), hook, bucket_size=64)
    model.engine.collectives.stats.reset()
    _step(model, 0)
    return {
        **check_quantized(hook, BLOCK),
        "ring_nbytes": model.engine.collectives.stats.total_ring_nbytes,
        "wire_nbytes": sum(hook.inner.wire_nbytes(b) for b in hook.buckets),
    }
