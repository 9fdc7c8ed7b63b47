"""Rank-side code for the hybrid sharding tests (runs inside DistPool workers).

Every case trains optimizer_cases.Net (a tied weight, a param whose grad is always 0, an extra
frozen param when asked) with megabuf DDP + DistributedOptimizer (AdamW) on this rank's slice of
the global batch, split into `micro` micro-batches (all but the last inside no_sync()), and
returns what the test side compares: the published params (bytes, to compare between runs and
between ranks), the largest deviation from the single-process reference on the whole global
batch (optimizer_cases.Reference), and the calls and bytes each process group was handed.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from optimizer_cases import GLOBAL_BATCH, Net, Reference, loss_fn, make_data, param_groups

import megabuf

STEPS = 3


def groups(split: str) -> megabuf.ProcessGroups:
    """ "flat", "RxS" (ProcessGroups.build(dp_shard_size=S)), "mesh:RxS" (a DeviceMesh) or
    "config:R" (flat groups; the config's num_distributed_optimizer_instances splits them)."""
    if split == "flat" or split.startswith("config:"):
        return megabuf.ProcessGroups.build()
    if split.startswith("mesh:"):
        from torch.distributed.device_mesh import init_device_mesh

        r, s = (int(v) for v in split[5:].split("x"))
        mesh = init_device_mesh("cpu", (r, s), mesh_dim_names=("replicate", "shard"))
        return megabuf.ProcessGroups.from_device_mesh(mesh)
    r, s = (int(v) for v in split.split("x"))
    pgs = megabuf.ProcessGroups.build(dp_shard_size=s)
    if pgs.topology.dp_replicate_size != (r if r > 1 else 1):
        raise AssertionError(f"{split}: got {pgs.topology}")
    return pgs


def build(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    torch.manual_seed(0)
    net = Net()
    if case.get("bf16"):
        net.to(torch.bfloat16)
    if case.get("frozen"):
        net.block.bias.requires_grad_(False)
    if case.get("expert"):  # ep = 1: expert buffers over expt_dp == dp, split the same way
        megabuf.mark_expert_parallel(net.tail.parameters())
    split = case["split"]
    replicas = int(split[7:]) if split.startswith("config:") else 1
    fields = {
        "data_parallel_sharding_strategy": case["strategy"], "overlap_grad_reduce": True,
        "bucket_size": 40, "num_distributed_optimizer_instances": replicas,
        "sharded_grad_accumulation": case.get("accumulation", "accumulate_unsharded"),
        **case.get("ddp", {}),
    }  # fmt: skip
    cfg = megabuf.DistributedDataParallelConfig(**fields)
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=groups(split))
    opt = megabuf.DistributedOptimizer(
        model, torch.optim.AdamW, param_groups(model.module, 1e-2), lr=1e-2
    )
    return model, opt


class FrozenReference(Reference):
    """A frozen param gets no grad; here it counts as a zero grad, which AdamW without weight
    decay (its param group: vectors) turns into a zero update: the param stays as it is."""

    def _grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        self.model.zero_grad()
        loss_fn(self.model(x), y).backward()
        return [
            torch.zeros_like(m) if p.grad is None else p.grad.float()
            for p, m in zip(self.params, self.masters, strict=True)
        ]


def reference(case: dict[str, Any]) -> Reference:
    spec = {"optimizer": "adamw", "bf16": case.get("bf16", False)}
    if not case.get("frozen"):
        return Reference(spec)
    ref = FrozenReference(spec)
    ref.model.block.bias.requires_grad_(False)
    return ref


def train(model: megabuf.DistributedDataParallel, opt: Any, step: int, micro: int) -> None:
    x, y = make_data(step)
    n = GLOBAL_BATCH // dist.get_world_size()
    lo = dist.get_rank() * n
    x, y = x[lo : lo + n], y[lo : lo + n]
    m = n // micro
    opt.zero_grad()
    for i in range(micro):
        xs, ys = x[i * m : (i + 1) * m], y[i * m : (i + 1) * m]
        if i < micro - 1:
            with model.no_sync():
                (loss_fn(model(xs), ys) / micro).backward()
        else:
            (loss_fn(model(xs), ys) / micro).backward()
    model.finish_grad_sync()
    opt.step()


def hybrid_case(case: dict[str, Any]) -> dict[str, Any]:
    """STEPS steps; per step the replicate group's calls, at the end the params and their
    largest deviation from the reference."""
    model, opt = build(case)
    timeline = model.enable_timeline()
    ref = reference(case)
    replicate_calls: list[int] = []
    digests: list[str] = []
    for step in range(STEPS):
        before = model.engine.collectives.stats_of(model.process_groups.dp_replicate).calls.get(
            "all_reduce", 0
        )
        micro = case.get("micro_by_rank", [case.get("micro", 1)] * dist.get_world_size())
        train(model, opt, step, micro[dist.get_rank()])
        after = model.engine.collectives.stats_of(model.process_groups.dp_replicate).calls
        replicate_calls.append(after.get("all_reduce", 0) - before)
        ref.step(step)
        if case.get("every_step"):  # whole params (ZeRO-3: gathered), one digest per step
            digests.append(_digest(model))
    model.publish_params()
    ref_params = dict(ref.model.named_parameters())
    state = model.state_dict()  # whole params under every strategy (ZeRO-3: gathered)
    params = {n: state[n].detach().float().clone() for n in ref_params}
    topo = model.process_groups.topology
    return {
        "params": {n: p.numpy().tobytes() for n, p in params.items()},
        "error": max(
            (p - ref_params[n].detach().float()).abs().max().item() for n, p in params.items()
        ),
        "replicate_calls": replicate_calls,
        "digests": digests,
        "replicate_events": sum(name == "replicate_dispatch" for _, name, _ in timeline.events),
        "groups": len(model.engine.all_bucket_groups),
        "buckets": sum(len(g.buckets) for g in model.engine.all_bucket_groups),
        # padded grad bytes of every bucket (n * g of the wire formula; all fp32 here)
        "bucket_nbytes": sum(
            b.layout.numel * b.grad_dtype.itemsize
            for b in [*model.buffers, *model.engine.expert_parallel_buffers]
        ),
        "split": (topo.dp_replicate_size, topo.dp_shard_size),
        "group_bytes": {
            name: dict(stats.ring_nbytes)
            for name, stats in model.engine.collectives.group_stats.items()
        },
    }


def _digest(model: megabuf.DistributedDataParallel) -> str:
    """A hash of every param's bytes (state_dict: whole params under every strategy)."""
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().float().clone().numpy().tobytes())  # a copy: numpy pins storage
    return sha.hexdigest()


