"""Rank-side code for the asymmetric multi-rank tests (runs inside DistPool workers).

A symmetric test (every rank runs the same model on same-shaped data) cannot see a bug that only
shows when ranks disagree: on the order in which autograd makes bucket groups ready, on how many
tokens they hold, on which experts they own, on which micro-batch uses a param. Each case here
makes the ranks differ on purpose and compares with a single-process reference that replays every
rank's work in one process: per rank r the local grads g_r, then sum_r g_r / dp_size in rank
order. That is the engine's own arithmetic (pre-scale by 1/dp, then sum), so at dp=2 the
reference is bitwise (two terms sum in either order); at dp=4 gloo's summation order differs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from contract_cases import replay_average
from dist_pool import run_each
from grad_cases import grad_errors
from moe_cases import CFG, GLOBAL_BATCH, _loss, groups, reference_name
from torch import nn

import megabuf
from megabuf.testing.moe import MoEModel, moe_batch
from megabuf.training.finalize import finalize_model_grads

DIM = 8
ROWS = 4  # rows per rank per micro-batch


def _data(step: int, rank: int, rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's batch of iteration `step` (different data on every rank and step)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)


def _replay(
    ref: nn.Module, backward_of_rank: Callable[[nn.Module, int], None]
) -> dict[str, torch.Tensor]:
    """Reference grads: every rank's backward replayed on `ref` in this process, averaged."""
    return replay_average(ref, backward_of_rank, dist.get_world_size())


# ---- 1. dispatch order --------------------------------------------------------------------------
class Permuted(nn.Module):
    """Three same-shaped layers applied in an order the caller picks: ranks that pick different
    orders see backward reach (and make ready) the layers' bucket groups in different orders."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM, bias=False)
        self.b = nn.Linear(DIM, DIM, bias=False)
        self.c = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor, order: str) -> torch.Tensor:
        for name in order:
            x = torch.tanh(getattr(self, name)(x))
        return x


ORDERS = ("abc", "cba", "bca", "acb")  # rank r uses ORDERS[r]: backward order reversed on rank 1


def _permuted_backward(net: nn.Module, step: int, rank: int) -> None:
    x, y = _data(step, rank)
    ((net(x, ORDERS[rank]) - y) ** 2).mean().backward()


def dispatch_order_case() -> dict[str, Any]:
    """overlap_grad_reduce, one param per bucket group: after the learning iteration rank 0's
    groups become ready in chain order, rank 1's in the reverse order. Returns per iteration the
    largest grad error and how many groups were already dispatched when backward returned."""
    torch.manual_seed(0)
    net = Permuted()
    ref = copy.deepcopy(net)
    cfg = megabuf.DistributedDataParallelConfig(  # look between backward and the sync
        overlap_grad_reduce=True, bucket_size=1, sync_grads_at_backward_end=False
    )
    model = megabuf.DistributedDataParallel(net, cfg)
    rank = dist.get_rank()
    errors, early = [], []
    for step in range(3):
        model.zero_grad_buffer()
        _permuted_backward(model.module, step, rank)
        early.append(sum(g.grad_state.name == "DISPATCHED" for g in model.engine.all_bucket_groups))
        model.finish_grad_sync()
        want = _replay(ref, lambda m, r, s=step: _permuted_backward(m, s, r))
        errors.append(grad_errors(model, model.engine.param_to_name, want))
    return {"errors": errors, "early": early, "groups": len(model.engine.all_bucket_groups)}


# ---- 2. per-token loss, different token counts per rank -----------------------------------------
TOKENS = (3, 5, 2, 6)  # valid tokens of rank r (of 2 * ROWS rows): 8 in all at dp=2, 16 at dp=4


def _token_backward(net: nn.Module, step: int, rank: int) -> torch.Tensor:
    """Summed (not averaged) per-token loss over this rank's valid tokens; padding is masked."""
    x, y = _data(step, rank, rows=2 * ROWS)
    mask = (torch.arange(2 * ROWS) < TOKENS[rank]).float()
    per_token = ((net(x) - y) ** 2).mean(dim=1)
    (per_token * mask).sum().backward()
    return torch.tensor(TOKENS[rank])


