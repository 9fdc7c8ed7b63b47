"""Rank side of tests/test_autobucket.py: bucket_size="auto" on real gloo ranks.

Measurements are injected per rank (`AutoBucket.measure` replaced) where a test needs a known,
deliberately asymmetric input; one case runs on the real measured warm-up."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import weakref
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import megabuf
import megabuf.core.engine
import megabuf.replan.warmup
from megabuf.comm_hooks import build as build_hook
from megabuf.planning.replicas import param_specs
from megabuf.pure.bucket_planner import CollectiveModel, worth_changing
from megabuf.pure.overlap import analyze
from megabuf.replan.autobucket import choose_buckets, current_choices, ends_of
from megabuf.replan.warmup import Measurement, agree
from megabuf.sharding.walk import storage_walk
from megabuf.testing.models import build_model, loss_fn, make_batch

MODEL = "gpt_tiny"
STEPS = 6
WARMUP = 3  # the re-plan happens in the zero_grad_buffer() of step WARMUP (0-based)
GLOBAL_BATCH = 8


def fake_measurement(n_params: int, rank: int) -> Measurement:
    """Rank 0: grads ready evenly over 10 ms before backward end, a slow link. Rank 1: wildly
    different (ready 100x earlier, a 30x faster link, 10x the latency), so a rank-local plan
    would differ from rank 0's."""
    scale, model = (1.0, CollectiveModel(2e-5, 2e-9)) if rank == 0 else (
        100.0, CollectiveModel(2e-4, 6e-11))  # fmt: skip
    ready = tuple(-scale * 0.01 * (i + 1) / n_params for i in range(n_params))
    return Measurement(ready, model, 2)


