"""Autograd and module hooks: grads into `main_grad` (backward), params gathered in time (forward).

[Note: grad accumulation into main_grad]
When param and grad dtypes match, `param.grad` *is* the `main_grad` view from construction on, so
autograd accumulates in place into the buffer and the hook does nothing but mark the param ready
(no copy, no allocation). If `param.grad` is something else (dtypes differ, or a user set it to
None) the hook adds it into `main_grad` and re-links (or drops) it. Hence `optimizer.zero_grad()`
alone does not clear gradients: call `model.zero_grad_buffer()` (or `model.zero_grad()`).

[Note: lazy param gather]
With overlap_param_gather, params are stale after the optimizer step until their bucket group's
all-gather finishes, and a forward pre-hook must finish it before anything reads them. Which
module reads a param is learned, not assumed: the first forward with the hooks installed gathers
everything up front and records the order in which modules run. Afterwards each param is
guarded by the first module that ran among those owning it, or, if none ran (a parent read it
through `F.linear`, an `nn.ParameterList`...), by its nearest ancestor that ran. The forward
order of bucket groups learned the same way drives prefetching, so a forward order different
from registration order costs overlap, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from megabuf.bucket_group import BucketGroup


def make_grad_hook(
    main_grad: torch.Tensor, group: BucketGroup, link: bool
) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of one param; see [Note: grad accumulation into main_grad]."""
    register = group.register_grad_ready

    def hook(param: nn.Parameter) -> None:
        grad = param.grad
        if grad is not main_grad:
            if grad is not None:
                main_grad.add_(grad)
            param.grad = main_grad if link else None
        register(param)

    return hook


def register_grad_hooks(
    params: Sequence[nn.Parameter],
    param_to_group: dict[nn.Parameter, BucketGroup],
) -> list[RemovableHandle]:
    handles = []
    for param in params:
        main_grad = param.main_grad  # type: ignore[attr-defined]
        link = main_grad.dtype == param.dtype
        if link:
            param.grad = main_grad
        hook = make_grad_hook(main_grad, param_to_group[param], link)
        handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


class ParamGatherHooks:
    """Forward pre-hooks that finish param all-gathers just in time; see [Note: lazy param
    gather]."""

    def __init__(self, module: nn.Module, param_to_group: dict[nn.Parameter, BucketGroup]) -> None:
        self.module = module
        self.param_to_group = param_to_group
        self.plan: dict[nn.Module, list[BucketGroup]] | None = None  # None until learned
        self.forward_order: list[BucketGroup] = []
        self._seen: dict[nn.Module, None] = {}  # modules in first-run order (learning pass)
        self._handles: list[RemovableHandle] = []

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def enable(self) -> None:
        if self._handles:
            return
        for mod in self.module.modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
        self._handles.append(self.module.register_forward_hook(self._root_post_hook))

    def disable(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_hook(self, mod: nn.Module, args: Any) -> None:
        if self.plan is None:
            if mod is self.module:
                self._seen = {}
                for group in dict.fromkeys(self.param_to_group.values()):
                    group.finish_param_sync(skip_next_bucket_dispatch=True)
            self._seen.setdefault(mod, None)
            return
        for group in self.plan.get(mod, ()):
            group.finish_param_sync()

    def _root_post_hook(self, mod: nn.Module, args: Any, output: Any) -> None:
        if self.plan is None:
            self.plan, self.forward_order = build_gather_plan(
                self.module, list(self._seen), self.param_to_group
            )
            link_forward_order(self.forward_order)

    def first_group(self) -> BucketGroup | None:
        """The group the next forward reads first (for force_dispatch)."""
        return self.forward_order[0] if self.forward_order else None


def build_gather_plan(
    root: nn.Module,
    ran: list[nn.Module],
    param_to_group: dict[nn.Parameter, BucketGroup],
) -> tuple[dict[nn.Module, list[BucketGroup]], list[BucketGroup]]:
    """Map each module that ran to the groups it must finish; return groups in forward order."""
    position = {mod: i for i, mod in enumerate(ran)}
    parent: dict[nn.Module, nn.Module] = {}
    for mod in root.modules():
        for child in mod.children():
            parent.setdefault(child, mod)
    guard: dict[nn.Parameter, nn.Module] = {}
    for mod in root.modules():
        for param in mod.parameters(recurse=False):
            if param not in param_to_group:
                continue
            reader = mod
            while reader not in position and reader in parent:
                reader = parent[reader]
            best = guard.get(param)
            if best is None or position.get(reader, 0) < position.get(best, 0):
                guard[param] = reader
    plan: dict[nn.Module, list[BucketGroup]] = {}
    for param, mod in guard.items():
        groups = plan.setdefault(mod, [])
        if param_to_group[param] not in groups:
            groups.append(param_to_group[param])
    order: list[BucketGroup] = []
    for mod in sorted(plan, key=lambda m: position.get(m, 0)):
        order.extend(g for g in plan[mod] if g not in order)
    return plan, order


def link_forward_order(order: Sequence[BucketGroup]) -> None:
    """Each group prefetches the gather of the group the forward reads next."""
    for group, nxt in zip(order, list(order[1:]) + [None], strict=True):
        group.next_param_gather_bucket_group = nxt
