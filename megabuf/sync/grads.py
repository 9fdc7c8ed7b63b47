"""`ExposedGrads`: what a model's params show as `.grad` after a grad sync, and what a later
backward makes of the user's changes to it.

[Note: grad contract]
After `finish_grad_sync()` (without the distributed optimizer), every trainable param on every
dp rank has `.grad` equal to the reduced (dp-averaged) gradient: the `main_grad` view itself when
dtypes match, a copy of it in the param's dtype otherwise. Never None, identical on every rank,
whether or not the param was used on that rank (unused ones are zero-filled before their bucket
is reduced, [Note: grad readiness] in dispatch.py). It stays so until `zero_grad_buffer()`;
a forward (evaluation, metrics) in between changes nothing. A backward in between accumulates
on top, as plain PyTorch would: the copies are dropped by a one-shot hook just before that
backward's first grad reaches them. With `error_on_unused_params` a param that got no gradient
on some rank instead makes `finish_grad_sync()` raise on every rank, naming it and the ranks.
With the distributed optimizer only this rank's shard of each bucket is reduced, so `.grad`
stays None (a torch optimizer or `clip_grad_norm_` cannot see partial grads; a torch optimizer
stepping such params raises, `refuse_foreign_optimizers`); megabuf's optimizer reads the shard from
the buffer.
When the grad sync finishes: with `sync_grads_at_backward_end` (default) at the end of every
backward run with grad sync on, as torch DDP; otherwise at `finish_grad_sync()`. What a later
backward does with grads the user cleared or changed: [Note: grads the user changed].

[Note: grads the user changed]
torch semantics are per param: a backward accumulates into whatever `.grad` holds, and a
`.grad` set to None starts fresh. megabuf's grads live in `main_grad`, so at the first grad of
a backward that follows a sync (no `zero_grad_buffer()` in between) every exposed param is
compared with what was exposed: `.grad` None (`optimizer.zero_grad(set_to_none=True)`) makes
the param fresh (its next grad overwrites `main_grad`; without one it is zero-filled); a
`.grad` replaced by another tensor, or an exposed copy modified in place (zeroed, clipped), is
written back into `main_grad`; an untouched one is accumulated on top, as torch would.

[Note: small grads accumulate in place]
The lazy first grad ([Note: grad accumulation into main_grad] in hooks.py) costs a fixed few
microseconds a param on the host: autograd hands the hook a new tensor, which is copied into
`main_grad`, and `.grad` is swapped. For a large param that beats a memset (a pass over its
bytes); for a small one the fixed cost is all there is, and a model of thousands of small
tensors (norms, biases, LoRA adapters) pays it thousands of times a step. So linked params of
at most SMALL_GRAD_NUMEL elements are zeroed at `zero_grad_buffer()` (one `_foreach_zero_`
over runs of them that are contiguous in their buffer, padding included; no large param lies
in a run) and, at the first grad of the next backward, those whose `.grad` is still None are
linked to their `main_grad`, so autograd accumulates into it in place and their hooks copy
nothing (the param whose hook that is was copied, as before). Until that first grad `.grad`
stays None as before, so an optimizer stepped without a backward skips them as torch would. A
`.grad` the user set in between is kept (backward adds to it, as torch would). A grad sync
with no grad in between zero-fills every unwritten `main_grad` ([Note: grad readiness]), so
linking after it is still exact; once any grad arrived, the user's changes take the path of
[Note: grads the user changed]. Measured on `many_small` (2000 params of 16 and 256
elements, CPU, in isolation): about 3.5 us less per param in backward (BENCHMARKS.md, "The
grad hooks' hot path").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from megabuf.buckets.bucket_group import BucketGroup
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups

# [Note: small grads accumulate in place]; on CPU the in-place path broke even at ~8192 elements
SMALL_GRAD_NUMEL = 4096


class ExposedGrads:
    """`linked` params (grad dtype == param dtype) expose their `main_grad` view as `.grad`;
    `copied` ones (a bf16 param over fp32 grads) a copy in their dtype, dropped before the
    next backward accumulates (a one-shot hook), so that backward adds into `main_grad`.
    Small linked params accumulate in place: [Note: small grads accumulate in place]."""

    def __init__(
        self,
        linked: Sequence[nn.Parameter],
        copied: Sequence[nn.Parameter],
        param_to_group: dict[nn.Parameter, BucketGroup],
    ) -> None:
        self.linked = list(linked)
        self.copied = list(copied)
        self.param_to_group = param_to_group
        self.exposed = False  # expose() ran and no backward or clear() since
        self._copies: list[tuple[nn.Parameter, Any, int]] = []  # (param, copy, its _version)
        self._drop_handle: RemovableHandle | None = None
        mains = [(p, p.main_grad) for p in linked]  # type: ignore[attr-defined]
        self.small = [(p, g) for p, g in mains if g.numel() <= SMALL_GRAD_NUMEL]
        views = [g for _, g in mains]  # all of them: a large one breaks a run
        self._small_runs = contiguous_runs(views, SMALL_GRAD_NUMEL) if self.small else []
        self.armed = False  # zero_grad_buffer() zeroed the small grads; not linked yet

    def expose(self) -> None:
        """After a sync: link unlinked same-dtype grads (params unused this iteration) and give
        the others a fresh copy."""
        self._drop_copies()
        for param in self.linked:
            if param.grad is None:
                param.grad = param.main_grad  # type: ignore[attr-defined]
        for param in self.copied:
            copy = param.main_grad.to(param.dtype)  # type: ignore[attr-defined]
            param.grad = copy
            self._copies.append((param, copy, copy._version))
        if self.copied:
            self._drop_handle = register_multi_grad_hook(
                self.copied, self._on_copied_grad, mode="any"
            )
        self.exposed = True

    def cleared(self) -> bool:
        """Every exposed `.grad` is None (a torch optimizer's `zero_grad()`)."""
        return all(p.grad is None for p in self.linked) and all(p.grad is None for p in self.copied)

    def begin_backward(self) -> None:
        """First grad of a backward after expose(): apply the user's changes, see [Note: grads
        the user changed]."""
        self.exposed = False
        for param in self.linked:
            main_grad = param.main_grad  # type: ignore[attr-defined]
            if param.grad is None:
                self._mark_fresh(param)
            elif param.grad is not main_grad:
                main_grad.copy_(param.grad)
                param.grad = main_grad
        for param, copy, version in self._copies:
            if param.grad is None:
                self._mark_fresh(param)
            elif param.grad is not copy or copy._version != version:
                param.main_grad.copy_(param.grad)  # type: ignore[attr-defined]
        self._drop_copies()

    def clear(self) -> None:
        """zero_grad_buffer(): every grad unlinked, copies dropped, small grads zeroed."""
        self.exposed = False
        for param in self.linked:
            param.grad = None
        self._drop_copies()
        if self._small_runs:
            torch._foreach_zero_(self._small_runs)
            self.armed = True

    def link_small(self) -> None:
        """First grad of a backward after clear(): small params accumulate in place."""
        self.armed = False
        for param, main_grad in self.small:
            if param.grad is None:
                param.grad = main_grad

    def _on_copied_grad(self, *unused: Any) -> None:
        del unused
        if self.exposed:
            self.begin_backward()

    def _mark_fresh(self, param: nn.Parameter) -> None:
        group = self.param_to_group[param]
        group.mark_unwritten(group.index_of(param))

    def _drop_copies(self) -> None:
        if self._drop_handle is not None:
            self._drop_handle.remove()
            self._drop_handle = None
        for param, _, _ in self._copies:
            param.grad = None
        self._copies = []


def contiguous_runs(views: Sequence[torch.Tensor], max_numel: int) -> list[torch.Tensor]:
    """1-D views covering the `views` of at most `max_numel` elements: runs of them adjacent in
    their 1-D base tensor (what lies between two of them is padding), broken by a larger view."""
    by_base: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for view in views:
        base = view._base if view._base is not None else view
        by_base.setdefault(id(base), (base, []))[1].append(view)
    runs: list[torch.Tensor] = []
    for base, same_base in by_base.values():
        run: list[torch.Tensor] = []
        for view in sorted(same_base, key=lambda v: v.storage_offset()):
            if view.numel() <= max_numel:
                run.append(view)
                continue
            runs.extend(_span(base, run))
            run = []
        runs.extend(_span(base, run))
    return runs


def _span(base: torch.Tensor, run: list[torch.Tensor]) -> list[torch.Tensor]:
    """One slice of `base` from the first view of `run` to the end of its last."""
    if not run:
        return []
    if base.dim() != 1:  # not a flat buffer: each view on its own
        return [v.view(-1) for v in run]
    start = run[0].storage_offset() - base.storage_offset()
    return [base[start : run[-1].storage_offset() - base.storage_offset() + run[-1].numel()]]


def find_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: nested lists, tuples, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from find_tensors(item)
    elif isinstance(obj, Mapping):
        for item in obj.values():
            yield from find_tensors(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from find_tensors(getattr(obj, f.name))


# [Note: foreign optimizers over sharded params]
# With the distributed optimizer a param's grad is reduced only in this rank's shard and its
# `.grad` stays None, so a torch optimizer over `model.parameters()` would silently never step
# them (or, given grads, step on unreduced ones). Such params are tagged with their name and a
# process-wide optimizer step pre-hook (torch keeps those globally; installed once) raises at
# the first step of any optimizer holding one. megabuf's optimizers step fp32 shards, never
# the tagged params themselves.
SHARDED_TAG = "_megabuf_sharded_param_name"
_step_guard: list[Any] = []  # the installed hook's handle, once


def refuse_foreign_optimizers(param_to_name: Mapping[nn.Parameter, str]) -> None:
    for param, name in param_to_name.items():
        setattr(param, SHARDED_TAG, name)
    if not _step_guard:
        _step_guard.append(register_optimizer_step_pre_hook(_check_optimizer_params))


def _check_optimizer_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    del args, kwargs
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, SHARDED_TAG, None)
            if name is not None:
                raise RuntimeError(
                    f"megabuf: {type(optimizer).__name__} steps {name}, a param of a model "
                    "wrapped with DistributedDataParallelConfig(use_distributed_optimizer=True)"
                    ": its grad is reduced only in this rank's shard and is not exposed as "
                    ".grad. Use megabuf.build_optimizer(OptimizerConfig(...), model) (it shards"
                    " the optimizer state), or wrap with use_distributed_optimizer=False"
                )


def raise_on_unused_params(
    groups: Sequence[BucketGroup],
    param_to_name: Mapping[nn.Parameter, str],
    pgs: ProcessGroups,
    collectives: Collectives,
    device: torch.device | None,
    rank: int,
) -> None:
    """error_on_unused_params: every dp rank learns which params got no grad on which rank
    (one small MAX all-reduce after all reductions finished, so collectives stay paired) and
    raises naming them."""
    index = {p: i for i, p in enumerate(param_to_name)}  # registration order
    flags = torch.zeros(pgs.dp_size, len(index), device=device)
    for group in groups:
        for i in group.unused_indices:
            flags[pgs.dp_rank, index[group.params_list[i]]] = 1.0
    if pgs.dp_size > 1:
        collectives.all_reduce_max(flags, pgs.dp)
    params = list(index)
    lines = []
    for col in flags.sum(0).nonzero().flatten().tolist():
        lacking = flags[:, col].nonzero().flatten().tolist()
        ranks = [collectives.global_rank(pgs.dp, r) for r in lacking]
        lines.append(f"{param_to_name[params[col]]} (ranks {ranks})")
    if lines:
        more = f" and {len(lines) - 10} more" if len(lines) > 10 else ""
        raise RuntimeError(
            f"megabuf: error_on_unused_params: {len(lines)} trainable param(s) got no "
            f"gradient this iteration on some dp rank (seen on rank {rank}): "
            f"{', '.join(lines[:10])}{more}. Use them in forward on every rank, freeze them "
            "before wrapping, or set error_on_unused_params=False (they are then zero-filled "
            "and reduced like any other grad)"
        )