def _local(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[0] // dist.get_world_size()
    return t[dist.get_rank() * n : (dist.get_rank() + 1) * n]


def _agreed(model: Any) -> None:
    """Raise on every rank, before any collective of the new plan, if the ranks chose
    different plans (a rank-local plan would pair collectives of different sizes: a hang)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, model.engine.plan.bucket_ends)
    if any(e != everyone[0] for e in everyone):
        raise RuntimeError(f"ranks chose different bucket plans: {everyone}")


def _step(model: Any, opt: Any, step: int, micro: int) -> None:
    model.zero_grad_buffer()  # with bucket_size="auto", where the re-plan happens
    if model.ddp_config.bucket_size == "auto":
        _agreed(model)
    for m in range(micro):
        x, y = make_batch(MODEL, GLOBAL_BATCH, seed=100 * step + m)
        last = m == micro - 1
        with model.no_sync() if not last else _nullcontext():
            loss_fn(MODEL)(model(_local(x)), _local(y)).backward()
    model.finish_grad_sync()
    opt.step()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _optimizer(kind: str, model: Any) -> Any:
    if kind == "megabuf":
        cfg = megabuf.OptimizerConfig(optimizer="adamw", lr=1e-2, clip_grad=1.0)
        return megabuf.build_optimizer(model, cfg)
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _bucket_ends(model: Any) -> list[list[int]]:
    return [[s.param_ids[-1] for s in b.layout.buckets] for b in model.engine.plan.buffers]


def replan_case(flags: dict[str, Any], opt_kind: str, micro: int) -> dict[str, Any]:
    """N steps with the re-plan at step WARMUP == N steps on that plan from the start, bitwise;
    the plan is the same on every rank and is the one planned from the MAX of both ranks'
    numbers."""
    base = build_model(MODEL, seed=0)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=WARMUP, **flags
    )
    auto = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    n = len(auto.engine.param_to_name)
    auto.engine.auto.measure = lambda dtype: fake_measurement(n, dist.get_rank())  # type: ignore[union-attr]
    default_groups = len(auto.engine.all_bucket_groups)
    default_plan = auto.engine.plan
    opt = _optimizer(opt_kind, auto)
    for step in range(STEPS):
        _step(auto, opt, step, micro)
    replanned = auto.engine.plan
    mine = fake_measurement(n, dist.get_rank())
    group = megabuf.ProcessGroups.default().dp
    specs = param_specs(_named(auto))
    numels = [s.numel for s in specs]
    agreed = agree(mine, auto.engine.collectives, group, torch.device("cpu"))
    expected = choose_buckets(replanned, numels, [s.own_bucket for s in specs], agreed)
    current = current_choices(default_plan, numels, agreed)
    worth = worth_changing(expected, current, -min(agreed.ready_s))

    fixed_cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, **flags)
    fixed = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)
    fixed.engine.rebucket(replanned)  # that plan from the start
    opt2 = _optimizer(opt_kind, fixed)
    for step in range(STEPS):
        _step(fixed, opt2, step, micro)
    default = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)  # never re-planned
    opt3 = _optimizer(opt_kind, default)
    for step in range(STEPS):
        _step(default, opt3, step, micro)
    for model in (auto, fixed, default):  # overlap_param_gather: wait for the last gathers
        model.publish_params()
    views_ok = _views_ok(auto)
    return {
        "max_diff": max(
            (a - b).abs().max().item()
            for a, b in zip(auto.module.parameters(), fixed.module.parameters())
        ),
        "vs_default": max(
            (a - b).abs().max().item()
            for a, b in zip(auto.module.parameters(), default.module.parameters())
        ),
        "moved": max(
            (a - b).abs().max().item() for a, b in zip(auto.module.parameters(), base.parameters())
        ),
        "ends": replanned.bucket_ends,
        "expected_ends": tuple(ends_of(c) for c in expected),
        "worth_changing": worth,
        "default_groups": default_groups,
        "groups": len(auto.engine.all_bucket_groups),
        "views_ok": views_ok,
        "ledger_ok": _grad_shards_ledgered(auto),
        "auto_done": auto.engine.auto.replanned,  # type: ignore[union-attr]
    }


def _grad_shards_ledgered(model: Any) -> bool:
    """The ledger's grad shards are the current groups' (a sharded re-plan frees the old ones)."""
    shards = [g.sharded_grads for g in model.engine.all_bucket_groups]
    want = sum(s.shard_nbytes for s in shards if s is not None)
    return bool(model.engine.memory_ledger.now("grad_shard") == want)


def _views_ok(model: Any) -> bool:
    """Every param's memory (sharded: `param.data` in the param buffer; else `main_grad` in the
    grad buffer) is in the engine's current buffers, and every param is in a bucket group."""
    sharded = model.ddp_config.sharding.shards_optimizer
    homes = {
        (b.param_data if sharded else b.grad_data).untyped_storage().data_ptr()
        for b in model.engine.buffers
    }
    return all(
        (p.data if sharded else p.main_grad).untyped_storage().data_ptr() in homes
        and any(p in g.params for g in model.engine.all_bucket_groups)
        for p in model.engine.param_to_name
    )


def _named(model: Any) -> list[tuple[str, nn.Parameter]]:
    return [(name, p) for p, name in model.engine.param_to_name.items()]


def measured_case(flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """The real warm-up (rank-local timings differ): the re-plan happens, every rank ends with
    the same plan, and the overlap report's timeline survives it."""
    base = build_model(MODEL, seed=0)
    flags = flags or {}
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2, **flags
    )
    model = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    timeline = model.enable_timeline()
    opt = _optimizer("megabuf" if flags else "torch", model)
    for step in range(4):
        _step(model, opt, step, 1)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, model.engine.plan.bucket_ends)
    report = analyze(timeline.events)
    steps = report.steps
    return {
        "replanned_before_step": report.replanned_before_step,
        "report_text": report.format(),
        "same_plan": all(e == everyone[0] for e in everyone),
        "ends": model.engine.plan.bucket_ends,
        "replanned": model.engine.auto.replanned,  # type: ignore[union-attr]
        "summary": model.engine.auto.summary,  # type: ignore[union-attr]
        "synced_events": sum(e[1] == "synced" for e in model.engine.auto.timeline.events),  # type: ignore[union-attr]
        "groups_last_step": len(steps[-1].groups),
        "groups": len(model.engine.all_bucket_groups),
    }