def per_token_case(config: dict[str, Any]) -> dict[str, Any]:
    """finalize_model_grads(num_tokens=this rank's count) vs the reference: the sum of every
    token's loss over all ranks divided by the global token count."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
    ref = copy.deepcopy(net)
    cfg = megabuf.DistributedDataParallelConfig.from_dict(config)
    model = megabuf.DistributedDataParallel(net, cfg)
    total = sum(TOKENS[: dist.get_world_size()])
    errors = []
    for step in range(2):
        model.zero_grad_buffer()
        num_tokens = _token_backward(model.module, step, dist.get_rank())
        finalize_model_grads([model], num_tokens=num_tokens)
        summed = _replay(ref, lambda m, r, s=step: _token_backward(m, s, r))  # sum_r g_r / dp
        want = {n: g * (dist.get_world_size() / total) for n, g in summed.items()}
        errors.append(grad_errors(model, model.engine.param_to_name, want))
    return {"errors": errors, "total": total}


# ---- 3. expert grad norm through the real optimizers, with clipping ----------------------------
CLIP = 0.05  # well below the MoE model's grad norm (~1), so every step clips
LR = 0.5


def _make_optimizer(kind: str, model: megabuf.DistributedDataParallel) -> Any:
    if kind == "mixed_precision":
        return megabuf.MixedPrecisionOptimizer(model, torch.optim.SGD, lr=LR, clip_grad=CLIP)
    cfg = megabuf.OptimizerConfig(optimizer="sgd", lr=LR, sgd_momentum=0.0, clip_grad=CLIP)
    return megabuf.build_optimizer(model, cfg)


def moe_clip_case(kind: str) -> dict[str, Any]:
    """ep 2 on 4 ranks: each ep rank owns different experts, whose grads differ. Two clipped SGD
    steps through the optimizer vs the whole model stepped with torch's clip_grad_norm_."""
    pgs = groups(ep_size=2)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3)
    distributed = kind == "distributed"
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=64, use_distributed_optimizer=distributed
    )
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    opt = _make_optimizer(kind, model)
    ref = MoEModel(CFG, seed=3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    n, norms = GLOBAL_BATCH // pgs.dp_size, []
    for step in range(2):
        opt.zero_grad()
        x, y = moe_batch(CFG, GLOBAL_BATCH, seed=100 + step)
        rows = slice(pgs.dp_rank * n, (pgs.dp_rank + 1) * n)
        _loss(model(x[rows]), y[rows], per_token=False).backward()
        finalize_model_grads([model])
        ok, norm, _ = opt.step()
        ref_opt.zero_grad()
        _loss(ref(x), y, per_token=False).backward()
        want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        norms.append({"ok": ok, "got": norm, "want": want})
    model.publish_params()
    ep_rank, n_local = dist.get_rank(pgs.ep), CFG.num_experts // dist.get_world_size(pgs.ep)
    param_errors = {
        reference_name(name, ep_rank, n_local): (
            p.detach() - ref.get_parameter(reference_name(name, ep_rank, n_local))
        )
        .abs()
        .max()
        .item()
        for name, p in net.named_parameters()
    }
    return {"optimizer": type(opt).__name__, "norms": norms, "param_errors": param_errors}


# ---- 4. different micro-batch contents per rank ------------------------------------------------
MICRO = 3
# micro-batches in which rank r routes its rows through `extra`: rank 0 only the first, rank 1
# only the last (with no_sync around all but the last micro-batch)
EXTRA_USE = ({0}, {MICRO - 1}, {1}, set(range(MICRO)))


class Branchy(nn.Module):
    """`extra` is used only when the caller says so."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(DIM, DIM)  # registered first: last in the dispatch chain
        self.body = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _micro_backward(net: nn.Module, step: int, rank: int, micro: int) -> None:
    x, y = _data(10 * step + micro, rank)
    use = micro in EXTRA_USE[rank]
    (((net(x, use) - y) ** 2).mean() / MICRO).backward()


def _accumulate_on_rank(net: nn.Module, step: int, rank: int) -> None:
    for micro in range(MICRO):
        _micro_backward(net, step, rank, micro)


def micro_batch_case(strict: bool) -> dict[str, Any]:
    """no_sync over all but the last micro-batch, overlap_grad_reduce, one param per group, and
    `extra` used by each rank in a different micro-batch. Returns the grad error per param per
    iteration, or the error message if finish_grad_sync raised."""
    torch.manual_seed(0)
    net = Branchy()
    ref = copy.deepcopy(net)
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=1, error_on_unused_params=strict
    )
    model = megabuf.DistributedDataParallel(net, cfg)
    rank, errors = dist.get_rank(), []
    for step in range(3):  # iteration 0 learns arrivals; later ones dispatch during backward
        model.zero_grad_buffer()
        with model.no_sync():
            for micro in range(MICRO - 1):
                _micro_backward(model.module, step, rank, micro)
        _micro_backward(model.module, step, rank, MICRO - 1)
        try:
            model.finish_grad_sync()
        except RuntimeError as exc:
            return {"raised": str(exc)}
        want = _replay(ref, lambda m, r, s=step: _accumulate_on_rank(m, s, r))
        errors.append(grad_errors(model, model.engine.param_to_name, want))
    return {"raised": None, "errors": errors, "extra_grad": net.extra.weight.grad.clone()}


PER_TOKEN: dict[str, dict[str, Any]] = {
    "per_token_sync": {},
    "per_token_overlap": {"overlap_grad_reduce": True, "bucket_size": 1},
    "per_token_distopt": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
}
MOE_OPTIMIZERS = ("distributed", "mixed_precision", "fp32_built")


def run_dense() -> dict[str, Any]:
    cases: dict[str, tuple[Any, ...]] = {"dispatch_order": (dispatch_order_case,)}
    cases |= {name: (per_token_case, cfg) for name, cfg in PER_TOKEN.items()}
    cases |= {"micro_batch": (micro_batch_case, False)}
    cases |= {"micro_batch_strict": (micro_batch_case, True)}
    return run_each(cases)


def run_moe() -> dict[str, Any]:
    return run_each({f"moe_clip_{k}": (moe_clip_case, k) for k in MOE_OPTIMIZERS})
