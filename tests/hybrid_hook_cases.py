"""Rank side of tests/test_hybrid_hooks.py: comm hooks and deterministic_reduction under a hybrid
split ([Note: comm hooks under hybrid]) on 4 gloo ranks: 2 replicas x 2-way shard (each level
sums two terms, which any order rounds alike), and 4 x 1 (four replicas: the second level's
order shows).

Each case trains hybrid_cases' model (optimizer_cases.Net, AdamW, `micro` micro-batches) with a
hook, and returns per step: the calls each process group was handed, a digest of the published
params (replicas must agree after every step) and, under the deterministic mode, whether this
rank's reduced grad shard is bitwise `HierarchicalReference`'s: every rank's local grads
computed here in one process and summed in the order [Note: deterministic reduction under
hybrid] defines. At the end: the params, their largest deviation from that reference's AdamW
steps and from the global-batch reference (hybrid_cases.reference)."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from hybrid_cases import STEPS, build, error_of, reference
from optimizer_cases import GLOBAL_BATCH, Reference, loss_fn, make_data

import megabuf
from megabuf.comm_hooks import Compress, PowerSGD, Quantize, Reduce
from megabuf.comm_hooks.telemetry import hooked_buckets, wire_formula

WORLD = 4  # R x S: dp_rank = replicate_rank * S + shard_rank


class HierarchicalReference(Reference):
    """The global batch's AdamW steps on the grads [Note: deterministic reduction under hybrid]
    defines (fp32 grads, average_in_collective off): rank k's local grads (its slice, its
    micro-batches accumulated in fp32 as main_grad does) times 1/dp, summed in fp32 in
    shard-rank order inside each replica (per micro-batch under reduce_each_microbatch, the
    micro-batches then added in order), then the replicas' sums in replicate-rank order."""

    def __init__(
        self, micro_by_rank: list[int], each: bool, hook: str, shard_size: int, average: bool
    ) -> None:
        super().__init__({"optimizer": "adamw"})
        self.micro_by_rank, self.each, self.shard_size = micro_by_rank, each, shard_size
        self.average = average  # average_in_collective: no pre-scale, each level divides by
        # its group size after its sum
        self.prescale = 1.0 if average else 1.0 / WORLD
        self.hook = hook  # "compress": each level's sum of 2 in bf16, then fp32; "compress_fp32":
        # bf16 terms summed in fp32 in rank order, the second level's sum rounded to bf16
        self.grads: list[torch.Tensor] = []  # the last step's, per param

    def _local(self, x: torch.Tensor, y: torch.Tensor, k: int) -> list[list[torch.Tensor]]:
        """Rank k's pre-scaled grads per reduction (one, or one per micro-batch)."""
        n = GLOBAL_BATCH // WORLD
        x, y, m = x[k * n : (k + 1) * n], y[k * n : (k + 1) * n], self.micro_by_rank[k]
        size, out = n // m, []
        self.model.zero_grad()
        for i in range(m):
            loss_fn(self.model(x[i * size : (i + 1) * size]), y[i * size : (i + 1) * size]).div(
                m
            ).backward()
            if self.each:
                out.append([p.grad.clone() * self.prescale for p in self.params])
                self.model.zero_grad()
        if not self.each:
            out.append([p.grad.clone() * self.prescale for p in self.params])
        return out

    def _grads(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        replicas = []
        s_size = self.shard_size
        for r in range(WORLD // s_size):
            ranks = [self._local(x, y, r * s_size + s) for s in range(s_size)]
            acc: list[torch.Tensor] | None = None
            for reduction in zip(*ranks, strict=True):  # micro-batch order
                first = [self._sum(list(per_param), 1) for per_param in zip(*reduction)]
                acc = first if acc is None else [a + f for a, f in zip(acc, first, strict=True)]
            replicas.append(acc)
        self.grads = [self._sum(list(per_param), 2) for per_param in zip(*replicas)]
        return [g.clone() for g in self.grads]

    def _sum(self, values: list[torch.Tensor], level: int) -> torch.Tensor:
        """One level's sum, as the case's hook takes it: fp32 in rank order (the mode, Reduce
        at 2 terms); Compress: in bf16 (2 terms: order-free); Compress(accumulate="fp32"): bf16
        terms, fp32 in rank order, the all-reduce's (second level's) result rounded to bf16."""
        if self.hook == "compress":
            values = [v.bfloat16() for v in values]
        elif self.hook == "compress_fp32":
            values = [v.bfloat16().float() for v in values]
        total = values[0].clone()
        for v in values[1:]:
            total += v
        if self.average:
            total = total / len(values)
        if self.hook == "compress_fp32" and level == 2:
            total = total.bfloat16()
        return total.float()


def _shard_matches(model: megabuf.DistributedDataParallel, ref: HierarchicalReference) -> bool:
    """This rank's reduced shard of every bucket, param element by param element, is bitwise
    the reference's grads."""
    want = {n: g for n, g in zip(ref.names, ref.grads, strict=True)}
    names = model.engine.param_to_name
    for buf in [*model.buffers, *model.engine.expert_parallel_buffers]:
        for param, slot in buf.param_index_map.items():
            lo, hi = buf.layout.buckets[slot.bucket_id].shard_range(buf.dp_rank, buf.dp_size)
            start, end = max(lo, slot.start), min(hi, slot.end)
            if start >= end:
                continue
            got = buf.reduced_grad(start, end)
            ref = want[names[param]].reshape(-1)[start - slot.start : end - slot.start]
            if not torch.equal(got.view(torch.int32), ref.view(torch.int32)):
                return False
    return True


def _register(model: megabuf.DistributedDataParallel, hook: str) -> None:
    if hook == "compress":
        model.register_comm_hook(Compress(torch.bfloat16))
    elif hook == "compress_dense":  # the expert buffers keep the engine's reduction
        model.register_comm_hook(Compress(torch.bfloat16), buffers="dense")
    elif hook == "compress_fp32":  # deterministic: stands in for the mode's hook
        model.register_comm_hook(Compress(torch.bfloat16, "fp32"))
    elif hook == "quantize":
        model.register_comm_hook(Quantize(block=16))
    elif hook == "reduce":
        model.register_comm_hook(Reduce())


def _calls(model: megabuf.DistributedDataParallel) -> dict[str, dict[str, int]]:
    return {n: dict(s.calls) for n, s in model.engine.collectives.group_stats.items()}


def _digest(model: megabuf.DistributedDataParallel) -> tuple[str, dict[str, torch.Tensor]]:
    model.publish_params()
    state = model.state_dict()  # whole params under every strategy (ZeRO-3: gathered)
    params = {n: state[n].detach().float().clone() for n, _ in model.module.named_parameters()}
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params.values())).hexdigest()
    return digest, params