def hook_refused_case() -> dict[str, Any]:
    """A comm hook registered before the re-plan raises on every rank, naming the hook; after the
    re-plan (before the next backward) it registers and reduces."""
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2
    )
    model = megabuf.DistributedDataParallel(build_model(MODEL, seed=0), cfg)
    try:
        model.register_comm_hook(build_hook({"name": "reduce"}))
        error = ""
    except RuntimeError as err:
        error = str(err)
    opt = _optimizer("torch", model)
    for step in range(2):
        _step(model, opt, step, 1)
    model.zero_grad_buffer()  # the re-plan
    model.register_comm_hook(build_hook({"name": "reduce"}))
    _step(model, opt, 2, 1)
    wire = model.engine.hooks.comm_hook_report().buckets
    n_buckets = sum(len(g.buckets) for g in model.engine.all_bucket_groups)
    return {"error": error, "dispatches": [b.dispatches for b in wire], "buckets": n_buckets}


def checkpoint_case(root: str, flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """A checkpoint saved after the re-plan loads into a model that never re-planned (checkpoints
    are model-space, independent of the bucket plan), and both then train alike."""
    base = build_model(MODEL, seed=0)
    flags = flags or {}
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2, **flags
    )
    auto = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    opt = _optimizer("megabuf", auto)
    for step in range(3):  # the re-plan runs in step 2's zero_grad_buffer()
        _step(auto, opt, step, 1)
    path = os.path.join(root, "auto_replanned_" + "_".join(map(str, flags.values())))
    megabuf.save_checkpoint(path, auto, opt)
    plain_cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, **flags)
    plain = megabuf.DistributedDataParallel(copy.deepcopy(base), plain_cfg)
    plain_opt = _optimizer("megabuf", plain)
    megabuf.load_checkpoint(path, plain, plain_opt)
    loaded = _max_diff(auto, plain)
    for step in range(3, 5):
        _step(auto, opt, step, 1)
        _step(plain, plain_opt, step, 1)
    return {
        "replanned": auto.engine.auto.replanned,  # type: ignore[union-attr]
        "plans": (auto.engine.plan.bucket_ends, plain.engine.plan.bucket_ends),
        "loaded": loaded,
        "continued": _max_diff(auto, plain),
        "moved": _max_diff(auto, megabuf.DistributedDataParallel(copy.deepcopy(base), plain_cfg)),
    }


def _max_diff(a: Any, b: Any) -> float:
    """Read through `state_dict()`: it waits for param gathers (and gathers ZeRO-3 units)."""
    return max(
        (x - y).abs().max().item() for x, y in zip(a.state_dict().values(), b.state_dict().values())
    )


def world_one_case() -> dict[str, Any]:
    """dp 1: nothing to overlap, so the re-plan keeps the plan that ran ([Note: auto bucket plan
    at dp 1]), under the distributed optimizer too: the same buffers, nothing rebuilt."""
    out = {}
    for distopt in (False, True):
        cfg = megabuf.DistributedDataParallelConfig(
            overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2,
            use_distributed_optimizer=distopt,
        )  # fmt: skip
        model = megabuf.DistributedDataParallel(build_model("mlp_34m", seed=0), cfg)
        before = [len(b.layout.buckets) for b in model.engine.plan.buffers]
        buffers = list(model.engine.buffers)
        if distopt:
            opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="sgd", lr=1e-3))
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        auto = model.engine.auto
        events = []
        for step in range(5):  # re-planned (kept) at step 2: steps 3, 4 on the kept plan
            model.zero_grad_buffer()
            x, y = make_batch("mlp_34m", 2, seed=step)
            loss_fn("mlp_34m")(model(x), y).backward()
            model.finish_grad_sync()
            opt.step()
            events.append(len(auto.timeline.events))  # type: ignore[union-attr]
        out["distopt" if distopt else "all_reduce"] = {
            "events_after_replan": events[2:],  # the kept plan's syncs record nothing more
            "replanned": auto.replanned,  # type: ignore[union-attr]
            "kept": auto.kept,  # type: ignore[union-attr]
            "summary": auto.summary,  # type: ignore[union-attr]
            "before": before,
            "after": [len(b.layout.buckets) for b in model.engine.plan.buffers],
            "same_buffers": all(a is b for a, b in zip(buffers, model.engine.buffers)),
        }
    return out


