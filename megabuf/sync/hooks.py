"""Autograd and module hooks: grads into `main_grad` (backward), params gathered in time (forward).

[Note: grad accumulation into main_grad]
`zero_grad_buffer()` does not memset the buffer: it marks every param "fresh" and unlinks
`param.grad`. The first grad of a fresh param is *copied* into its `main_grad` (one pass, where
zero-then-add would be three), later ones are added; the hook then links `param.grad` to the
`main_grad` view (same dtype) so further backwards accumulate in place through autograd, with no
copy at all. Small params are the exception: zeroed and linked ahead of their first grad ([Note:
small grads accumulate in place] in grads.py); so is a grad scaled on its way in, linked only at
the sync ([Note: scale on the way in] in grad_math.py). A param that got no grad is still fresh
when its bucket group is reduced, and its `main_grad` is zeroed then
(`WrittenGrads.zero_unwritten`) and, without the distributed optimizer, its `.grad` is
linked at `finish_grad_sync()` ([Note: grad contract] in grads.py).
So `main_grad` holds stale values between `zero_grad_buffer()` and the param's first grad: read
grads after `finish_grad_sync()`.
`optimizer.zero_grad()` alone does not clear gradients: call `model.zero_grad_buffer()` (or
`model.zero_grad()`).

[Note: lazy param gather]
With overlap_param_gather, params are stale after the optimizer step until their bucket group's
all-gather, dispatched by the step ([Note: publishing params]), finishes, and a forward pre-hook
must wait for it before anything reads them. Which
module reads a param is learned, not assumed from ownership: the first forward with the hooks
installed gathers everything up front and, under a TorchFunctionMode, records which module was
running when a torch function first received each param. Afterwards each bucket group is
finished by the pre-hook of its first reader, whoever owns the param (a parent reading a child's
weight through `F.linear`, an `nn.ParameterList`, a sibling's weight); groups never read in
forward are finished at the root. The read order of the groups drives prefetching, so a forward
order different from registration order costs overlap, never correctness.

[Note: hooks hold the engine weakly]
A post-accumulate-grad hook lives in its param's C++ autograd state, which the garbage collector
cannot see into: a hook holding the engine strongly kept every engine (its buffers, on a GPU its
memory) alive for the life of the process, even after `del model` and `gc.collect()`. So each
hook holds its bucket group and the engine's callback weakly, does nothing once they are gone (the
param trains as a plain one again), and the engine removes its hooks (grad and forward pre-hooks)
when it is collected, so a module the user kept does not hold the engine's buffers either.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from megabuf.buckets.arrivals import refuse_create_graph, weak_callable
from megabuf.buckets.bucket_group import BucketGroup
from megabuf.sync.grads import SMALL_GRAD_NUMEL


def make_grad_hook(
    main_grad: torch.Tensor,
    group: BucketGroup,
    index: int,
    link: bool,
    on_grad: Callable[[], None],
    in_backward: list[bool],
) -> Callable[[nn.Parameter], None]:
    """The post-accumulate-grad hook of one param; see [Note: grad accumulation into main_grad].
    `on_grad` runs first, unless `in_backward[0]` says it already ran in this backward (the
    model's per-backward bookkeeping: [Note: grad contract], [Note: one bookkeeping per
    backward] in grad_sync.py). The hook holds its group and `on_grad` weakly ([Note: hooks
    hold the engine weakly])."""
    group_ref = weakref.ref(group)
    on_grad_ref = weak_callable(on_grad)
    # [Note: scale on the way in]: a linked grad has main_grad's dtype; decided once, here
    inbound = link and group.inbound.factor is not None and main_grad.numel() > SMALL_GRAD_NUMEL

    def hook(param: nn.Parameter) -> None:
        group = group_ref()
        if group is None:  # the engine is gone: the param is plain again
            return
        if not in_backward[0]:
            on_grad = on_grad_ref()
            if on_grad is None:
                return
            on_grad()
        grad = param.grad
        first = group.mark_written(index)
        if grad is not None and grad is not main_grad:
            if grad.requires_grad:
                refuse_create_graph(group, param)
            factor = group.copy_factor(index, first) if inbound else 1.0
            if factor != 1.0:  # [Note: scale on the way in] in grad_math.py
                if first:  # detached: an out= product refuses a grad that requires grad
                    torch.mul(grad.detach(), factor, out=main_grad)
                else:
                    main_grad.add_(grad.detach(), alpha=factor)
                param.grad = None  # linked at the sync: no unscaled grad added in place
            else:
                try:
                    if first or link:
                        # linked: param.grad is not main_grad only when it was None
                        # (zero_grad_buffer or set_to_none) or replaced: the whole grad
                        main_grad.copy_(grad)
                    else:
                        main_grad.add_(grad)
                except RuntimeError:
                    refuse_sparse_grad(group, param, grad)
                    raise
                param.grad = main_grad if link else None
        group.register_grad_ready_at(index, param)

    return hook


def refuse_sparse_grad(group: BucketGroup, param: nn.Parameter, grad: torch.Tensor) -> None:
    """A sparse grad reached a param planned into a buffer: raise naming it ([Note: sparse grads
    outside the buffer] in sparse_grads.py). Returns for a dense grad (the caller re-raises)."""
    if grad.layout is torch.strided:
        return
    name = group.param_to_name.get(param, "?")
    raise RuntimeError(
        f"megabuf: param {name!r} got a {grad.layout} gradient on rank {group.rank}, but it was "
        "planned into a dense grad buffer: only the weights of nn.Embedding / "
        "nn.EmbeddingBag(sparse=True) modules are kept outside the buffers for sparse grads. "
        "Produce the sparse grad from such a module, or use sparse=False (dense grads)"
    )


def register_grad_hooks(
    params: Sequence[nn.Parameter],
    param_to_group: dict[nn.Parameter, BucketGroup],
    linked: set[nn.Parameter],
    on_grad: Callable[[], None],
    in_backward: list[bool],
) -> list[RemovableHandle]:
    """`linked`: params whose `.grad` becomes their `main_grad` view after the first grad."""
    handles = []
    for param in params:
        main_grad = param.main_grad  # type: ignore[attr-defined]
        param.grad = None  # linked to main_grad by the hook at the param's first grad
        group = param_to_group[param]
        index, link = group.index_of(param), param in linked
        hook = make_grad_hook(main_grad, group, index, link, on_grad, in_backward)
        handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


def remove_hooks_when_collected(
    owner: object, handles: list[RemovableHandle], gather_hooks: ParamGatherHooks
) -> None:
    """Remove the grad hooks `handles` and the forward pre-hooks of `gather_hooks` once `owner`
    (the engine) is garbage collected: see [Note: hooks hold the engine weakly]. `handles` is
    the engine's own list: hooks it swaps in later ([Note: counted arrivals]) go too."""
    weakref.finalize(owner, _remove_all, handles, weakref.ref(gather_hooks))