def hooked_case(case: dict[str, Any]) -> dict[str, Any]:
    """STEPS steps at 2 x 2 with `case["hook"]` ("compress", "quantize", "reduce", "none" or
    "deterministic": the mode), `strategy`, `micro` (or `micro_by_rank`), `accumulation`,
    extra `ddp` fields."""
    det = case["hook"] in ("deterministic", "compress_fp32")
    ddp = {"deterministic_reduction": det, **case.get("ddp", {})}
    split = case.get("split", "2x2")
    model, opt = build({**case, "split": split, "ddp": ddp})
    _register(model, case["hook"])
    micro_by_rank = case.get("micro_by_rank", [case.get("micro", 1)] * WORLD)
    each = case.get("accumulation") == "reduce_each_microbatch"
    s_size, average = int(split.split("x")[1]), ddp.get("average_in_collective", False)
    hier = HierarchicalReference(micro_by_rank, each, case["hook"], s_size, average)
    flat = reference({})
    calls, digests, bitwise = [], [], []
    for step in range(STEPS):
        before = _calls(model)
        hier._grads(*make_data(step))  # this step's grads, from the reference's params
        bitwise.append(_train_and_compare(model, opt, step, micro_by_rank[dist.get_rank()], hier))
        after = _calls(model)
        calls.append({
            n: {op: c - before.get(n, {}).get(op, 0) for op, c in ops.items()
                if c != before.get(n, {}).get(op, 0)}
            for n, ops in after.items()
        })  # fmt: skip
        hier.step(step)
        flat.step(step)
        digests.append(_digest(model)[0])
    _, params = _digest(model)
    hier_params, flat_params = (
        dict(hier.model.named_parameters()),
        dict(flat.model.named_parameters()),
    )
    return {
        "calls": calls,
        "digests": digests,
        "grads_bitwise": bitwise,
        "params": {n: p.numpy().tobytes() for n, p in params.items()},
        "error": max((p - flat_params[n].detach()).abs().max().item() for n, p in params.items()),
        "hier_error": max(
            (p - hier_params[n].detach()).abs().max().item() for n, p in params.items()
        ),
        "hooks": sorted({type(g.comm_hook).__name__ for g in model.engine.all_bucket_groups}),
        "chains": len({id(g.chain) for g in model.engine.all_bucket_groups}),
        "buckets": sum(len(g.buckets) for g in model.engine.all_bucket_groups),
        "replica_views": sum(len(g.replicas.hook_buckets) for g in model.engine.all_bucket_groups),
        "wire": _wire(model, case["hook"]),
    }


def _wire(model: megabuf.DistributedDataParallel, hook: str) -> list[tuple[Any, ...]]:
    """comm_hook_report's rows, (level, mode, group size, dispatches, ring bytes per dispatch,
    wire_formula's figure for the row's view)."""
    spec = {"compress": {"name": "compress", "dtype": "bfloat16"}, "reduce": {"name": "reduce"}}
    formulas = [
        wire_formula(spec[hook], b) if hook in spec else None for _, b in hooked_buckets(model)
    ]
    rows = model.engine.hooks.comm_hook_report().buckets
    return [
        (w.level, w.mode, w.group_size, w.dispatches, w.ring_nbytes_per_dispatch, f)
        for w, f in zip(rows, formulas, strict=True)
    ]


def _train_and_compare(
    model: megabuf.DistributedDataParallel, opt: Any, step: int, micro: int,
    hier: HierarchicalReference,
) -> bool:  # fmt: skip
    """hybrid_cases.train's step; whether the reduced shards were bitwise `hier`'s grads
    before the optimizer stepped."""
    x, y = make_data(step)
    n = GLOBAL_BATCH // WORLD
    x, y = x[dist.get_rank() * n :][:n], y[dist.get_rank() * n :][:n]
    m = n // micro
    opt.zero_grad()
    for i in range(micro):
        loss = loss_fn(model(x[i * m : (i + 1) * m]), y[i * m : (i + 1) * m]) / micro
        if i < micro - 1:
            with model.no_sync():
                loss.backward()
        else:
            loss.backward()
    model.finish_grad_sync()
    matched = _shard_matches(model, hier)
    opt.step()
    return matched


def refusals() -> dict[str, str]:
    """What a stateful hook under hybrid raises (PowerSGD under "optim": its error feedback)."""
    model, _ = build({"split": "2x2", "strategy": "optim"})
    return {
        "powersgd": error_of(model.register_comm_hook, PowerSGD(rank=1)),
        "registered": str([g.comm_hook for g in model.engine.all_bucket_groups]),
    }