def error_of(fn: Any, *args: Any, **kwargs: Any) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return "no error"


def misuse_errors() -> dict[str, str]:
    """Named errors for impossible splits and unsupported combinations."""
    world = dist.get_world_size()
    out = {
        "not_divisible": error_of(megabuf.ProcessGroups.build, dp_shard_size=3),
        "no_shard": error_of(build, {"split": "2x2", "strategy": "no_shard"}),
        "hook": error_of(_hook_under_hybrid),
        "config_r_not_dividing": error_of(build, {"split": "config:3", "strategy": "optim"}),
    }
    if world == 4:
        out["expert"] = error_of(lambda: megabuf.ProcessGroups.build(ep_size=2, dp_shard_size=2))
        out["unnamed_mesh"] = error_of(_unnamed_mesh)
    return out


def _hook_under_hybrid() -> None:
    """A hook that keeps state per bucket cannot run on the second level ([Note: comm hooks
    under hybrid]; Compress and the deterministic mode can: test_hybrid_hooks.py)."""
    model, _ = build({"split": "2x2", "strategy": "optim"})
    model.register_comm_hook(megabuf.comm_hooks.PowerSGD(rank=1))


def _unnamed_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    megabuf.ProcessGroups.from_device_mesh(init_device_mesh("cpu", (2, 2)))


