"""A small mixture-of-experts model whose experts are sharded over the expert-parallel group.

`MoELayer` routes each token to its `top_k` experts (softmax router, no capacity limit, so no
token is ever dropped and the sharded layer computes exactly what the unsharded one does).
Experts are split over the `ep` group: ep rank e holds experts [e * n_local, (e + 1) * n_local).
Tokens travel to their experts and back with two differentiable all-to-alls. The expert params
are marked expert-parallel (`param.allreduce = False`), so megabuf keeps them in separate buffers
reduced over `expt_dp`; see [Note: gradient scaling] in megabuf/training/finalize.py for why their
grads still come out averaged over the whole dp group.

Built with `ep_group=None` the same layer holds every expert locally: that is the single-process
reference. Expert weights are drawn in global expert order from one seeded generator, so ep rank
e's local expert i is bitwise the reference's expert e * n_local + i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megabuf.planning.replicas import mark_expert_parallel
from megabuf.transport.collectives import Collectives


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of `MoEModel`: dense in-projection, one MoE layer (residual), dense head."""

    d_in: int = 8
    """Input features."""
    d_model: int = 16
    """Width of the token representation routed to experts."""
    d_ff: int = 32
    """Hidden width of each expert MLP."""
    d_out: int = 4
    """Output features (regression targets)."""
    num_experts: int = 4
    """Experts in the layer, over all ep ranks; must be divisible by ep_size."""
    top_k: int = 2
    """Experts each token is sent to; their outputs are mixed with the router's weights."""


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all over rows: the backward is the reverse all-to-all of grads."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
        collectives: Collectives,
    ) -> Tensor:
        ctx.splits = (output_splits, input_splits)
        ctx.group, ctx.collectives = group, collectives
        return _exchange_rows(x, output_splits, input_splits, group, collectives)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        output_splits, input_splits = ctx.splits  # reversed: grads go back where rows came from
        grad_in = _exchange_rows(grad, input_splits, output_splits, ctx.group, ctx.collectives)
        return grad_in, None, None, None, None


def _exchange_rows(
    x: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: ProcessGroup,
    collectives: Collectives,
) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    collectives.all_to_all(
        out, x.contiguous(), group, output_split_sizes=output_splits,
        input_split_sizes=input_splits, async_op=False,
    )  # fmt: skip
    return out


def all_to_all_rows(
    x: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: ProcessGroup,
    collectives: Collectives,
) -> Tensor:
    """Send `input_splits[r]` rows of `x` to ep rank r; autograd sends grads back the same way."""
    out = _AllToAll.apply(x, output_splits, input_splits, group, collectives)
    return out  # type: ignore[no-any-return]


