"""Rank-side code for the pipeline tests (runs inside DistPool workers, 4 gloo ranks).

Each case splits one GPT into pp_size * chunks stages, trains N steps with a megabuf schedule on
this rank's chunks and dp slice, and compares every param with the whole GPT trained in one
process on the global batch. It also records the order in which the schedule called its hooks.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import torch
from case_devices import case_device
from moe_cases import groups

import megabuf
from megabuf.pipeline import (
    ScheduleHooks,
    default_schedule_hooks,
    get_forward_backward_func,
    wrap_model_chunks,
)
from megabuf.testing.models import GPT, GPTConfig, gpt_loss, make_batch
from megabuf.testing.stages import split_gpt, stage_index
from megabuf.transport.collectives import Collectives

GCFG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=4, n_heads=2, d_ff=32)
MBS = 2
LR = 0.05


def make_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def global_batch(step: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(GCFG, batch_size=n_rows, seed=500 + step)


def reference_params(
    steps: int, n_rows: int, device: torch.device | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Params after `steps` one-process SGD steps on `device` (default CPU), and the global grad
    norm of each step (the tied embedding is one param here, so it counts once)."""
    device = device or torch.device("cpu")
    gpt = GPT(GCFG, seed=0).to(device)
    opt = make_sgd(gpt.parameters())
    norms = []
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(step, n_rows))
        gpt_loss(gpt(x), y).backward()
        norms.append(torch.stack([p.grad.norm() for p in gpt.parameters()]).norm().item())
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in gpt.named_parameters()}, norms


class Recorder:
    """Wraps a schedule's hooks and the forward step so the call order can be checked."""

    def __init__(self, chunks: list[megabuf.DistributedDataParallel], hooks: ScheduleHooks):
        self.events: list[tuple[Any, ...]] = []
        self.chunks = chunks
        self.base = hooks
        self.microbatch = [0] * len(chunks)

    def hooks(self) -> ScheduleHooks:
        def no_sync(c: int) -> Any:
            @contextmanager
            def cm() -> Iterator[None]:
                self.events.append(("no_sync_enter", c))
                with self.chunks[c].no_sync():
                    yield
                self.events.append(("no_sync_exit", c))

            return cm

        def wrap(name: str, funcs: Any) -> Any:
            if funcs is None:
                return None

            def call(c: int, params: Any) -> None:
                self.events.append((name, c))
                funcs[c](params)

            return [partial(call, c) for c in range(len(self.chunks))]

        def finalize(chunks: Any, num_tokens: Any) -> None:
            self.events.append(("finalize",))
            assert self.base.finalize_model_grads_func is not None
            self.base.finalize_model_grads_func(chunks, num_tokens)

        return ScheduleHooks(
            no_sync_func=[no_sync(c) for c in range(len(self.chunks))],
            grad_sync_func=wrap("grad_sync", self.base.grad_sync_func),
            param_sync_func=wrap("param_sync", self.base.param_sync_func),
            finalize_model_grads_func=finalize,
        )

    def forward_step(self, per_token: bool, data_iterator: Any, model: Any) -> Any:
        c = next(i for i, ch in enumerate(self.chunks) if ch is model)
        m = self.microbatch[c]
        self.microbatch[c] += 1
        tokens, targets = next(data_iterator)
        self.events.append(("F", c, m))
        out = model(tokens)
        out.register_hook(lambda g: self.events.append(("B", c, m)))
        return out, partial(_loss, targets, per_token)


def _loss(targets: torch.Tensor, per_token: bool, logits: torch.Tensor) -> Any:
    if not per_token:
        loss = gpt_loss(logits, targets)
        return loss, {"loss": loss.detach()}
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
    )
    return ce, targets.numel(), {"loss_sum": ce.detach()}


