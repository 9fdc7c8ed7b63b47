"""`SparseGrads`: the params whose grads are sparse, kept outside the buffers and all-reduced at
the grad sync.

[Note: sparse grads outside the buffer]
An `nn.Embedding` or `nn.EmbeddingBag` built with `sparse=True` hands its weight a sparse COO
grad (the rows the batch touched), which cannot be copied into a dense `main_grad` view. So, as
torch DDP does, the weights of such modules (found at construction, `sparse_grad_params` in
model_plan.py) are planned into no buffer: autograd accumulates their grads in `.grad` as it
would without any wrapper (micro-batches inside `no_sync()` included), and the grad sync that
ends a backward, or `finish_grad_sync()`, divides each by dp_size and sums it over dp with a
sparse all-reduce, after dispatching the dense groups' reductions and before waiting for them,
so `.grad` holds the dp-averaged sparse grad (coalesced) when backward returns, as in torch DDP.
The order is the same as torch's (divide, then sum in rank order), so fp32 results match it
bit for bit. A rank whose batch touched no row (or never ran the module) contributes an empty
sparse tensor, so every rank runs the same collectives; a dense grad reaching such a param (its
weight tied to a dense reader) is reduced in sparse form too. A post-accumulate-grad hook on
each of them does only the engine's once-per-backward bookkeeping, so a backward that reaches
only these params still syncs. `zero_grad_buffer()` sets their `.grad` to None (as
`optimizer.zero_grad()` does).
What they do not take part in: the buffers, their bucket groups and comm hooks (a registered
hook reduces the dense buckets; the sparse grads are still all-reduced beside it, where torch DDP
would hand them to the hook), the NaN and unused-param checks, the memory ledger, and megabuf's
own optimizers, which step the buffers and so refuse such a model by name (use a torch optimizer
that takes sparse grads: SGD, Adagrad, SparseAdam). The distributed optimizer cannot shard a
sparse grad: the sharded strategies refuse the module at construction. A sparse grad reaching a
param planned dense (a custom module calling `F.embedding(..., sparse=True)`) raises in its grad
hook, naming the param.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megabuf.buckets.arrivals import weak_callable
from megabuf.transport.collectives import Collectives, Group, PendingCollective


@dataclass
class SparseReduction:
    """One param's sparse all-reduce in flight, and the grad it writes into."""

    param: nn.Parameter
    grad: torch.Tensor  # sparse COO, the param's shape; dp-averaged once `pending` finished
    pending: PendingCollective


class SparseGrads:
    """The sparse-grad params of one engine (`named`, registration order; empty for most
    models) and their reduction over `group` (dp, `dp_size` ranks)."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        collectives: Collectives,
        group: Group,
        dp_size: int,
    ) -> None:
        self.named = list(named)
        self.collectives = collectives
        self.group = group
        self.dp_size = dp_size
        self._pending: list[SparseReduction] = []

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for _, p in self.named]

    def install_hooks(
        self, on_grad: Callable[[], None], in_backward: list[bool]
    ) -> list[RemovableHandle]:
        """A hook per param doing the engine's once-per-backward bookkeeping only (held weakly:
        [Note: hooks hold the engine weakly] in hooks.py)."""
        on_grad_ref = weak_callable(on_grad)

        def hook(param: nn.Parameter) -> None:
            del param
            if not in_backward[0] and (bookkeeping := on_grad_ref()) is not None:
                bookkeeping()

        return [p.register_post_accumulate_grad_hook(hook) for p in self.params]

    def start_grad_sync(self) -> None:
        """Divide every grad by dp_size and dispatch its sparse all-reduce, registration order
        (collective: every dp rank, the same params)."""
        for _, param in self.named:
            grad = self._local_grad(param)
            if self.dp_size > 1:
                grad.div_(self.dp_size)
            pending = self.collectives.all_reduce_sparse(grad, self.group)
            self._pending.append(SparseReduction(param, grad, pending))

    def finish_grad_sync(self) -> None:
        """Wait for the reductions; each param's `.grad` is its dp-averaged sparse grad."""
        pending, self._pending = self._pending, []
        for reduction in pending:
            reduction.pending.wait()
            reduction.param.grad = reduction.grad

    def clear(self) -> None:
        """A new iteration: `.grad` None, as `optimizer.zero_grad()` leaves it."""
        for param in self.params:
            param.grad = None

    def scale(self, factor: float) -> None:
        for param in self.params:
            if param.grad is not None:
                param.grad.mul_(factor)

    @staticmethod
    def _local_grad(param: nn.Parameter) -> torch.Tensor:
        """This rank's grad as a sparse COO tensor the collective may write into: an empty one
        when no grad arrived (the collective must still pair up), a sparse copy of a dense one."""
        grad = param.grad  # an embedding's: indices (1, nnz), values (nnz, dim)
        if grad is None:
            indices = torch.zeros((1, 0), dtype=torch.long, device=param.device)
            values = param.new_zeros((0, *param.shape[1:]))
            return torch.sparse_coo_tensor(indices, values, param.shape)
        if grad.layout is torch.strided:
            return grad.detach().to_sparse(1)
        return grad.detach()
