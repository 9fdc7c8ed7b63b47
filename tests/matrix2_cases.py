"""Rank-side code for tests/test_matrix2.py (issue 46; 4 gloo ranks, one pool run): the features
landed after the combination matrix (hybrid sharding, the weight lifecycle, whole-param owners)
where they meet the options that move scaling or membership.

- Hybrid 2 x 2 (R = 2 replicas x S = 2 shards) with every option that moves the 1/dp
  (`average_in_collective`, `grad_reduce_in_fp32` with bf16 params, the `Reduce()` comm hook,
  fp16 with a DynamicGradScaler, `deterministic_reduction`): after each step's grad sync this
  rank's reduced shard of every bucket against the global batch's grad (optimizer_cases'
  single-process Reference, times the loss scale), so a level that sums where it should average
  is off by a factor R or S whatever the optimizer (AdamW alone would hide a constant factor).
- Offload / restore at ep 2 (expert dp 2 != dp 4): live bytes by a storage walk over every
  buffer, dense and expert, not only the ledger; restored bitwise, then trained on to the whole
  model's params.
- The weight version (`weight_version`, `export_weights(optimizer=...)`) over a skipped step: an
  inf in one expert's grad on one rank skips step 1 everywhere; the version counts applied
  updates only.
- The auto re-plan with averaging, skipped steps, param groups and fp16 params (2 ranks).
The whole-param owner (MuonAdamW) cases are in matrix2_muon_cases.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any

import hybrid_cases
import matrix_cases
import torch
import torch.distributed as dist
from moe_cases import CFG
from optimizer_cases import GLOBAL_BATCH, Net, Reference, loss_fn, make_data, param_groups

import megabuf
from megabuf.comm_hooks import Reduce
from megabuf.optimizer.grad_scaler import DynamicGradScaler
from megabuf.testing.moe import MoEModel, moe_batch

STEPS = 3
FP16_SCALE = 1024.0


# ---- hybrid 2 x 2 with every option that moves the 1/dp ----------------------------------------
def _build_fp16(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    torch.manual_seed(0)
    net = Net().to(torch.float16)
    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy=case["strategy"], overlap_grad_reduce=True,
        bucket_size=40, **case.get("ddp", {}),
    )  # fmt: skip
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=hybrid_cases.groups("2x2"))
    scaler = DynamicGradScaler(FP16_SCALE, hysteresis=1, growth_interval=1000)
    opt = megabuf.DistributedOptimizer(
        model, torch.optim.AdamW, param_groups(net, 1e-2), lr=1e-2, grad_scaler=scaler
    )
    return model, opt


def _sync(
    model: megabuf.DistributedDataParallel, opt: Any, step: int, micro: int, inf: bool = False
) -> None:
    """This rank's slice of the global batch in `micro` micro-batches (all but the last under
    no_sync), the loss scaled by the optimizer's loss scale, then finish_grad_sync(). With
    `inf`, rank 3's grad of block.weight in its last micro-batch is made inf (a tensor hook)."""
    x, y = make_data(step)
    n = GLOBAL_BATCH // dist.get_world_size()
    x, y = x[dist.get_rank() * n :][:n], y[dist.get_rank() * n :][:n]
    m = n // micro
    opt.zero_grad()
    for i in range(micro):
        handle = None
        if inf and i == micro - 1 and dist.get_rank() == 3:
            param = model.module.get_parameter("block.weight")
            handle = param.register_hook(lambda g: torch.full_like(g, math.inf))
        loss = opt.scale_loss(loss_fn(model(x[i * m : (i + 1) * m]), y[i * m : (i + 1) * m]))
        with model.no_sync() if i < micro - 1 else contextlib.nullcontext():
            (loss / micro).backward()
        if handle is not None:
            handle.remove()
    model.finish_grad_sync()


def _shard_error(
    model: megabuf.DistributedDataParallel, want: dict[str, torch.Tensor], factor: float
) -> float:
    """Largest |reduced - factor * want| over this rank's shard of every bucket, relative to the
    largest |factor * want| there."""
    names = model.engine.param_to_name
    worst, top = 0.0, 0.0
    for buf in model.engine.buffers:  # dense and expert
        for param, slot in buf.param_index_map.items():
            lo, hi = buf.layout.buckets[slot.bucket_id].shard_range(buf.dp_rank, buf.dp_size)
            start, end = max(lo, slot.start), min(hi, slot.end)
            if start >= end:
                continue
            got = buf.reduced_grad(start, end).float()
            ref = want[names[param]].reshape(-1)[start - slot.start : end - slot.start] * factor
            worst = max(worst, (got - ref).abs().max().item())
            top = max(top, ref.abs().max().item())
    return worst / top