def _remove_all(
    handles: list[RemovableHandle], gather_hooks: weakref.ref[ParamGatherHooks]
) -> None:
    for handle in handles:
        handle.remove()
    hooks = gather_hooks()  # alive only while a module the user kept holds its pre-hooks
    if hooks is not None:
        hooks.disable()


class _ReadRecorder(TorchFunctionMode):
    """Learning pass only: notes, for each watched param, the module running when a torch
    function first receives it."""

    def __init__(self, watched: dict[nn.Parameter, BucketGroup], stack: list[nn.Module]) -> None:
        super().__init__()
        self.watched = watched
        self.stack = stack
        self.first_reader: dict[nn.Parameter, nn.Module] = {}  # insertion order = read order

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        for arg in _leaves((args, kwargs)):
            if isinstance(arg, nn.Parameter) and arg in self.watched:
                self.first_reader.setdefault(arg, self.stack[-1])
        return func(*args, **kwargs)


def _leaves(obj: Any) -> Iterator[Any]:
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _leaves(item)
    else:
        yield obj


class ParamGatherHooks:
    """Forward pre-hooks that finish param all-gathers just in time; see [Note: lazy param
    gather].

    [Note: compiled modules]
    Under torch.compile, per-module hooks and the learning pass's TorchFunctionMode are traced
    by dynamo, where waiting on a collective is not something it can run: it asserts, or it
    drops the wait and the forward reads stale shards. So once the model or any submodule is
    seen compiled (or the wrapper is being traced), the hooks are removed for good and the
    wrapper's forward, which runs eagerly before the compiled region, waits for every group's
    gather (`at_root`). The gathers still overlap whatever runs between step() and forward;
    results are bitwise those of the uncompiled model."""

    def __init__(self, module: nn.Module, param_to_group: dict[nn.Parameter, BucketGroup]) -> None:
        self.module = module
        self.param_to_group = param_to_group
        self.plan: dict[nn.Module, list[BucketGroup]] | None = None  # None until learned
        self.forward_order: list[BucketGroup] = []
        self._stack: list[nn.Module] = []  # modules running (learning pass)
        self._recorder: _ReadRecorder | None = None
        self._handles: list[RemovableHandle] = []
        self.at_root = False  # see [Note: compiled modules]

    @property
    def enabled(self) -> bool:
        return bool(self._handles)

    def gather_at_root(self) -> None:
        """Compiled model: no per-module hooks from now on; the wrapper waits for all."""
        self.disable()
        self._stack.clear()
        self.at_root = True

    def enable(self) -> None:
        if self._handles or self.at_root:
            return
        if self.plan is not None:  # steady state: hooks only where a gather must finish
            for mod in self.plan:
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook))
            return
        for mod in self.module.modules():
            self._handles.append(mod.register_forward_pre_hook(self._learn_pre_hook))
            self._handles.append(mod.register_forward_hook(self._learn_post_hook, always_call=True))

    def disable(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_hook(self, mod: nn.Module, args: Any) -> None:
        for group in self.plan.get(mod, ()) if self.plan is not None else ():
            group.finish_param_sync()

    def _learn_pre_hook(self, mod: nn.Module, args: Any) -> None:
        if mod is self.module and not self._stack:
            for group in dict.fromkeys(self.param_to_group.values()):  # correct, not overlapped
                group.finish_param_sync(skip_next_bucket_dispatch=True)
            self._recorder = _ReadRecorder(self.param_to_group, self._stack)
            self._recorder.__enter__()
        self._stack.append(mod)

    def _learn_post_hook(self, mod: nn.Module, args: Any, output: Any) -> None:
        self._stack.pop()
        if mod is not self.module or self._stack or self._recorder is None:
            return
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)
        self.plan, self.forward_order = build_gather_plan(
            self.module, recorder.first_reader, self.param_to_group
        )
        link_forward_order(self.forward_order)
        self.disable()
        self.enable()

    def first_group(self) -> BucketGroup | None:
        """The group the next forward reads first (for force_dispatch)."""
        return self.forward_order[0] if self.forward_order else None