def checkpoint_case(save: dict[str, Any], load: dict[str, Any], path: str) -> dict[str, Any]:
    """Two steps at `save`'s split and strategy, a checkpoint, then a fresh model at `load`'s
    loads it and takes the third step; the params against the reference's three steps."""
    model, opt = build(save)
    ref = reference(save)
    for step in range(2):
        train(model, opt, step, 1)
        ref.step(step)
    megabuf.save_checkpoint(path, model, opt)
    model, opt = build(load)
    megabuf.load_checkpoint(path, model, opt)
    train(model, opt, 2, 1)
    ref.step(2)
    state = model.state_dict()
    ref_params = dict(ref.model.named_parameters())
    params = {n: state[n].detach().float().clone() for n in ref_params}
    return {
        "params": {n: p.numpy().tobytes() for n, p in params.items()},
        "error": max(
            (p - ref_params[n].detach().float()).abs().max().item() for n, p in params.items()
        ),
    }


def _train_explicit(
    model: megabuf.DistributedDataParallel, opt: Any, step: int, micro: int
) -> None:
    """As `train`, every micro-batch inside no_sync() and the step ended by finish_grad_sync()
    (the Megatron loop)."""
    x, y = make_data(step)
    n = GLOBAL_BATCH // dist.get_world_size()
    lo = dist.get_rank() * n
    m = n // micro
    opt.zero_grad()
    for i in range(micro):
        xs, ys = x[lo + i * m : lo + (i + 1) * m], y[lo + i * m : lo + (i + 1) * m]
        with model.no_sync():
            (loss_fn(model(xs), ys) / micro).backward()
    model.finish_grad_sync()
    opt.step()


def mismatched_micro_batches(case: dict[str, Any]) -> dict[str, Any]:
    """[Note: micro-batch agreement]: rank r runs `micro_by_rank[r]` micro-batches per step;
    returns every rank's error (or "no error") and, after it, whether a fresh model still
    trains one step on the same groups (nothing left in flight that pairs wrongly)."""
    model, opt = build(case)
    micro = case["micro_by_rank"][dist.get_rank()]
    step = _train_explicit if case.get("explicit") else train
    error = error_of(step, model, opt, 0, micro)
    model, opt = build(case)
    train(model, opt, 0, 1)
    return {"error": error}


def lifecycle_case(case: dict[str, Any]) -> dict[str, Any]:
    """The RL weight lifecycle under the split: 3 steps of 2 micro-batches, with offload() and
    restore() of the model and its optimizer after the second, against a twin that never
    offloads; then export_weights. Returns whether the restore was bitwise (params before and
    after, and the twin's params after the third step: the optimizer state came back too), the
    export against the whole params and the reference."""
    from megabuf.weights import export_weights, is_offloaded, offload, restore

    model, opt = build(case)
    twin, twin_opt = build(case)
    ref = reference(case)
    out: dict[str, Any] = {}
    for step in range(STEPS):
        train(model, opt, step, 2)
        train(twin, twin_opt, step, 2)
        ref.step(step)
        if step == 1:
            before = _digest(model)
            report = offload(model, opt)
            out["offloaded"] = is_offloaded(model) and report.total_nbytes > 0
            restore(model, opt)
            out["restored_bitwise"] = _digest(model) == before
    out["matches_twin"] = _digest(model) == _digest(twin)
    exported, versions = {}, set()
    for item in export_weights(model, optimizer=opt):  # an item is valid until the next one
        exported |= {n: t.detach().float().clone() for n, t in item.named}
        versions.add(item.version)
    state = model.state_dict()
    ref_params = dict(ref.model.named_parameters())
    out["versions"] = sorted(versions)
    out["export_is_state"] = all(torch.equal(t, state[n].float()) for n, t in exported.items())
    out["names"] = sorted(exported)
    out["ref_names"] = sorted(ref_params)
    out["error"] = max(
        (exported[n] - p.detach().float()).abs().max().item()
        for n, p in ref_params.items()
        if n in exported
    )
    return out