def counted_turns(model: megabuf.DistributedDataParallel) -> list[int | None]:
    """[Note: counted arrivals]: each bucket group's Python turns (None: not counting)."""
    return [
        None if g.counted is None else g.counted.python_turns
        for g in model.engine.all_bucket_groups
    ]


def _digest(model: megabuf.DistributedDataParallel) -> str:
    model.publish_params()
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().float().clone().numpy().tobytes())
    return sha.hexdigest()


def _offload_round_trip(model: megabuf.DistributedDataParallel, opt: Any) -> dict[str, Any]:
    """offload(model, opt), the storage walk, restore: (live bytes offloaded, bitwise back)."""
    from megabuf.weights import offload, restore

    digest = _digest(model)
    offload(model, opt)
    walk = live_nbytes(model, opt)
    restore(model, opt)
    return {"walk": walk, "bitwise": _digest(model) == digest}


def hybrid_scaling_case(case: dict[str, Any]) -> dict[str, Any]:
    """STEPS steps at 2 x 2 of `case` (strategy, micro, ddp fields, bf16, fp16, hook, inf_at,
    offload_at): per step the reduced shards' relative error against the global batch's grads
    and whether the step was applied; at the end the params' largest deviation from the
    reference and a digest. `offload_at`: an offload / restore round trip after that step."""
    if case.get("fp16"):
        model, opt = _build_fp16(case)
        ref = Reference({"optimizer": "adamw", "fp16": True})
    else:
        model, opt = hybrid_cases.build({**case, "split": "2x2"})
        ref = hybrid_cases.reference(case)
    if case.get("hook"):
        model.register_comm_hook(Reduce())
    topo = model.process_groups.topology
    out: dict[str, Any] = {"split": (topo.dp_replicate_size, topo.dp_shard_size)}
    out |= {"grad_errors": [], "applied": []}
    for step in range(STEPS):
        factor = float(opt.get_loss_scale())
        want = dict(zip(ref.names, ref._grads(*make_data(step)), strict=True))
        skip = step == case.get("inf_at")  # an inf on rank 3: skipped, the reference skips it
        _sync(model, opt, step, case.get("micro", 1), inf=skip)
        if not skip:
            out["grad_errors"].append(_shard_error(model, want, factor))
        out["applied"].append(bool(opt.step()[0]))
        if not skip:
            ref.step(step)
        if step == case.get("offload_at"):
            out["offload"] = _offload_round_trip(model, opt)
    out["digest"] = _digest(model)
    state, ref_params = model.state_dict(), dict(ref.model.named_parameters())
    out["error"] = max(
        (state[n].detach().float() - p.detach().float()).abs().max().item()
        for n, p in ref_params.items()
    )
    return out


# ---- offload / restore with expert-parallel params ---------------------------------------------
def live_nbytes(model: megabuf.DistributedDataParallel, opt: Any) -> dict[str, int]:
    """An independent walk: bytes of every distinct storage held by the engine's buffers (dense
    and expert separately: each bucket's grads, params, shards, scratch), the bucket groups'
    landing zones, the module's params, grads and buffers, the main params and optimizer state;
    "total" counts a storage shared between kinds once."""
    engine = model.engine
    kinds: dict[str, list[torch.Tensor | None]] = {"dense": [], "expert": [], "other": []}
    for kind, bufs in (("dense", engine.dense_buffers), ("expert", engine.expert_parallel_buffers)):
        for buf in bufs:
            for b in buf.buckets:
                kinds[kind] += [b.grad_data, b.grad_shard, b.param_data, b.param_shard, b.scratch]
    for group in engine.all_bucket_groups:
        if group.sharded_grads is not None:
            kinds["other"] += list(group.sharded_grads.scratch)
    kinds["other"] += [p.data for p in model.module.parameters()]
    kinds["other"] += [p.grad for p in model.module.parameters()]
    kinds["other"] += list(model.module.buffers())
    kinds["other"] += [mp.main for mp in opt.main_params]
    for domain in opt.domains:
        for state in domain.optimizer.state.values():
            kinds["other"] += [v for v in state.values() if isinstance(v, torch.Tensor)]
    out: dict[str, int] = {}
    for kind, tensors in [*kinds.items(), ("total", [t for ts in kinds.values() for t in ts])]:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None and t.untyped_storage().nbytes():
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        out[kind] = sum(seen.values())  # "total": distinct storages over every kind
    return out