def pipeline_case(case: dict[str, Any]) -> dict[str, Any]:
    pp, n_chunks, m_count = case["pp"], case.get("chunks", 1), case.get("microbatches", 4)
    pgs = groups(pp_size=pp)
    stages = split_gpt(GPT(GCFG, seed=0), pp * n_chunks)
    device = case_device(case)
    mine = [stages[stage_index(pgs.pp_rank, c, pp)].to(device) for c in range(n_chunks)]
    cfg = megabuf.DistributedDataParallelConfig.from_dict(case.get("config", {}))
    chunks = wrap_model_chunks(mine, cfg, pgs)
    params = [p for c in chunks for p in c.parameters()]
    distopt = cfg.use_distributed_optimizer
    if distopt:  # ZeRO-1 over the buffers, same SGD math on sharded fp32 main params
        sgd = megabuf.OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.9)
        opt: Any = megabuf.build_optimizer(chunks, sgd)
    else:  # plain torch optimizer on param.grad (the main_grad views)
        opt = make_sgd(params) if params else None  # pp 4 x 2 chunks: some stages hold no block
    n_rows = pgs.dp_size * m_count * MBS
    rec = Recorder(chunks, default_schedule_hooks(chunks))
    func = get_forward_backward_func(pp, n_chunks)
    steps = case.get("steps", 3)
    norms: list[float] = []
    for step in range(steps):
        rec.events, rec.microbatch = [], [0] * n_chunks
        if distopt:
            opt.zero_grad()  # also dispatches the first lazy param gather (no align)
        for chunk in chunks:
            chunk.zero_grad_buffer()
        x, y = (t.to(device) for t in global_batch(step, n_rows))
        start = pgs.dp_rank * m_count * MBS
        batches = [
            (x[start + m * MBS : start + (m + 1) * MBS], y[start + m * MBS : start + (m + 1) * MBS])
            for m in range(m_count)
        ]
        kwargs: dict[str, Any] = (
            {"tensor_shape": (MBS, GCFG.seq_len, GCFG.d_model)} if pp > 1 else {}
        )
        func(
            forward_step_func=partial(rec.forward_step, case.get("per_token", False)),
            data_iterator=[iter(batches) for _ in chunks] if n_chunks > 1 else iter(batches),
            model=chunks if n_chunks > 1 else chunks[0],
            num_microbatches=m_count,
            hooks=rec.hooks(),
            per_token_loss=case.get("per_token", False),
            **kwargs,
        )
        if distopt:
            norms.append(opt.step()[1])
        elif opt is not None:
            opt.step()
    expected, ref_norms = reference_params(steps, n_rows, device)
    with ExitStack() as stack:  # lazy gathers land (ZeRO-3: every unit gathered) before we read
        for chunk in chunks:
            stack.enter_context(chunk.summon_full_params())
        report = _report(chunks, expected, rec, pgs)
    return {**report, "norms": norms, "ref_norms": ref_norms}


def _report(
    chunks: list[megabuf.DistributedDataParallel],
    expected: dict[str, torch.Tensor],
    rec: Recorder,
    pgs: megabuf.ProcessGroups,
) -> dict[str, Any]:
    errors: dict[str, float] = {}
    tied: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for name, p in chunk.module.named_parameters():
            ref = "tok_emb.weight" if name == "lm_head.weight" else name
            errors[name] = (p.detach() - expected[ref]).abs().max().item()
            if getattr(p, "shared_embedding", False):
                tied[name] = p.detach().clone()
    return {
        "errors": errors,
        "tied": tied,
        "events": rec.events,
        "pp_rank": pgs.pp_rank,
        "n_groups": [len(c.engine.bucket_groups) for c in chunks],
    }


# ---- point-to-point without tags (test_pipeline_p2p.py) ----------------------------------------
# activations of 2 x 288 x 128 fp32 = 288 KiB, above an eager threshold of 256 KiB
P2P_GCFG = GPTConfig(vocab_size=32, seq_len=288, d_model=128, n_layers=4, n_heads=2, d_ff=128)
SAME_TAG = 7
P2P_WAIT_S = 30.0


