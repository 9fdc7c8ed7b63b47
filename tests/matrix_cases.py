"""Rank-side code for the combination-matrix tests (tests/test_matrix.py; 4 gloo ranks).

Each case crosses a feature with a sharding strategy at a group shape where the groups differ:
ep 2 on 4 ranks gives dp 4 and expert dp 2 (rank order (pp, expt_dp, ep): expt_dp [0,2] [1,3],
ep [0,1] [2,3]), so using dp where expt_dp is meant, or a dp rank where an expert-dp rank is
meant, changes the result. The ranks are made to differ on purpose (a NaN on one rank, in one
micro-batch, in one expert), and every result is checked against the whole model stepped in
one process on the global batch (torch's SGD and clip_grad_norm_), or against an independent
recomputation from every rank's gathered values.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from checkpoint_combo_cases import STRATEGIES  # the five strategy configs, shared
from dist_pool import run_each
from moe_cases import CFG, groups, reference_name
from torch import nn

import megabuf
from megabuf.comm_hooks import LocalSGD, PeriodicAverager, Reduce
from megabuf.optimizer.grad_scaler import DynamicGradScaler
from megabuf.pipeline import default_schedule_hooks, get_forward_backward_func, wrap_model_chunks
from megabuf.planning.replicas import is_expert_parallel
from megabuf.testing.moe import MoEModel, moe_batch

BATCH = 48  # 12 rows per dp rank at dp 4: 3 micro-batches of 4
MICRO = 3
CLIP = 0.05  # well below the model's grad norm (~1): every step clips, so the norm matters
LR = 0.5
BAD_RANK, BAD_MICRO = 1, 1  # the NaN: on global rank 1 only, in micro-batch 1 of 3 only


def _bad_param(ep: int) -> str:
    """Where the NaN goes: at ep > 1 one local expert's weight (expert buffers, reduced over
    expt_dp); at ep 1 a dense weight (the dp-only shape's dense buffers)."""
    return "moe.experts.0.fc1.weight" if ep > 1 else "head.weight"


def _build(
    strategy: str, ep: int, scaler: bool = False
) -> tuple[megabuf.DistributedDataParallel, Any]:
    """The MoE model under `strategy` with clipped SGD: built from the config, or with
    `scaler` (and no NaN check) the optimizer class by hand with a DynamicGradScaler."""
    pgs = groups(ep_size=ep)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=64, check_for_nan_in_grad=not scaler,
        **STRATEGIES[strategy],
    )  # fmt: skip
    with warnings.catch_warnings():  # ZeRO-3's one-unit warning: the model is one unit
        warnings.simplefilter("ignore")
        model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    if scaler:
        cls = megabuf.MixedPrecisionOptimizer if strategy == "no_shard" else None
        grad_scaler = DynamicGradScaler(SCALE, hysteresis=1, growth_interval=2)
        opt = (cls or megabuf.DistributedOptimizer)(
            model, torch.optim.SGD, lr=LR, clip_grad=CLIP, grad_scaler=grad_scaler
        )
        return model, opt
    opt_cfg = megabuf.OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, clip_grad=CLIP)
    return model, megabuf.build_optimizer(model, opt_cfg)


def _micro_batches(
    model: megabuf.DistributedDataParallel,
    step: int,
    poison: str | None,
    fired: list[int],
    opt: Any = None,
    bad: float = math.nan,
) -> None:
    """This rank's rows of the global batch of `step` in MICRO micro-batches (all but the last
    under no_sync). With `poison`, rank BAD_RANK's micro-batch BAD_MICRO gives that param a NaN
    grad (a tensor hook: before the grad reaches megabuf), noted in `fired`; `bad` is NaN or
    inf. With `opt`, the loss is scaled by its loss scale."""
    pgs = model.process_groups
    x, y = moe_batch(CFG, BATCH, seed=100 + step)
    n = BATCH // pgs.dp_size
    k = n // MICRO
    for i in range(MICRO):
        rows = slice(pgs.dp_rank * n + i * k, pgs.dp_rank * n + (i + 1) * k)
        handle = None
        if poison is not None and i == BAD_MICRO and dist.get_rank() == BAD_RANK:
            param = model.module.get_parameter(poison)
            handle = param.register_hook(lambda g: fired.append(1) or torch.full_like(g, bad))
        try:
            with model.no_sync() if i < MICRO - 1 else contextlib.nullcontext():
                loss = ((model(x[rows]) - y[rows]) ** 2).mean(dim=1).mean() / MICRO
                (
                    loss if opt is None else opt.scale_loss(loss)
                ).backward()  # the last one ends with the grad sync (and the NaN check)
        finally:
            if handle is not None:
                handle.remove()


