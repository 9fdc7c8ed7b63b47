"""Rank-side cases for test_sparse_grads.py: models with nn.Embedding / nn.EmbeddingBag(sparse=True)
trained on megabuf and on stock torch DDP in the same ranks, on the same data (gloo, fp32)
([Note: sparse grads outside the buffer] in megabuf/sync/sparse_grads.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import megabuf

VOCAB, DIM, BATCH, ITERS = 24, 8, 4, 4


class SparseNet(nn.Module):
    """Two sparse-grad modules and two dense layers."""

    def __init__(self, sparse_bag: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=True)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="mean", sparse=sparse_bag)
        self.lin = nn.Linear(DIM, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.lin(self.emb(x).sum(1) + self.bag(x)))
        return self.head(hidden).square().sum() / BATCH  # an empty batch gives 0, not nan


def batch(it: int, micro: int) -> torch.Tensor:
    """Asymmetric ranks: rank 0 reads rows 0..9, rank 1 rows 8..23, and rank 1's batch of
    iteration 1 is empty (touches no row)."""
    rank = dist.get_rank()
    if rank == 1 and it == 1:
        return torch.zeros((0, 3), dtype=torch.long)
    gen = torch.Generator().manual_seed(1000 * it + 10 * micro + rank)
    low, high = (0, 10) if rank == 0 else (8, VOCAB)
    return torch.randint(low, high, (BATCH, 3), generator=gen)


def _optimizers(model: nn.Module, name: str) -> list[torch.optim.Optimizer]:
    params = dict(model.named_parameters())
    sparse = [p for n, p in params.items() if n.split(".")[-2] in ("emb", "bag")]
    dense = [p for n, p in params.items() if n.split(".")[-2] not in ("emb", "bag")]
    if name == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.5)]
    if name == "adagrad":
        return [torch.optim.Adagrad(model.parameters(), lr=0.1)]
    return [torch.optim.SparseAdam(sparse, lr=0.05), torch.optim.Adam(dense, lr=0.05)]


def _train(wrap: Callable[[nn.Module], nn.Module], loop: str, opt_name: str) -> dict[str, Any]:
    """`loop`: "plain" (optimizer.zero_grad(set_to_none=True)), "no_sync" (two micro-batches,
    the first inside no_sync()) or "zero_grad_buffer" (megabuf's clear; torch's zero_grad)."""
    torch.manual_seed(0)
    model = wrap(SparseNet())
    opts = _optimizers(model, opt_name)
    grads, sparse_layouts = [], []
    for it in range(ITERS):
        for opt in opts:
            if loop == "zero_grad_buffer" and hasattr(model, "zero_grad_buffer"):
                model.zero_grad_buffer()
            else:
                opt.zero_grad(set_to_none=True)
        if loop == "no_sync":
            with model.no_sync():  # type: ignore[operator]
                model(batch(it, 0)).backward()
        model(batch(it, 1)).backward()
        emb = model.module.emb.weight  # type: ignore[union-attr]
        sparse_layouts.append(emb.grad.is_sparse)
        grads.append([p.grad.to_dense().clone() for p in model.parameters()])
        for opt in opts:
            opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "grads": grads, "sparse": sparse_layouts}


def sparse_vs_torch(loop: str, opt_name: str, config: dict[str, Any]) -> dict[str, Any]:
    ref = _train(lambda m: nn.parallel.DistributedDataParallel(m), loop, opt_name)
    cfg = megabuf.DistributedDataParallelConfig(**config)
    got = _train(lambda m: megabuf.DistributedDataParallel(m, cfg), loop, opt_name)
    return {
        "params_equal": [torch.equal(a, b) for a, b in zip(got["params"], ref["params"])],
        "grads_equal": [
            all(torch.equal(a, b) for a, b in zip(g, r))
            for g, r in zip(got["grads"], ref["grads"])
        ],
        "sparse": got["sparse"], "ref_sparse": ref["sparse"],
        "max_diff": max(
            (a - b).abs().max().item() for a, b in zip(got["params"], ref["params"])
        ),
    }  # fmt: skip


def with_comm_hook() -> dict[str, Any]:
    """A comm hook reduces the dense buckets; the sparse grads are all-reduced beside it."""
    ref = _train(lambda m: nn.parallel.DistributedDataParallel(m), "plain", "sgd")

    def wrap(module: nn.Module) -> nn.Module:
        model = megabuf.DistributedDataParallel(module)
        model.register_comm_hook(megabuf.comm_hooks.Reduce())
        return model

    got = _train(wrap, "plain", "sgd")
    return {"params_equal": [torch.equal(a, b) for a, b in zip(got["params"], ref["params"])]}


def refused_when_sharded(strategy: str) -> str:
    cfg = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    try:
        megabuf.DistributedDataParallel(SparseNet(), cfg)
    except ValueError as exc:
        return str(exc)
    return "built"


def refused_by_build_optimizer() -> str:
    model = megabuf.DistributedDataParallel(SparseNet())
    try:
        megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="sgd", lr=0.1))
    except ValueError as exc:
        return str(exc)
    return "built"


class _CustomSparse(nn.Module):
    """A sparse grad from a param megabuf plans dense (not an nn.Embedding module)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(VOCAB, DIM))
        self.lin = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.embedding(x, self.table, sparse=True)).sum()