def _model_step(model: Any, opt: Any, step: int) -> bool:
    opt.zero_grad()
    matrix_cases._micro_batches(model, step, None, [])
    return bool(opt.step()[0])


def offload_expert_case(strategy: str, hook: bool = False) -> dict[str, Any]:
    """ep 2: a step, offload(model, opt), the storage walk and the ledger, restore (bitwise),
    two more steps; the params against the whole model's three clipped SGD steps. `hook`:
    Reduce() on every buffer."""
    from megabuf.weights import offload, restore
    from megabuf.weights.offload import SHARDED_CATEGORIES

    model, opt = matrix_cases._build(strategy, ep=2)
    if hook:  # every buffer, dense and expert, through the comm-hook path
        model.register_comm_hook(Reduce())
    ref = MoEModel(CFG, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=matrix_cases.LR)
    applied = [_model_step(model, opt, 0)]
    out: dict[str, Any] = {"before": live_nbytes(model, opt)}
    digest = _digest(model)
    report = offload(model, opt)
    out["offloaded"] = live_nbytes(model, opt)
    ledger = model.engine.memory_ledger
    out["ledger"] = {c: ledger.now(c) for c in SHARDED_CATEGORIES}
    out["released"] = report.total_nbytes
    restore(model, opt)
    out["restored"] = live_nbytes(model, opt)
    out["bitwise"] = _digest(model) == digest
    applied += [_model_step(model, opt, step) for step in (1, 2)]
    for step in range(3):
        ref_opt.zero_grad()
        x, y = moe_batch(CFG, matrix_cases.BATCH, seed=100 + step)
        ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), matrix_cases.CLIP)
        ref_opt.step()
    out["applied"] = applied
    out["counted"] = counted_turns(model)
    out["errors"] = matrix_cases._param_errors(model, ref)
    return out


# ---- the weight version over a skipped step ----------------------------------------------------
def version_skip_case(strategy: str) -> dict[str, Any]:
    """ep 2, DynamicGradScaler: steps 0 and 2 clean, step 1 with an inf in one expert's grad on
    rank 1 only (skipped everywhere). After each step: weight_version, the versions
    export_weights(optimizer=...) stamps, and a digest of the params."""
    from megabuf.weights import export_weights
    from megabuf.weights.export import weight_version

    model, opt = matrix_cases._build(strategy, ep=2, scaler=True)
    steps = []
    for step in range(3):
        opt.zero_grad()
        bad = "moe.experts.0.fc1.weight" if step == 1 else None
        matrix_cases._micro_batches(model, step, bad, [], opt, math.inf)
        ok = bool(opt.step()[0])
        stamped = {item.version for item in export_weights(model, optimizer=opt)}
        steps.append({
            "applied": ok, "version": weight_version(opt), "exported": sorted(stamped),
            "digest": _digest(model),
        })  # fmt: skip
    return {"steps": steps, "counted": counted_turns(model)}


# ---- the auto re-plan with the options that move the 1/dp --------------------------------------
def replan_options_case(flags: dict[str, Any]) -> dict[str, Any]:
    """autobucket_cases.replan_case (the re-plan at step k bitwise N steps on that plan from the
    start) with `flags`."""
    from autobucket_cases import replan_case

    return replan_case(flags, "megabuf", 2)


def _scaled_replan_step(model: Any, opt: Any, step: int, inf: bool) -> bool:
    """autobucket_cases' step with the loss scaled; with `inf`, rank 1's grad of the first
    param is made inf (a tensor hook)."""
    from autobucket_cases import GLOBAL_BATCH as BATCH
    from autobucket_cases import MODEL, _agreed, _local

    from megabuf.testing.models import loss_fn as model_loss
    from megabuf.testing.models import make_batch

    model.zero_grad_buffer()  # with bucket_size="auto", where the re-plan happens
    if model.ddp_config.bucket_size == "auto":
        _agreed(model)
    x, y = make_batch(MODEL, BATCH, seed=100 * step)
    handle = None
    if inf and dist.get_rank() == 1:
        param = next(p for p in model.module.parameters() if p.requires_grad)
        handle = param.register_hook(lambda g: torch.full_like(g, math.inf))
    opt.scale_loss(model_loss(MODEL)(model(_local(x)), _local(y))).backward()
    if handle is not None:
        handle.remove()
    model.finish_grad_sync()
    return bool(opt.step()[0])