def _ready_events_per_step(events: Any) -> list[int]:
    """Per grad sync, the "ready" events (a group ready during backward) before its backward end:
    0 for a step whose reductions all ran after backward ([Note: quiet step])."""
    counts, ready = [], 0
    for _, name, _ in events:
        if name == "ready":
            ready += 1
        elif name == "backward_end":
            counts.append(ready)
            ready = 0
    return counts


def quiet_step_case(quiet_backward_s: float, flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """[Note: quiet step]: the last of 3 warm-up steps reduces after backward (no group ready
    during it), then the re-plan weighs overlap against one bucket per buffer at backward's end
    from injected numbers: the overlapped step's backward 10 ms and the probe's model as is
    (exposed 0), the quiet step's exposed 2 ms, and its backward `quiet_backward_s`; rank 1's
    numbers differ (agreed by MAX). N steps with the re-plan equal N steps on that plan from
    the start, bitwise."""
    flags = flags or {}
    base = build_model(MODEL, seed=0)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=WARMUP, **flags
    )
    model = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    timeline = model.enable_timeline()
    auto = model.engine.auto
    n = len(model.engine.param_to_name)
    rank = dist.get_rank()

    real: dict[str, Any] = {}

    def measure(dtype: Any) -> Measurement:
        got = megabuf.replan.warmup.measured(auto.timeline.events, n, CollectiveModel(0.0, 0.0))  # type: ignore[union-attr]
        real.update(steps=got.steps, quiet=(got.quiet_backward_s, got.quiet_exposed_s))
        return replace(
            fake_measurement(n, rank), backward_s=0.010 - 0.001 * rank,
            quiet_backward_s=quiet_backward_s - 0.002 * rank, quiet_exposed_s=0.002 * (1 + rank),
        )  # fmt: skip

    auto.measure = measure  # type: ignore[union-attr]
    default_buckets = [len(b.layout.buckets) for b in model.engine.plan.buffers]
    unclipped = megabuf.OptimizerConfig(optimizer="adamw", lr=1e-2)  # a clip norm's shard sums
    opt = megabuf.build_optimizer(model, unclipped)  # follow the plan: two plans round apart
    for step in range(STEPS):
        _step(model, opt, step, 1)
    fixed_cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, **flags)
    fixed = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)
    fixed.engine.rebucket(model.engine.plan)
    opt2 = megabuf.build_optimizer(fixed, unclipped)
    for step in range(STEPS):
        _step(fixed, opt2, step, 1)
    model.publish_params()
    fixed.publish_params()
    return {
        "ready_per_step": _ready_events_per_step(timeline.events),
        "default_buckets": default_buckets,
        "buckets": [len(b.layout.buckets) for b in model.engine.plan.buffers],
        "at_end": auto.at_end,  # type: ignore[union-attr]
        "summary": auto.summary,  # type: ignore[union-attr]
        "real": real,
        "max_diff": _max_diff(model, fixed),
        "moved": _max_diff(model, megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)),
    }