def sparse_grad_on_dense_param() -> str:
    model = megabuf.DistributedDataParallel(_CustomSparse())
    try:
        model(torch.tensor([[1, 2]])).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def only_sparse_params() -> dict[str, Any]:
    """A model whose every trainable param has sparse grads: no buffer at all; still synced."""
    torch.manual_seed(0)
    ref_model = nn.parallel.DistributedDataParallel(nn.EmbeddingBag(VOCAB, DIM, sparse=True))
    torch.manual_seed(0)
    model = megabuf.DistributedDataParallel(nn.EmbeddingBag(VOCAB, DIM, sparse=True))
    x = batch(0, 0)
    ref_model(x).square().sum().backward()
    model(x).square().sum().backward()
    ref, got = ref_model.module.weight.grad, model.module.weight.grad
    return {"equal": torch.equal(ref.to_dense(), got.to_dense()), "sparse": got.is_sparse}


def scaled_and_cleared() -> dict[str, Any]:
    """scale_gradients (finalize_model_grads' token scaling) scales the sparse grads too;
    zero_grad_buffer sets them to None."""
    model = megabuf.DistributedDataParallel(SparseNet())
    model(batch(0, 0)).backward()
    before = model.module.emb.weight.grad.to_dense().clone()
    model.scale_gradients(0.5)
    scaled = torch.equal(model.module.emb.weight.grad.to_dense(), before * 0.5)
    model.zero_grad_buffer()
    return {"scaled": scaled, "cleared": model.module.emb.weight.grad is None}


def checkpoint_round_trip(root: str) -> dict[str, Any]:
    """save_checkpoint / load_checkpoint with a torch Adagrad under no_shard: the sparse weight
    and its optimizer state are saved and loaded like any param."""
    path = os.path.join(root, "sparse")
    torch.manual_seed(0)
    model = megabuf.DistributedDataParallel(SparseNet())
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    for it in range(2):
        opt.zero_grad()
        model(batch(it, 0)).backward()
        opt.step()
    megabuf.save_checkpoint(path, model, opt)
    saved = [p.detach().clone() for p in model.parameters()]
    saved_sum = opt.state[model.module.emb.weight]["sum"].clone()
    torch.manual_seed(1)
    fresh = megabuf.DistributedDataParallel(SparseNet())
    fresh_opt = torch.optim.Adagrad(fresh.parameters(), lr=0.1)
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    return {
        "params_equal": [torch.equal(a, b) for a, b in zip(fresh.parameters(), saved)],
        "state_equal": torch.equal(fresh_opt.state[fresh.module.emb.weight]["sum"], saved_sum),
    }