def replan_scaler_case(
    flags: dict[str, Any], skips: tuple[int, ...], fp16: bool = False
) -> dict[str, Any]:
    """The re-plan (autobucket_cases' injected measurements) with a DynamicGradScaler, two param
    groups whose lr and weight decay differ, and an inf on rank 1 at the steps `skips` (during
    the warm-up and after the re-plan): bitwise the same steps on that plan from the start.
    `fp16`: the model's params in fp16 (fp32 main params)."""
    import copy

    from autobucket_cases import MODEL, STEPS, WARMUP, fake_measurement

    from megabuf.testing.models import build_model

    base = build_model(MODEL, seed=0)
    if fp16:
        base.to(torch.float16)
    out: dict[str, Any] = {}
    runs = {}
    for kind in ("auto", "fixed"):
        auto = kind == "auto"
        extra = {"bucket_size": "auto", "auto_bucket_warmup_steps": WARMUP} if auto else {}
        cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, **extra, **flags)
        model = megabuf.DistributedDataParallel(copy.deepcopy(base), cfg)
        if auto:
            n = len(model.engine.param_to_name)
            model.engine.auto.measure = lambda dtype, n=n: fake_measurement(n, dist.get_rank())  # type: ignore[union-attr]
            out["default_groups"] = len(model.engine.all_bucket_groups)
        else:
            model.engine.rebucket(runs["auto"][0].engine.plan)  # that plan from the start
        sharded = model.ddp_config.use_distributed_optimizer
        cls = megabuf.DistributedOptimizer if sharded else megabuf.MixedPrecisionOptimizer
        scaler = DynamicGradScaler(FP16_SCALE, hysteresis=1, growth_interval=1000)
        opt = cls(
            model, torch.optim.AdamW, param_groups(model.module, 1e-2), lr=1e-2,
            grad_scaler=scaler,
        )  # fmt: skip
        applied = [_scaled_replan_step(model, opt, s, s in skips) for s in range(STEPS)]
        model.publish_params()
        runs[kind] = (model, applied)
    (auto_model, out["applied"]), (fixed_model, out["fixed_applied"]) = runs["auto"], runs["fixed"]
    pairs = list(zip(auto_model.module.parameters(), fixed_model.module.parameters()))
    out["max_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    out["moved"] = max(
        (a - b).abs().max().item()
        for a, b in zip(auto_model.module.parameters(), base.parameters())
    )
    out["groups"] = len(auto_model.engine.all_bucket_groups)
    out["ends"] = auto_model.engine.plan.bucket_ends
    return out


# ---- the weight lifecycle and counted arrivals at pp 2 -----------------------------------------
def pp_lifecycle_case(strategy: str, ep: int) -> dict[str, Any]:
    """matrix_cases.pp_ep_case with a DynamicGradScaler (step 0: an inf on stage 1 only,
    skipped on both stages), and after each step the weight version; after step 1 each stage
    offloads its model and optimizer (the storage walk), restores, and checks the params
    bitwise. The clean steps must still equal the whole model's."""
    from megabuf.weights import offload, restore
    from megabuf.weights.export import weight_version

    seen: dict[str, Any] = {"versions": [], "walk": None, "bitwise": None}

    def after_step(model: Any, opt: Any, step: int) -> None:
        seen["versions"].append(weight_version(opt))
        if step == 1:
            digest = _digest(model)
            offload(model, opt)
            seen["walk"] = live_nbytes(model, opt)
            restore(model, opt)
            seen["bitwise"] = _digest(model) == digest
        seen["counted"] = counted_turns(model)

    out = matrix_cases.pp_ep_case(strategy, ep, scaler=True, after_step=after_step)
    return {**out, **seen}


# ---- counted arrivals under grad_reduce_in_fp32 ------------------------------------------------
def counted_fp32_case() -> dict[str, Any]:
    """no_shard, bf16 params with grad_reduce_in_fp32 (fp32 main_grad): 3 AdamW steps of a
    MixedPrecisionOptimizer; each group's Python turns (the grads are copies, not linked, so
    no group may count: [Note: counted arrivals]) and the params against the bf16 reference."""
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=40, grad_reduce_in_fp32=True
    )
    model = megabuf.DistributedDataParallel(net, cfg)
    opt = megabuf.MixedPrecisionOptimizer(
        model, torch.optim.AdamW, param_groups(net, 1e-2), lr=1e-2
    )
    ref = Reference({"optimizer": "adamw", "bf16": True})
    for step in range(STEPS):
        _sync(model, opt, step, 1)
        opt.step()
        ref.step(step)
    state = model.state_dict()
    named = dict(ref.model.named_parameters())
    return {
        "counted": counted_turns(model),
        "params": {n: (state[n].detach().float(), p.detach().float()) for n, p in named.items()},
    }
