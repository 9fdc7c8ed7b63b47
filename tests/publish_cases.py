"""Rank-side code of the export and publish tests (tests/test_weights_publish.py).

Export cases (2 ranks): an engine trained with `overlap_param_gather` (its gathers in flight when
the export starts) against a twin trained without; the export must equal the twin's params
bitwise, not the pre-step values. Publish cases (3 ranks): ranks 0 and 1 train (dp group
[0, 1]), rank 2 consumes; every rank returns what it saw so the test compares bitwise.
"""

from __future__ import annotations

import itertools
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
from weights_cases import DIM, LAYERS, build, ddp_config, params_of, train_step

import megabuf
from megabuf.testing.models import MLPStack
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import new_subgroup
from megabuf.weights import Publisher, WeightReceiver, export_weights, publish_group

_DP: dict[str, Any] = {}


def _split_halves(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A name map: every weight matrix becomes two halves of rows (as a fused qkv splits)."""
    if tensor.dim() != 2:
        return [(f"consumer.{name}", tensor)]
    top, bottom = tensor.chunk(2, dim=0)
    return [(f"consumer.{name}.top", top), (f"consumer.{name}.bottom", bottom)]


def export_case(strategy: str) -> dict[str, Any]:
    rank, size = dist.get_rank(), dist.get_world_size()
    model, opt = build(strategy, torch.float32, overlap=True)
    twin, twin_opt = build(strategy, torch.float32, overlap=False)
    for step in range(2):
        before = params_of(twin)
        train_step(twin, twin_opt, step, rank, size, torch.float32)
        train_step(model, opt, step, rank, size, torch.float32)
    in_flight = sum(g.param_state.name == "DISPATCHED" for g in model.engine.all_bucket_groups)
    model.engine.memory_ledger.reset_peaks()
    # kept past their turn (list()): under ZeRO-3 each item owns its gathered memory
    kept = list(export_weights(model, optimizer=opt, max_buckets=2))
    items = [(item.version, item.index, [(n, t.clone()) for n, t in item.named]) for item in kept]
    peak = model.engine.memory_ledger.peak("weight_export")
    full = [
        g.sharded_params.full_nbytes for g in model.engine.all_bucket_groups if g.sharded_params
    ]
    pairs = [a + b for a, b in itertools.pairwise(full)] or full
    cast = [
        (n, t.clone())
        for item in export_weights(model, version=7, dtype=torch.bfloat16, name_map=_split_halves)
        for n, t in item.named
    ]
    early = export_weights(model, version=9, max_buckets=2)
    next(early)
    early.close()  # a consumer that stops after one item: the prefetched group is released too
    states = [
        g.sharded_params.state.name for g in model.engine.all_bucket_groups if g.sharded_params
    ]
    return {
        "states_after_close": states,
        "items": items, "twin": params_of(twin), "before": before, "in_flight": in_flight,
        "peak": peak, "formula_peak": max(pairs) if pairs else 0, "cast": cast,
        "export_ledger_now": model.engine.memory_ledger.now("weight_export"),
    }  # fmt: skip


def export_live_case(max_buckets: int) -> dict[str, Any]:
    """Issue 44, defect 2: real memory, not the ledger, during a ZeRO-3 export whose consumer
    drops each item before asking for the next. At every group's gather the case counts the
    earlier groups whose gathered tensors are still alive (weak references to the views the
    export made over its fresh memory) and their storages' bytes, plus the new group's."""
    from megabuf.weights import export as export_module

    rank, size = dist.get_rank(), dist.get_world_size()
    model, opt = build("optim_grads_params", torch.float32)
    train_step(model, opt, 0, rank, size, torch.float32)
    seen: list[tuple[list[Any], int]] = []  # per gathered group: weakrefs, storage bytes
    worst = {"groups": 0, "nbytes": 0}
    start = export_module._Gathered.start

    def spy(chunk: Any, group: Any) -> Any:
        gathered = start(chunk, group)
        storages = {v.untyped_storage().data_ptr(): v.untyped_storage() for v in gathered.views}
        nbytes = sum(s.nbytes() for s in storages.values())
        live = [b for refs, b in seen if any(r() is not None for r in refs)] + [nbytes]
        worst["groups"] = max(worst["groups"], len(live))
        worst["nbytes"] = max(worst["nbytes"], sum(live))
        seen.append(([weakref.ref(v) for v in gathered.views], nbytes))
        return gathered

    export_module._Gathered.start = spy  # type: ignore[method-assign]
    try:
        values: dict[str, torch.Tensor] = {}
        for item in export_weights(model, optimizer=opt, max_buckets=max_buckets):
            values.update((n, t.clone()) for n, t in item.named)
            del item  # this consumer keeps nothing of an item past its turn
    finally:
        export_module._Gathered.start = start  # type: ignore[method-assign]
    full = [g.sharded_params.full_nbytes for g in model.engine.all_bucket_groups]
    windows = [sum(full[i : i + max_buckets]) for i in range(len(full))]
    ref = params_of(model)
    return {
        "live_groups": worst["groups"], "live_nbytes": worst["nbytes"], "formula": max(windows),
        "groups": len(full), "bitwise": all(torch.equal(values[k], ref[k]) for k in ref),
    }  # fmt: skip


def _dp_group() -> Any:
    if "dp" not in _DP:
        _DP["dp"] = new_subgroup(None, [0, 1]) if dist.get_rank() < 2 else None
    return _DP["dp"]


class _DyingLink(Collectives):
    """Trainer 1's link dies at its first send of the publish."""

    def send(self, *args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("trainer 1 died mid-publish (test)")


def publish_case(strategy: str, dtype_name: str | None, late: bool) -> dict[str, Any]:
    """Versions 1..3 to one consumer: full, then changed-only with nothing changed (no step),
    then changed-only after a step in which the first layer did not move."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=60)
    dtype = getattr(torch, dtype_name) if dtype_name else None
    out: dict[str, Any] = {"versions": [], "sent": []}
    if rank == 2:
        receiver = WeightReceiver(group, name_map=lambda n, t: [(f"inference.{n}", t)])
        for v in (1, 2, 3):
            if late and v == 1:
                time.sleep(1.0)  # the trainers wait for the consumer in the header exchange
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
            out["sent"].append(receiver.transfer.send if receiver.transfer else None)
        return out
    model, opt = build(strategy, torch.float32, group=_dp_group(), frozen_first=True)
    publisher = Publisher(model, group, track_changes=True)
    train_step(model, opt, 0, rank, 2, torch.float32)
    for v, step_first in ((1, False), (2, False), (3, True)):
        if step_first:
            train_step(model, opt, v, rank, 2, torch.float32)
        transfer = publisher.publish(version=v, dtype=dtype, changed_only=v > 1)
        out["versions"].append(params_of(model))
        out["sent"].append(transfer.send)
    out["buckets"] = len(publisher.buckets)
    out["publish_peak"] = model.engine.memory_ledger.peak("weight_publish")
    item = torch.finfo(dtype or torch.float32).bits // 8
    copies = dtype is not None or strategy == "no_shard"  # else a view of this rank's shard
    out["publish_peak_formula"] = (
        max(b.numel // 2 for _, b in publisher.buckets) * item if copies else 0
    )
    return out


def dtype_switch_case(strategy: str) -> dict[str, Any]:
    """Issue 44, defect 1 ([Note: what a consumer holds]): version 1 in fp32, version 2 in
    bf16 with changed_only (no step between), version 3 back in fp32 with changed_only after a
    step. The first layer is frozen and bf16 represents its values exactly, so its slices
    compare equal across each switch; the consumer must still get them (not its fresh zeros)."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=60)
    plan = ((1, torch.float32, False), (2, torch.bfloat16, False), (3, torch.float32, True))
    out: dict[str, Any] = {"versions": [], "sent": []}
    if rank == 2:
        receiver = WeightReceiver(group)
        for v, _, _ in plan:
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
        return out
    model, opt = build(strategy, torch.float32, group=_dp_group(), frozen_first=True,
                       bf16_exact=True)  # fmt: skip
    publisher = Publisher(model, group, track_changes=True)
    train_step(model, opt, 0, rank, 2, torch.float32)
    for v, dtype, step_first in plan:
        if step_first:
            train_step(model, opt, v, rank, 2, torch.float32)
        transfer = publisher.publish(version=v, dtype=dtype, changed_only=v > 1)
        out["versions"].append({k: t.to(dtype) for k, t in params_of(model).items()})
        out["sent"].append(transfer.send)
    out["buckets"] = len(publisher.buckets)
    return out


def relayout_case(strategy: str) -> dict[str, Any]:
    """[Note: what a consumer holds] for a layout change: version 1 published, then the engine
    re-plans its buckets (`engine.rebucket`, as bucket_size="auto" does after its warm-up: one
    bucket for the whole model instead of one per layer; under optim_grads_params each layer
    stays its own bucket, on new buffers), version 2 with changed_only and no step between,
    version 3 with changed_only after a step. The Publisher built before the re-plan must
    follow the new buckets and every consumer get the trainers' params bitwise."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=60)
    out: dict[str, Any] = {"versions": [], "sent": [], "buckets": []}
    if rank == 2:
        receiver = WeightReceiver(group)
        for v in (1, 2, 3):
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
        return out
    model, opt = build(strategy, torch.float32, group=_dp_group(), frozen_first=True)
    pgs = megabuf.ProcessGroups.for_dp_group(_dp_group())
    wide = megabuf.DistributedDataParallel(
        MLPStack(DIM, LAYERS, seed=0), ddp_config(strategy, bucket_size=10**6),
        process_groups=pgs,
    )  # fmt: skip
    publisher = Publisher(model, group, track_changes=True)
    train_step(model, opt, 0, rank, 2, torch.float32)
    for v in (1, 2, 3):
        if v == 2:
            opt.zero_grad()
            model.engine.rebucket(wide.engine.plan)
        if v == 3:
            train_step(model, opt, v, rank, 2, torch.float32)
        transfer = publisher.publish(version=v, changed_only=v > 1)
        out["versions"].append(params_of(model))
        out["sent"].append(transfer.send)
        out["buckets"].append(len(publisher.buckets))
    return out


def delta_case(strategy: str, dp: int = 2) -> dict[str, Any]:
    """[Note: element deltas]: bf16 on the wire, a small lr (most bf16 values do not move in a
    step, as in RL fine-tuning), anchor_every=3; ranks 0 .. dp - 1 train, rank dp consumes.
    Versions: 1 whole (a new consumer), 2 and 3 deltas after a step each, 4 an anchor (whole),
    5 whole again (the consumer restarted: a new WeightReceiver), 6 a delta. The consumer
    returns its copy at every version."""
    rank = dist.get_rank()
    if f"dp{dp}" not in _DP and dp != 2:  # members-only group first (see hybrid_publish_case)
        _DP[f"dp{dp}"] = new_subgroup(None, list(range(dp))) if rank < dp else None
    dp_group = _dp_group() if dp == 2 else _DP[f"dp{dp}"]
    group = publish_group(list(range(dp)), [dp], timeout_s=60)
    out: dict[str, Any] = {"versions": [], "deltas": [], "nbytes": [], "density": []}
    if rank == dp:
        receiver = WeightReceiver(group)
        for v in range(1, 7):
            if v == 5:
                receiver = WeightReceiver(group)  # a restarted consumer holds nothing
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
        return out
    if rank > dp:
        return out
    model, opt = build(strategy, torch.float32, group=dp_group, lr=3e-5)
    publisher = Publisher(model, group, track_changes=True, anchor_every=3)
    before = None
    for v in range(1, 7):
        train_step(model, opt, v, rank, dp, torch.float32)
        now = {k: t.to(torch.bfloat16) for k, t in params_of(model).items()}
        transfer = publisher.publish(version=v, dtype=torch.bfloat16, delta=True)
        out["versions"].append(now)
        out["deltas"].append(transfer.deltas)
        out["nbytes"].append(publisher.sent_nbytes)
        if before is not None:
            moved = sum(int((now[k] != before[k]).sum()) for k in now)
            out["density"].append(moved / sum(t.numel() for t in now.values()))
        before = now
    out["whole_nbytes"] = sum(b.numel // dp for _, b in publisher.buckets) * 2
    return out


class _StandInEngine:
    """A tiny inference engine speaking the four-phase weight-transfer protocol: its model has
    the trainer's architecture, its loader copies (name, tensor) pairs into the params."""

    def __init__(self, group: Any) -> None:
        from megabuf.weights.weight_transfer import WeightTransferReceiver

        self.model = MLPStack(DIM, LAYERS, seed=1)  # other values: loading must overwrite them
        self.transfer = WeightTransferReceiver(group, self.load_weights)
        self.transfer.init_weight_transfer_engine({})

    def load_weights(self, weights: Any) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)

    def sync(self, version: int) -> int | None:
        self.transfer.start_weight_update({"version": version})
        self.transfer.update_weights()
        return self.transfer.finish_weight_update()


def weight_transfer_case() -> dict[str, Any]:
    """[Note: four-phase receiver]: rank 2 is a stand-in inference engine; versions 1 (whole)
    and 2, 3 (deltas, bf16 on the wire: the engine's fp32 model gets the bf16 values) reach
    its model through the four calls, and a call out of order is refused by name."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=60)
    out: dict[str, Any] = {"versions": [], "finished": []}
    if rank == 2:
        inference = _StandInEngine(group)
        for v in (1, 2, 3):
            out["finished"].append(inference.sync(v))
            out["versions"].append(params_of(inference.model))
        try:
            inference.transfer.update_weights()
        except RuntimeError as e:
            out["refused"] = str(e)
        return out
    model, opt = build("optim_grads_params", torch.float32, group=_dp_group(), lr=3e-5)
    publisher = Publisher(model, group, track_changes=True)
    for v in (1, 2, 3):
        train_step(model, opt, v, rank, 2, torch.float32)
        publisher.publish(version=v, dtype=torch.bfloat16, delta=True)
        out["versions"].append({k: t.to(torch.bfloat16) for k, t in params_of(model).items()})
    return out


def async_case(strategy: str) -> dict[str, Any]:
    """[Note: asynchronous publish]: a slowed consumer (it sleeps before each receive); the
    trainers start publishing version v (fp32: under the sharded strategies the slice is a
    view of the model's own shard), train the next step at once, then wait. The consumer
    must get version v's weights, not the next step's."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=60)
    out: dict[str, Any] = {"versions": [], "after": []}
    if rank == 2:
        receiver = WeightReceiver(group)
        for v in (1, 2):
            time.sleep(1.0)
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
        return out
    model, opt = build(strategy, torch.float32, group=_dp_group())
    publisher = Publisher(model, group, track_changes=True)
    train_step(model, opt, 0, rank, 2, torch.float32)
    for v in (1, 2):
        out["versions"].append(params_of(model))
        pending = publisher.start_publish(version=v, delta=v > 1)
        out.setdefault("held", []).append(model.engine.memory_ledger.now("weight_publish"))
        train_step(model, opt, v, rank, 2, torch.float32)  # overwrites the params at once
        out["after"].append(params_of(model))
        pending.wait()
        out.setdefault("held_after", []).append(model.engine.memory_ledger.now("weight_publish"))
    return out


def failure_case(kind: str) -> dict[str, Any]:
    """kind: "version" (a consumer expects another version) or "death" (trainer 1's link dies
    mid-publish): every rank raises, none hangs."""
    rank = dist.get_rank()
    group = publish_group([0, 1], [2], timeout_s=3)
    try:
        if rank == 2:
            WeightReceiver(group).receive(expect_version=99 if kind == "version" else None)
        else:
            model, _ = build("optim", torch.float32, group=_dp_group())
            links = _DyingLink() if kind == "death" and rank == 1 else None
            Publisher(model, group, collectives=links).publish(version=1)
    except (RuntimeError, ValueError, ConnectionError) as e:
        return {"raised": f"{type(e).__name__}: {e}"}
    return {"raised": None}


def hybrid_publish_case(shards: int) -> dict[str, Any]:
    """[Note: publishing from replicas]: the model trains as 2 replicas x `shards` shards
    (num_distributed_optimizer_instances=2) on ranks 0 .. 2 * shards - 1, the next rank
    consumes, any further ranks only join the group creations. Replicate rank 0's shard group
    (ranks 0 .. shards - 1) publishes version 1; the other replica is refused a Publisher."""
    rank, dp = dist.get_rank(), 2 * shards
    # the model's groups first: a group made by its members only (the split) after a
    # world-collective group that left some of them out hangs (torch counts groups per rank)
    if f"dp{dp}" not in _DP:
        _DP[f"dp{dp}"] = _dp_group() if dp == 2 else dist.new_group(list(range(dp)))
    if rank < dp:
        model, opt = build("optim_grads", torch.float32, group=_DP[f"dp{dp}"], instances=2)
    group = publish_group(list(range(shards)), [dp], timeout_s=60)  # the whole world calls it
    if rank == dp:
        got = WeightReceiver(group).receive(expect_version=1)
        return {"got": {k: t.clone() for k, t in got.items()}}
    if rank > dp:
        return {}
    train_step(model, opt, 0, rank, dp, torch.float32)
    topo = model.engine.process_groups.topology
    out: dict[str, Any] = {"params": params_of(model)}
    out["split"] = (topo.dp_replicate_size, topo.dp_shard_size)
    if rank < shards:
        publisher = Publisher(model, group)
        out["sent"] = publisher.publish(version=1).send
        out["sent_nbytes"] = publisher.sent_nbytes
        out["model_nbytes"] = sum(b.numel * 4 for _, b in publisher.buckets)
    else:
        try:
            Publisher(model, group)
            out["refused"] = "no error"
        except ValueError as e:
            out["refused"] = str(e)
    return out


def _bf16_params(model: Any) -> dict[str, torch.Tensor]:
    return {k: t.to(torch.bfloat16) for k, t in params_of(model).items()}


def hybrid_delta_case(strategy: str, asynchronous: bool) -> dict[str, Any]:
    """[Note: element deltas] x [Note: publishing from replicas] (5 ranks): ranks 0-3 train as
    2 replicas x 2 shards, replicate rank 0's shard group (ranks 0, 1) publishes bf16 deltas
    (anchor_every=3) to rank 4. Versions 1 whole, 2 and 3 deltas, 4 the anchor, 5 a delta.
    `asynchronous` ([Note: asynchronous publish]): every version is start_publish()ed, the
    next step runs on all four trainer ranks at once, then wait(); the consumer is slowed. It
    sends fp32 (a whole slice is then a view of the model's own shard: the snapshot matters)
    with lr 1e-9 (only small-magnitude fp32 values move: sparse deltas)."""
    rank = dist.get_rank()
    if "dp4" not in _DP:  # members-only, before the publish group (see hybrid_publish_case)
        _DP["dp4"] = new_subgroup(None, [0, 1, 2, 3]) if rank < 4 else None
    if rank < 4:
        lr = 1e-9 if asynchronous else 3e-5
        model, opt = build(strategy, torch.float32, group=_DP["dp4"], instances=2, lr=lr)
    wire = torch.float32 if asynchronous else torch.bfloat16
    group = publish_group([0, 1], [4], timeout_s=60)
    out: dict[str, Any] = {"versions": [], "deltas": [], "after": [], "nbytes": []}
    if rank == 4:
        receiver = WeightReceiver(group)
        for v in range(1, 6):
            if asynchronous:
                time.sleep(0.3)  # the trainers' next step runs meanwhile
            got = receiver.receive(expect_version=v)
            out["versions"].append({k: t.clone() for k, t in got.items()})
        return out
    publisher = Publisher(model, group, track_changes=True, anchor_every=3) if rank < 2 else None
    train_step(model, opt, 1, rank, 4, torch.float32)
    for v in range(1, 6):
        if v > 1 and not asynchronous:
            train_step(model, opt, v, rank, 4, torch.float32)
        out["versions"].append({k: t.to(wire) for k, t in params_of(model).items()})
        pending = None
        if publisher is not None and asynchronous:
            pending = publisher.start_publish(version=v, dtype=wire, delta=True)
        elif publisher is not None:
            out["deltas"].append(publisher.publish(version=v, dtype=wire, delta=True).deltas)
        if asynchronous:
            train_step(model, opt, v + 1, rank, 4, torch.float32)  # overwrites version v
            out["after"].append(params_of(model))
        if pending is not None:
            out["deltas"].append(pending.wait().deltas)
        if publisher is not None:
            out["nbytes"].append(publisher.sent_nbytes)
    if publisher is not None:
        out["whole_nbytes"] = sum(b.numel // 2 for _, b in publisher.buckets) * wire.itemsize
    return out


def late_join_case(strategy: str) -> dict[str, Any]:
    """[Note: element deltas], a consumer joining late (5 ranks): ranks 0, 1 train (dp 2) and
    publish bf16 deltas to rank 2 from version 1; at version 4 rank 3 joins: a new publish
    group with both consumers, which the trainers and rank 2 move to (`use_group`). The joiner
    holds nothing, so version 4 is whole (for both), 5 and 6 deltas again; rank 4 only joins
    the group creations."""
    rank = dist.get_rank()
    dp_group = _dp_group()
    early = publish_group([0, 1], [2], timeout_s=60)
    both = publish_group([0, 1], [2, 3], timeout_s=60)
    out: dict[str, Any] = {"versions": {}, "deltas": []}
    if rank in (2, 3):
        receiver = WeightReceiver(early if rank == 2 else both)
        for v in range(1 if rank == 2 else 4, 7):
            if v == 4 and rank == 2:
                receiver.use_group(both)
            got = receiver.receive(expect_version=v)
            out["versions"][v] = {k: t.clone() for k, t in got.items()}
        return out
    if rank > 3:
        return out
    model, opt = build(strategy, torch.float32, group=dp_group, lr=3e-5)
    publisher = Publisher(model, early, track_changes=True)
    for v in range(1, 7):
        train_step(model, opt, v, rank, 2, torch.float32)
        if v == 4:
            publisher.use_group(both)
        transfer = publisher.publish(version=v, dtype=torch.bfloat16, delta=True)
        out["versions"][v] = _bf16_params(model)
        out["deltas"].append(bool(transfer.deltas))
    return out