def no_sync_deferral_case() -> dict[str, Any]:
    """A due re-plan waits for a zero_grad_buffer() outside no_sync() (whose exit would reset
    the flag of the grad sync the re-plan replaces); then grads sync again as usual."""
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2
    )
    model = megabuf.DistributedDataParallel(build_model(MODEL, seed=0), cfg)
    opt = _optimizer("torch", model)
    for step in range(2):
        _step(model, opt, step, 1)
    auto = model.engine.auto
    with model.no_sync():
        model.zero_grad_buffer()
        inside = auto.replanned  # type: ignore[union-attr]
    model.zero_grad_buffer()
    after = auto.replanned  # type: ignore[union-attr]
    _step(model, opt, 2, 1)  # the new plan's grads are reduced
    x = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, x)
    same = all(torch.equal(a, b) for a, b in zip(everyone[0], everyone[1]))
    return {"inside": inside, "after": after, "require": model.require_backward_grad_sync,
            "same_grads": same}  # fmt: skip


# ---- optim_grads_params (ZeRO-3): [Note: sharded auto bucket re-plan] ---------------------------
ZERO3: dict[str, Any] = {"data_parallel_sharding_strategy": "optim_grads_params"}


@contextlib.contextmanager
def planned_with(bucket_ends: Any) -> Iterator[None]:
    """DistributedDataParallel built inside plans with these boundaries from the start: a fresh
    model on the re-planned plan that never ran the re-plan's code."""
    original = megabuf.core.engine.plan_model
    megabuf.core.engine.plan_model = lambda *a, **k: original(
        *a, **{**k, "bucket_ends": bucket_ends}
    )  # type: ignore[assignment]
    try:
        yield
    finally:
        megabuf.core.engine.plan_model = original  # type: ignore[assignment]


def zero3_case(
    flags: dict[str, Any], micro: int, clip: float = 1.0, bf16: bool = False
) -> dict[str, Any]:
    """ZeRO-3: N AdamW steps with the re-plan at step WARMUP == N steps on a model built on
    that plan from the start, bitwise; the ledger right after the re-plan == that model's after
    construction (old shards and gathered params freed); the same plan on every rank from
    asymmetric injected timings. `clip`: the grad-norm clip (0: none); `bf16`: bf16 params
    stepped through fp32 main params."""
    base = build_model(MODEL, seed=0, dtype=torch.bfloat16 if bf16 else torch.float32)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=WARMUP,
        **ZERO3, **flags,
    )  # fmt: skip
    auto = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
    n = len(auto.engine.param_to_name)
    auto.engine.auto.measure = lambda dtype: fake_measurement(n, dist.get_rank())  # type: ignore[union-attr]
    default_plan = auto.engine.plan
    opt_cfg = megabuf.OptimizerConfig(optimizer="adamw", lr=1e-2, clip_grad=clip, bf16=bf16)
    opt = megabuf.build_optimizer(auto, opt_cfg)
    ledger: dict[str, int] = {}
    old_alive = -1
    for step in range(STEPS):
        if step == WARMUP:
            old = [weakref.ref(g) for g in auto.engine.all_bucket_groups]
            auto.zero_grad_buffer()  # the re-plan (the step's own call then only zeroes)
            ledger = _nonzero(auto.engine.memory_ledger.current())
            gc.collect()
            old_alive = sum(ref() is not None for ref in old)
        _step(auto, opt, step, micro)
    plan = auto.engine.plan
    agreed = agree(fake_measurement(n, dist.get_rank()), auto.engine.collectives,
                   megabuf.ProcessGroups.default().dp, torch.device("cpu"))  # fmt: skip
    specs = param_specs(_named(auto))
    expected = choose_buckets(plan, [s.numel for s in specs], [s.own_bucket for s in specs], agreed)
    fixed_cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, **ZERO3, **flags)
    with planned_with(plan.bucket_ends):
        fixed = megabuf.DistributedDataParallel(copy.deepcopy(base), fixed_cfg)
    opt2 = megabuf.build_optimizer(fixed, opt_cfg)
    fresh_ledger = _nonzero(fixed.engine.memory_ledger.current())
    for step in range(STEPS):
        _step(fixed, opt2, step, micro)
    return {
        "max_diff": _max_diff(auto, fixed),
        "moved": max(
            (a - b).abs().max().item()
            for a, b in zip(auto.state_dict().values(), base.state_dict().values())
        ),
        "same_plan": fixed.engine.plan == plan,
        "changed": plan != default_plan,
        "ends": plan.bucket_ends,
        "expected_ends": tuple(ends_of(c) for c in expected),
        "ledger": ledger,
        "fresh_ledger": fresh_ledger,
        "old_groups_alive": old_alive,
        "walk": (storage_walk(auto, opt), storage_walk(fixed, opt2)),
        "units": len(auto.engine.param_side.units.runtime.units),  # type: ignore[attr-defined]
    }