class NcclLikeP2P(Collectives):
    """Point-to-point as NCCL runs it, on gloo. Every tag becomes SAME_TAG, so gloo matches the
    messages between two ranks in issue order, as NCCL does. Every send, receive or batched group
    is waited for as soon as it is issued, as NCCL's stream holds the next operation back until
    it completes (a send above the eager size completes only once the peer receives; gloo's
    sends do so at every size). A wait longer than P2P_WAIT_S raises: the schedule deadlocked."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"single": 0, "groups": 0, "messages": 0}

    def send(self, tensor: torch.Tensor, dst: int, group: Any, *, tag: int = 0) -> Any:
        self.counts["single"] += 1
        return self._now(super().send(tensor, dst, group, tag=SAME_TAG))

    def recv(self, tensor: torch.Tensor, src: int, group: Any, *, tag: int = 0) -> Any:
        self.counts["single"] += 1
        return self._now(super().recv(tensor, src, group, tag=SAME_TAG))

    def batch_p2p(self, messages: Sequence[Any], group: Any) -> Any:
        self.counts["groups"] += 1
        self.counts["messages"] += len(messages)
        same = [dataclasses.replace(m, tag=SAME_TAG) for m in messages]
        return self._now(super().batch_p2p(same, group))

    @staticmethod
    def _now(pending: Any) -> Any:
        for handle in pending.handles:
            handle.wait(datetime.timedelta(seconds=P2P_WAIT_S))
        pending.handles = []
        return pending


def _p2p_batches(pgs: megabuf.ProcessGroups, m_count: int) -> list[Any]:
    """This dp rank's micro-batches of the one step the p2p cases run."""
    x, y = make_batch(P2P_GCFG, batch_size=pgs.dp_size * m_count * MBS, seed=900)
    start = pgs.dp_rank * m_count * MBS
    return [
        (x[start + m * MBS : start + (m + 1) * MBS], y[start + m * MBS : start + (m + 1) * MBS])
        for m in range(m_count)
    ]


def _p2p_forward_step(data_iterator: Any, model: Any) -> Any:
    tokens, targets = next(data_iterator)
    return model(tokens), partial(_loss, targets, False)


def sequential_reference(n_stages: int, batches: list[Any]) -> dict[str, Any]:
    """One process runs the same stages one after another on each micro-batch (no pipeline, no
    point-to-point): per-micro-batch losses and each stage's accumulated grads, by stage index."""
    stages = split_gpt(GPT(P2P_GCFG, seed=0), n_stages)
    losses = []
    for tokens, targets in batches:
        h = stages[0](tokens)
        for stage in stages[1:]:
            stage.set_input_tensor(h)
            h = stage()
        loss = gpt_loss(h, targets)
        losses.append(loss.detach())
        (loss / len(batches)).backward()
    grads = {(s, n): p.grad for s, st in enumerate(stages) for n, p in st.named_parameters()}
    return {"losses": losses, "grads": grads}


def same_tag_case(case: dict[str, Any]) -> dict[str, Any]:
    """One training step of a schedule whose point-to-point runs through `NcclLikeP2P`: this
    rank's losses and final grads, and (on pp rank 0) the sequential reference of its dp slice."""
    pp, n_chunks, m_count = case["pp"], case.get("chunks", 1), case.get("microbatches", 4)
    pgs = groups(pp_size=pp)
    stages = split_gpt(GPT(P2P_GCFG, seed=0), pp * n_chunks)
    mine = [stages[stage_index(pgs.pp_rank, c, pp)] for c in range(n_chunks)]
    chunks = wrap_model_chunks(mine, megabuf.DistributedDataParallelConfig(), pgs)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    batches = _p2p_batches(pgs, m_count)
    shape = (MBS, P2P_GCFG.seq_len, P2P_GCFG.d_model)
    coll = NcclLikeP2P()
    metrics = get_forward_backward_func(pp, n_chunks)(
        forward_step_func=_p2p_forward_step,
        data_iterator=[iter(batches) for _ in chunks] if n_chunks > 1 else iter(batches),
        model=chunks if n_chunks > 1 else chunks[0],
        num_microbatches=m_count,
        tensor_shape=shape,
        collectives=coll,
        hooks=default_schedule_hooks(chunks),
    )
    grads = {
        (stage_index(pgs.pp_rank, c, pp), name): p.grad.clone()
        for c, chunk in enumerate(chunks)
        for name, p in chunk.module.named_parameters()
    }
    return {
        "pp_rank": pgs.pp_rank,
        "dp_rank": pgs.dp_rank,
        "losses": [m["loss"] for m in metrics],
        "grads": grads,
        "counts": coll.counts,
        "activation_nbytes": math.prod(shape) * torch.finfo(torch.float32).bits // 8,
        "reference": sequential_reference(pp * n_chunks, batches) if pgs.pp_rank == 0 else None,
    }
