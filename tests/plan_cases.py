"""Rank-side code for "DDP builds exactly the plan `megabuf inspect` prints" (DistPool workers).

Each case builds the MoE test model (experts optionally bf16), inspects it as `megabuf inspect`
would at this world's dp/ep sizes, wraps it, and describes both the inspection and the objects DDP
really allocated (buffers, buckets, bucket groups, chains) in one plain form the test compares.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from moe_cases import CFG, groups

import megabuf
from megabuf.inspect import Inspection, inspect_model
from megabuf.testing.moe import MoEModel


def describe_inspection(info: Inspection) -> dict[str, Any]:
    """What `megabuf inspect` reports, in the form `describe_ddp` gives."""
    buffers = [
        (b.expert, str(b.param_dtype), str(b.grad_dtype), list(b.param_names), b.layout.numel,
         [(k.start, k.end, list(k.param_names)) for k in b.buckets])
        for b in info.buffers
    ]  # fmt: skip
    groups_ = [(g.group_id, g.expert, [list(m) for m in g.members]) for g in info.plan.groups]
    return {
        "bucket_size": info.bucket_size,
        "buffers": buffers,
        "groups": groups_,
        "chains": [list(c) for c in info.plan.chains],
    }


def describe_ddp(model: megabuf.DistributedDataParallel) -> dict[str, Any]:
    """What DDP really allocated, read from its buffers, buckets, groups and chains."""
    names = model.engine.param_to_name
    all_buffers = [*model.buffers, *model.engine.expert_parallel_buffers]
    where = {id(k): (i, k.bucket_id) for i, buf in enumerate(all_buffers) for k in buf.buckets}
    buffers = [
        (buf.is_expert_parallel, str(buf.param_dtype), str(buf.grad_dtype),
         [names[p] for p in buf.params], buf.numel,
         [(k.offset, k.offset + k.numel, [names[p] for p in k.params_list]) for k in buf.buckets])
        for buf in all_buffers
    ]  # fmt: skip
    expert_groups = {id(g) for g in model.engine.expert_parallel_bucket_groups}
    groups_ = [
        (g.group_id, id(g) in expert_groups, [list(where[id(k)]) for k in g.buckets])
        for g in model.engine.all_bucket_groups
    ]
    chains = [[g.group_id for g in chain.groups] for chain in model.engine.sync.chains]
    for chain in model.engine.sync.chains:
        if any(g.chain is not chain for g in chain.groups):
            raise AssertionError("a bucket group does not point at the chain that holds it")
    return {
        "bucket_size": model.engine.plan.bucket_size,
        "buffers": buffers,
        "groups": groups_,
        "chains": chains,
    }


def ddp_vs_inspect(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per case: (inspection, ddp) descriptions and whether
    `model.engine.plan == inspection.plan`."""
    out = {}
    dp_size = dist.get_world_size()
    for name, case in cases.items():
        pgs = groups(ep_size=case["ep"])
        net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
        if case.get("bf16_experts"):
            net.moe.experts.to(torch.bfloat16)
        cfg = megabuf.DistributedDataParallelConfig.from_dict(case.get("config", {}))
        disable = bool(case.get("disable_bucketing", False))
        info = inspect_model(net, cfg, dp_size, ep_size=case["ep"], disable_bucketing=disable)
        model = megabuf.DistributedDataParallel(
            net, cfg, process_groups=pgs, disable_bucketing=disable
        )
        out[name] = {
            "inspect": describe_inspection(info),
            "ddp": describe_ddp(model),
            "same_plan": model.engine.plan == info.plan,
        }
    return out