def nan_then_clip_case(strategy: str, ep: int, hook: bool = False) -> dict[str, Any]:
    """Iteration 0: a NaN in one param's grad on rank 1, micro-batch 1 only; finish_grad_sync
    (at the end of backward) must raise on every rank naming rank 1 and that param. Then two
    clean iterations of clipped SGD: the optimizer's grad norm and the params vs the whole
    model's clip_grad_norm_ and SGD step on the global batch. With `hook`, Reduce() (the
    engine's reduction as a comm hook) on every buffer."""
    model, opt = _build(strategy, ep)
    if hook:  # every bucket through the comm-hook path, each over its own group
        model.register_comm_hook(Reduce())
    opt.zero_grad()
    raised, fired = None, []
    try:
        _micro_batches(model, 0, _bad_param(ep), fired)
        model.finish_grad_sync()
    except RuntimeError as exc:
        raised = str(exc)
    ref = MoEModel(CFG, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    norms = []
    for step in (1, 2):
        opt.zero_grad()
        _micro_batches(model, step, None, [])
        ok, norm, _ = opt.step()
        ref_opt.zero_grad()
        x, y = moe_batch(CFG, BATCH, seed=100 + step)
        ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        norms.append({"ok": ok, "got": norm, "want": want})
    errors = _param_errors(model, ref)
    return {"raised": raised, "fired": bool(fired), "norms": norms, "errors": errors,
            "optimizer": type(opt).__name__}  # fmt: skip


SCALE = 1024.0


def scaler_case(strategy: str, ep: int) -> dict[str, Any]:
    """Dynamic loss scaling: iteration 0 puts an inf in one param's grad on rank 1, micro-batch
    1 only (at ep 2 one expert's: ranks 0 and 2 never see it, their expert dp is {0,2}); the
    step must be skipped on every rank and the scale halved. Two clean steps then grow it back
    (growth_interval 2) and match the whole model stepped on them only (unscaled, clipped)."""
    model, opt = _build(strategy, ep, scaler=True)
    ref = MoEModel(CFG, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    steps, fired = [], []
    for step in range(3):
        opt.zero_grad()
        _micro_batches(model, step, _bad_param(ep) if step == 0 else None, fired, opt, math.inf)
        ok, norm, _ = opt.step()
        want = None
        if step > 0:
            ref_opt.zero_grad()
            x, y = moe_batch(CFG, BATCH, seed=100 + step)
            ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
            want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            ref_opt.step()
        steps.append({"ok": ok, "got": norm, "want": want, "scale": float(opt.get_loss_scale())})
    return {"steps": steps, "fired": bool(fired), "errors": _param_errors(model, ref)}


def _param_errors(model: megabuf.DistributedDataParallel, ref: MoEModel) -> dict[str, float]:
    pgs = model.process_groups
    ep_rank, n_local = dist.get_rank(pgs.ep), CFG.num_experts // dist.get_world_size(pgs.ep)
    with model.summon_full_params():
        return {
            reference_name(name, ep_rank, n_local): (
                p.detach() - ref.get_parameter(reference_name(name, ep_rank, n_local))
            ).abs().max().item()
            for name, p in model.module.named_parameters()
        }  # fmt: skip


# ---- LocalSGD's PeriodicAverager at ep 2 -------------------------------------------------------
def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def averager_case() -> dict[str, Any]:
    """LocalSGD(start_step=1, period=2, subgroup_size=1): after step 1 no rank reduces grads, so
    every replica drifts (each on its own rows). PeriodicAverager must then average dense main
    params over dp (all 4 ranks) and each expert's over its expert-dp group only ({0,2} hold
    experts 0-1, {1,3} experts 2-3). Checked against every rank's stepped mains gathered here:
    the rank-order fp32 mean over the right group (bitwise)."""
    pgs = groups(ep_size=2)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    cfg = megabuf.DistributedDataParallelConfig(bucket_size=256)
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    hook = LocalSGD(1, 2, subgroup_size=1)
    model.register_comm_hook(hook)
    opt = megabuf.MixedPrecisionOptimizer(model, torch.optim.SGD, lr=LR)
    averager = PeriodicAverager(opt)
    expert = {id(mp.main): is_expert_parallel(mp.model_param) for mp in opt.main_params}
    n = BATCH // pgs.dp_size
    log = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(4):
            opt.zero_grad()
            x, y = moe_batch(CFG, BATCH, seed=100 + step)
            rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
            ((model(x[rows]) - y[rows]) ** 2).mean().backward()
            opt.step()
            stepped = [_gather(mp.main.detach().clone()) for mp in opt.main_params]
            averaged = averager.step()
            entry: dict[str, Any] = {"step": step, "averaged": averaged}
            if averaged:
                entry["errors"] = _averaged_errors(opt, stepped, expert, pgs)
                entry["experts_differ_across_ep"] = any(
                    not torch.equal(ts[0], ts[1]) for mp, ts in zip(opt.main_params, stepped)
                    if expert[id(mp.main)]
                )  # fmt: skip
            log.append(entry)
    return {"log": log, "n_expert_mains": sum(expert.values())}


def _averaged_errors(
    opt: Any, stepped: list[list[torch.Tensor]], expert: dict[int, bool], pgs: Any
) -> dict[str, int]:
    """Per kind: how many main params differ from the rank-order mean over their group."""
    mine = dist.get_rank()
    expt_dp_ranks = [r for r in range(dist.get_world_size()) if r % 2 == mine % 2]
    bad = {"dense": 0, "expert": 0}
    for mp, ts in zip(opt.main_params, stepped, strict=True):
        kind = "expert" if expert[id(mp.main)] else "dense"
        members = expt_dp_ranks if kind == "expert" else list(range(dist.get_world_size()))
        total = ts[members[0]]
        for r in members[1:]:
            total = total + ts[r]
        bad[kind] += not torch.equal(mp.main, total / len(members))
    return bad


def groups_finished_in_backward_case() -> dict[str, Any]:
    """optim_grads with overlap: backward finishes the groups whose reduction already landed
    (`DispatchChain._bound_reducing`, a race), so every group can be SYNCED before
    finish_grad_sync() runs. Forced here on every rank (each group finished by hand, as that
    race does), with a NaN in one expert on rank 1: finish_grad_sync() must still agree on the
    NaN check and raise everywhere. It returned early while every group was SYNCED, so the
    ranks the race hit skipped the agreement the others waited in (a hang in the sweep above)."""
    model, _ = _build("optim_grads", 2)
    model.zero_grad_buffer()
    pgs, fired = model.process_groups, []
    x, y = moe_batch(CFG, BATCH, seed=7)
    n = BATCH // pgs.dp_size
    rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
    if dist.get_rank() == BAD_RANK:
        param = model.module.get_parameter(_bad_param(2))
        param.register_hook(lambda g: fired.append(1) or torch.full_like(g, math.nan))
    with model.deferred_grad_sync():  # finish by hand below
        ((model(x[rows]) - y[rows]) ** 2).mean().backward()
    model.start_grad_sync()
    for group in model.engine.all_bucket_groups:
        group.finish_grad_sync()
    all_synced = model.engine.sync.unsynced_group() is None
    try:
        model.finish_grad_sync()
    except RuntimeError as exc:
        return {"raised": str(exc), "all_synced": all_synced, "fired": bool(fired)}
    return {"raised": None, "all_synced": all_synced, "fired": bool(fired)}


# ---- pp 2 x ep 2 on 4 ranks: dp 2 per stage, expert dp 1 -------------------------------------
class MoEStage(nn.Module):
    """One of two pipeline stages of MoEModel: stage 0 the in-projection and the MoE layer
    (experts spread over ep), stage 1 the head (input via set_input_tensor)."""

    def __init__(self, whole: MoEModel, first: bool) -> None:
        super().__init__()
        self.first = first
        self.embed = whole.embed if first else None
        self.moe = whole.moe if first else None
        self.head = None if first else whole.head
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: torch.Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None and self.moe is not None:
            h = torch.tanh(self.embed(x))
            return h + self.moe(h)
        if self.head is None or self.input_tensor is None:
            raise ValueError("MoEStage: the second stage needs set_input_tensor()")
        return self.head(self.input_tensor)


def _pp_forward_step(how: Any, data_iterator: Any, model: Any) -> Any:
    """`how`: (optimizer whose loss scale applies or None, poison this rank's micro-batch 1,
    list noting that the inf was made)."""
    opt, poison, fired = how
    x, y = next(data_iterator)
    out = model(x)
    fired.append(0)  # one entry per forward: micro-batch len(fired) - 1
    if poison and len(fired) == 2:  # micro-batch 1: an inf in the head's grad, once
        weight = model.module.head.weight
        handles = []

        def make_inf(g: torch.Tensor) -> torch.Tensor:
            handles.pop().remove()
            fired.append(1)
            return torch.full_like(g, math.inf)

        handles.append(weight.register_hook(make_inf))

    def loss_func(out: torch.Tensor) -> Any:
        loss = ((out - y) ** 2).mean(dim=1).mean()
        return (loss if opt is None else opt.scale_loss(loss)), {"loss": loss.detach()}

    return out, loss_func


def pp_ep_case(
    strategy: str,
    ep: int,
    scaler: bool = False,
    hook: bool = False,
    nan_check: bool = False,
    auto: bool = False,
    after_step: Any = None,
) -> dict[str, Any]:
    """1F1B over 2 stages x ep `ep` (experts on stage 0), 3 micro-batches, overlap: two clipped
    SGD steps vs the whole MoEModel on the global batch (norm over both stages, the expert
    part over ep; params of both stages). With `scaler`, a DynamicGradScaler and first an
    iteration with an inf on stage 1 only (rank 2, micro-batch 1), which every rank of both
    stages must skip. With `hook`, Reduce() as the comm hook of every buffer. With `nan_check`
    (check_for_nan_in_grad), first an iteration with an inf on stage 1 only (rank 2,
    micro-batch 1), which must raise on every rank of both stages (the error is recorded);
    then the clean steps. With `auto`, bucket_size="auto" re-planned after 2 steps, 4 steps
    (tests/test_autobucket.py). `after_step(model, opt, step)` runs after each step()
    (tests/test_matrix2.py)."""
    pgs = groups(pp_size=2, ep_size=ep)
    whole = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    stage = MoEStage(whole, first=pgs.pp_rank == 0)
    sizes: dict[str, Any] = {"bucket_size": 64}
    if auto:
        sizes = {"bucket_size": "auto", "auto_bucket_warmup_steps": 2}
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, check_for_nan_in_grad=nan_check, **sizes, **STRATEGIES[strategy]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (model,) = wrap_model_chunks([stage], cfg, pgs)
    if stage.moe is not None:
        stage.moe.collectives = model.engine.collectives
    if hook:
        model.register_comm_hook(Reduce())
    opt = _pp_optimizer(model, strategy, scaler)
    ref = MoEModel(CFG, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    n = BATCH // pgs.dp_size
    k = n // MICRO
    norms, fired, raised = [], [], None
    default_groups = len(model.engine.all_bucket_groups)
    for step in (0, 1, 2) if scaler or nan_check else (1, 2, 3, 4) if auto else (1, 2):
        opt.zero_grad()
        x, y = moe_batch(CFG, BATCH, seed=100 + step)
        mine = [(x[pgs.dp_rank * n + i * k :][:k], y[pgs.dp_rank * n + i * k :][:k])
                for i in range(MICRO)]  # fmt: skip
        poison = step == 0 and dist.get_rank() == 2  # stage 1, the head
        fired = [f for f in fired if f == 1]
        try:
            get_forward_backward_func(2, 1)(
                forward_step_func=partial(
                    _pp_forward_step, (opt if scaler else None, poison, fired)
                ),
                data_iterator=iter(mine), model=model, num_microbatches=MICRO,
                tensor_shape=(k, CFG.d_model), hooks=default_schedule_hooks([model]),
            )  # fmt: skip
        except RuntimeError as exc:
            if not (nan_check and step == 0):
                raise
            raised = str(exc)
            continue
        ok, norm, _ = opt.step()
        if after_step is not None:
            after_step(model, opt, step)
        want = None
        if step > 0:
            ref_opt.zero_grad()
            ((ref(x) - y) ** 2).mean(dim=1).mean().backward()
            want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
            ref_opt.step()
        scale = float(opt.get_loss_scale()) if scaler else None
        norms.append({"ok": ok, "got": norm, "want": want, "scale": scale})
    errors = _param_errors(model, ref)
    auto_done = model.engine.auto is not None and model.engine.auto.replanned
    return {"norms": norms, "errors": errors, "pp_rank": pgs.pp_rank, "fired": 1 in fired,
            "raised": raised, "replanned": auto_done, "ends": model.engine.plan.bucket_ends,
            "groups": (default_groups, len(model.engine.all_bucket_groups)),
            "expt_dp_size": dist.get_world_size(pgs.expt_dp), "dp_size": pgs.dp_size}  # fmt: skip


def _pp_optimizer(model: megabuf.DistributedDataParallel, strategy: str, scaler: bool) -> Any:
    if not scaler:
        sgd = megabuf.OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, clip_grad=CLIP)
        return megabuf.build_optimizer([model], sgd)
    cls = megabuf.MixedPrecisionOptimizer if strategy == "no_shard" else None
    grad_scaler = DynamicGradScaler(SCALE, hysteresis=1, growth_interval=2)
    return (cls or megabuf.DistributedOptimizer)(
        [model], torch.optim.SGD, lr=LR, clip_grad=CLIP, grad_scaler=grad_scaler
    )


NAN_CASES = [(s, ep, False) for ep in (1, 2) for s in STRATEGIES]
NAN_CASES += [(s, ep, True) for ep in (1, 2) for s in STRATEGIES]


def nan_case_name(strategy: str, ep: int, hook: bool) -> str:
    return f"{strategy}_ep{ep}{'_reduce_hook' if hook else ''}"


def run_ep() -> dict[str, Any]:
    return run_each(all_cases())


def all_cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {
        nan_case_name(*c): (nan_then_clip_case, *c) for c in NAN_CASES
    }
    cases |= {f"scaler_{s}_ep{ep}": (scaler_case, s, ep) for s in STRATEGIES for ep in (1, 2)}
    cases["averager_ep2"] = (averager_case,)
    cases["groups_finished_in_backward"] = (groups_finished_in_backward_case,)
    cases |= {f"{s}_pp2_ep{ep}": (pp_ep_case, s, ep) for s in STRATEGIES for ep in (1, 2)}
    cases |= {
        f"{s}_pp2_ep{ep}_reduce_hook": (pp_ep_case, s, ep, False, True)
        for s in STRATEGIES
        for ep in (1, 2)
    }
    cases |= {
        f"scaler_{s}_pp2_ep{ep}": (pp_ep_case, s, ep, True) for s in STRATEGIES for ep in (1, 2)
    }
    cases |= {
        f"nan_{s}_pp2_ep{ep}": (pp_ep_case, s, ep, False, False, True)
        for s in STRATEGIES
        for ep in (1, 2)
    }
    return cases