class Expert(nn.Module):
    """One expert: d_model -> d_ff -> d_model MLP."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def _init_(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() > 1 else p.numel()
            p.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


class MoELayer(nn.Module):
    """Top-k routed experts, sharded over `ep_group` (None: all experts local, the reference)."""

    def __init__(
        self,
        cfg: MoEConfig,
        *,
        ep_group: ProcessGroup | None = None,
        collectives: Collectives | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ep_group = ep_group
        self.collectives = collectives or Collectives()
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if cfg.num_experts % self.ep_size != 0 or not 1 <= cfg.top_k <= cfg.num_experts:
            raise ValueError(
                f"megabuf.testing: MoEConfig.num_experts={cfg.num_experts} must be divisible by "
                f"ep_size={self.ep_size} and top_k={cfg.top_k} in [1, num_experts]"
            )
        self.num_local_experts = cfg.num_experts // self.ep_size
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
            all_experts = [Expert(cfg) for _ in range(cfg.num_experts)]
        _init_(self.router, gen)
        for expert in all_experts:  # global order: every rank draws the same numbers
            _init_(expert, gen)
        first = ep_rank * self.num_local_experts
        self.experts = nn.ModuleList(all_experts[first : first + self.num_local_experts])
        if ep_group is not None:
            mark_expert_parallel(self.experts.parameters())

    def forward(self, x: Tensor) -> Tensor:
        """x [N, d_model] -> [N, d_model]."""
        k = self.cfg.top_k
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(k, dim=-1)  # [N, k] each
        flat_expert = chosen.reshape(-1)  # [N * k], assignment a = token * k + slot
        order = torch.argsort(flat_expert, stable=True)  # assignments grouped by expert
        routed = x.repeat_interleave(k, dim=0)[order]  # [N * k, d_model]
        counts = torch.bincount(flat_expert, minlength=self.cfg.num_experts)
        received, recv_counts, splits = self._dispatch(routed, counts)
        expert_out = self._run_experts(received, recv_counts)
        back = self._combine(expert_out, splits)
        unsorted = back[torch.argsort(order)]  # assignment order again
        mixed = unsorted * weights.reshape(-1, 1).to(unsorted.dtype)
        return mixed.view(x.shape[0], k, -1).sum(dim=1)

    def _dispatch(
        self, routed: Tensor, counts: Tensor
    ) -> tuple[Tensor, Tensor, tuple[list[int], list[int]]]:
        """Send each rank the rows for its experts; recv_counts[src, e] rows came from src for
        local expert e."""
        if self.ep_group is None:
            return routed, counts.view(1, -1), ([routed.shape[0]], [routed.shape[0]])
        send_counts = counts.view(self.ep_size, self.num_local_experts)
        recv_counts = torch.empty_like(send_counts)
        self.collectives.all_to_all(recv_counts, send_counts, self.ep_group, async_op=False)
        input_splits = send_counts.sum(dim=1).tolist()
        output_splits = recv_counts.sum(dim=1).tolist()
        received = all_to_all_rows(
            routed, output_splits, input_splits, self.ep_group, self.collectives
        )
        return received, recv_counts, (output_splits, input_splits)

    def _run_experts(self, received: Tensor, recv_counts: Tensor) -> Tensor:
        """Apply local expert e to its rows (every expert runs, on zero rows if need be, so
        each expert param gets a grad every step)."""
        local_ids = torch.arange(self.num_local_experts, device=recv_counts.device).repeat(
            recv_counts.shape[0]
        )
        row_expert = local_ids.repeat_interleave(recv_counts.reshape(-1))
        rows = [torch.nonzero(row_expert == e).flatten() for e in range(self.num_local_experts)]
        outs = [expert(received[idx]) for expert, idx in zip(self.experts, rows, strict=True)]
        return torch.cat(outs)[torch.argsort(torch.cat(rows))]

    def _combine(self, expert_out: Tensor, splits: tuple[list[int], list[int]]) -> Tensor:
        if self.ep_group is None:
            return expert_out
        output_splits, input_splits = splits
        return all_to_all_rows(
            expert_out, input_splits, output_splits, self.ep_group, self.collectives
        )


class MoEModel(nn.Module):
    """x [B, d_in] -> [B, d_out]: dense in-projection, residual MoE layer, dense head."""

    def __init__(
        self,
        cfg: MoEConfig | None = None,
        *,
        ep_group: ProcessGroup | None = None,
        collectives: Collectives | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.cfg = cfg = cfg or MoEConfig()
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Linear(cfg.d_in, cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.d_out)
        _init_(self.embed, gen)
        _init_(self.head, gen)
        self.moe = MoELayer(cfg, ep_group=ep_group, collectives=collectives, seed=seed)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + self.moe(h))


def global_expert_index(local_index: int, ep_rank: int, num_local_experts: int) -> int:
    """The reference model's index of ep rank `ep_rank`'s local expert `local_index`."""
    return ep_rank * num_local_experts + local_index


def moe_batch(cfg: MoEConfig, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Deterministic (x [B, d_in], y [B, d_out]) regression data."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, cfg.d_in, generator=gen), torch.randn(
        batch_size, cfg.d_out, generator=gen
    )