def _nonzero(ledger: Any) -> dict[str, int]:
    return {k: v for k, v in ledger.items() if v}


def zero3_offload_refused_case() -> dict[str, Any]:
    """The optimizer's cpu_offload host copies follow the old shards: the re-plan raises on
    every rank naming cpu_offload, before anything is rebuilt, and training goes on on the old
    plan. CPU params make cpu_offload a no-op, so a stand-in marks the host copies CUDA params
    would have ([Note: cpu offload])."""
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2, **ZERO3
    )
    model = megabuf.DistributedDataParallel(build_model(MODEL, seed=0), cfg)
    opt = _optimizer("megabuf", model)
    for step in range(2):
        _step(model, opt, step, 1)
    groups = model.engine.all_bucket_groups
    opt._offload = object()  # the host copies of CUDA params
    try:
        model.zero_grad_buffer()
        error = ""
    except RuntimeError as err:
        error = str(err)
    opt._offload = None
    _step(model, opt, 2, 1)
    return {"error": error, "kept": model.engine.all_bucket_groups == groups,
            "ends": model.engine.plan.bucket_ends}  # fmt: skip


def memory_kept_case(flags: dict[str, Any]) -> dict[str, Any]:
    """A sharded re-plan needs new buffers beside the old ones (ZeRO-3: the whole params twice)
    at once: where one dp rank (here rank 1, a stand-in for a full CUDA device) has too little
    free memory, every rank keeps the plan that ran (agreed, so none goes on into the
    collectives alone), says why in a warning, and trains on."""
    import logging

    import megabuf.replan.sharded_replan as sharded_replan

    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", auto_bucket_warmup_steps=2, **flags
    )
    model = megabuf.DistributedDataParallel(build_model(MODEL, seed=0), cfg)
    n = len(model.engine.param_to_name)
    model.engine.auto.measure = lambda dtype: fake_measurement(n, dist.get_rank())  # type: ignore[union-attr]
    opt = _optimizer("megabuf", model)
    for step in range(2):
        _step(model, opt, step, 1)
    groups, plan = model.engine.all_bucket_groups, model.engine.plan
    original = sharded_replan.free_device_bytes
    sharded_replan.free_device_bytes = lambda device: 0 if dist.get_rank() == 1 else None  # type: ignore[assignment]
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("megabuf.replan.autobucket").addHandler(handler)
    try:
        model.zero_grad_buffer()
    finally:
        sharded_replan.free_device_bytes = original  # type: ignore[assignment]
        logging.getLogger("megabuf.replan.autobucket").removeHandler(handler)
    auto = model.engine.auto
    kept = model.engine.all_bucket_groups == groups and model.engine.plan == plan
    _step(model, opt, 2, 1)
    return {
        "kept": kept, "auto_kept": auto.kept, "summary": auto.summary,  # type: ignore[union-attr]
        "warnings": [r.getMessage() for r in records if r.levelno == logging.WARNING],
        "finite": all(torch.isfinite(v).all() for v in model.state_dict().values()),
    }  # fmt: skip
