"""Stepping fp32 main params on bf16 grad shards without an fp32 copy of every shard.

[Note: bf16 grads without an fp32 copy]
torch 2.13 lets a leaf hold a `.grad` of another dtype (set `main.grad_dtype = torch.bfloat16`,
then `main.grad = bf16_view` works), but torch's optimizers do not accept it: Adam and AdamW
(foreach and single-tensor) raise in `lerp_` ("expected dtype float for `end` but got dtype
c10::BFloat16"), every fused kernel checks the dtype, and SGD with momentum clones the bf16 grad
into a bf16 momentum buffer, which changes the numbers. So the inner optimizer must see fp32
grads, and `grad_dtype` alone cannot remove the copy.

What removes the *full* copy (4 bytes x every bf16 grad element of this rank, alive from the
grad attach to the end of the step): the distributed optimizer without loss scaling reads the bf16
shards directly for the grad norm (`_foreach_norm(..., dtype=float32)`: bitwise equal to the norm
of the upcast, the upcast being exact) and the zero count, and applies the clip factor to each
fp32 copy as it is made (the same product as upcasting, then `_foreach_mul_`). The inner
optimizers then step in windows of main params of at most `window_numel` elements (at least one
main param each): a window's grads are upcast, stepped, dropped. torch's optimizers skip params
whose grad is None and pointwise optimizers update a param from its own grad and state only, so
stepping in windows gives the same bits as one step. The transient is the largest window, not
the whole shard: `memory_report().grad_copy_saved_nbytes` says how much that saves.
With a grad scaler (fp16) the full copy stays: unscaling fp16 grads in place would round them.
Windows are used only for torch's Adam, AdamW and SGD (exact classes), whose state is per param
(`step` included). Any other class keeps the full copy: apex's and Transformer Engine's FusedAdam
count `step` per param group, so stepping a group once per window would advance it several times
and change the bias correction; a user's class may do anything across its params.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megabuf.optimizer.main_params import MainParam

DEFAULT_WINDOW_NUMEL = 1 << 22  # 16 MiB of fp32 grads upcast at a time
# inner optimizers whose step of a subset of params equals their part of one full step
WINDOWED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
)


def is_half_grad(mp: MainParam) -> bool:
    return mp.model_grad.dtype != torch.float32


def upcast_windows(mains: Sequence[MainParam], window_numel: int) -> list[list[MainParam]]:
    """Consecutive main params in windows of at most `window_numel` elements (a bigger one
    alone)."""
    windows: list[list[MainParam]] = []
    numel = 0
    for mp in mains:
        if not windows or numel + mp.numel > window_numel:
            windows.append([])
            numel = 0
        windows[-1].append(mp)
        numel += mp.numel
    return windows


def peak_window_nbytes(mains: Sequence[MainParam], window_numel: int) -> int:
    """fp32 bytes of the largest window of half-precision grads (the transient a step makes)."""
    half = [mp for mp in mains if is_half_grad(mp)]
    sizes = [sum(mp.numel for mp in w) for w in upcast_windows(half, window_numel)]
    return 4 * max(sizes, default=0)


def _attach_upcast(window: Sequence[MainParam], coef: float) -> None:
    for mp in window:
        mp.attach_grad()  # a half grad: its fp32 copy
    if coef != 1.0:
        torch._foreach_mul_([mp.main.grad for mp in window], coef)  # type: ignore[misc]


def step_in_windows(
    domains: Sequence[tuple[torch.optim.Optimizer, Sequence[MainParam]]],
    mains: Sequence[MainParam],
    window_numel: int,
    coef: float,
) -> None:
    """Step each domain's optimizer over its share of `mains` (every main param of the
    `domains`, in that order): fp32-grad params in a first pass, then each window of half-grad
    params with its grads upcast (times the clip `coef`), stepping only the optimizers that own
    a param of the window; see [Note: bf16 grads without an fp32 copy]. Leaves every main param
    of `mains` without a grad."""
    owner = {id(mp): opt for opt, owned in domains for mp in owned}
    half = [mp for mp in mains if is_half_grad(mp)]
    full = [mp for mp in mains if not is_half_grad(mp)]
    for window in [full, *upcast_windows(half, window_numel)]:
        if window is not full:
            _attach_upcast(window, coef)
        for optimizer in _owners(window, owner):
            optimizer.step()  # params of other windows have no grad: untouched
        for mp in window:
            mp.main.grad = None  # fp32 views are reattached by the next step's attach_grad


def _owners(
    window: Sequence[MainParam], owner: dict[int, torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """The distinct optimizers owning a param of `window`, in first-seen order."""
    found: dict[int, torch.optim.Optimizer] = {}
    for mp in window:
        opt = owner[id(mp)]
        found.setdefault(id(opt), opt)
    return list(found.values())