def build_gather_plan(
    root: nn.Module,
    first_reader: dict[nn.Parameter, nn.Module],
    param_to_group: dict[nn.Parameter, BucketGroup],
) -> tuple[dict[nn.Module, list[BucketGroup]], list[BucketGroup]]:
    """Each group is finished by the module that first read any of its params (params never
    read in forward: by the root). Returns the plan and the groups in forward read order."""
    plan: dict[nn.Module, list[BucketGroup]] = {}
    order: list[BucketGroup] = []
    for param, reader in first_reader.items():
        group = param_to_group[param]
        if group not in order:
            order.append(group)
            plan.setdefault(reader, []).append(group)
    unread = [g for g in dict.fromkeys(param_to_group.values()) if g not in order]
    if unread:
        plan.setdefault(root, [])[0:0] = unread
        order = unread + order
    return plan, order


def link_forward_order(order: Sequence[BucketGroup]) -> None:
    """Each group prefetches the gather of the group the forward reads next."""
    for group, nxt in zip(order, [*order[1:], None], strict=False):
        group.set_next_param_gather(nxt)


def has_compiled(module: nn.Module) -> bool:
    """`torch.compile(m)` (an OptimizedModule holding `_orig_mod`) or `m.compile()` anywhere
    in `module` ([Note: compiled modules])."""
    # instance dicts, not getattr: nn.Module's __getattr__ makes a miss cost ~1 us a module
    return any(
        "_orig_mod" in m._modules or m.__dict__.get("_compiled_call_impl") is not None
        for m in module.modules()
    )


def profiler_recording() -> bool:
    """torch.profiler (or the autograd profiler) is recording in this process."""
    return bool(torch.autograd.profiler._is_profiler_enabled)
