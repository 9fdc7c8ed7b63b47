"""What separates torch's fused CUDA Adam from its foreach / for-loop Adam, as a bound, and a CPU
emulation of the fused kernel's arithmetic that checks the bound (tests/test_adam_kernels.py).

[Note: fused CUDA Adam bound]
On CUDA, `build_optimizer` (implementation "auto") steps megabuf's fp32 main params with torch's
fused Adam/AdamW (`fused=True`: ATen's `FusedAdamMathFunctor`, fused_adam_utils.cuh), while the
equality cases' reference (`Reference` in optimizer_cases.py) is a plain `torch.optim.Adam`,
which on CUDA takes the multi-tensor kernel (`foreach`: one `_foreach_*` launch per op). Both see
the same fp32 grads; they differ in how each step is rounded:

- foreach: each op (lerp into exp_avg, mul and addcmul into exp_avg_sq, sqrt, div by
  sqrt(bias_correction2), add eps, addcdiv into the param) rounds once to fp32. The bias
  corrections `1 - beta**t` and `lr / bias_correction1` are computed in Python doubles and
  rounded once when passed to the kernels as fp32 scalars: relative error ~u32 each.
- fused (pytorch's recent fused_adam_utils.cuh, which the H100's torch 2.11 is taken to carry;
  older versions formed the bias corrections in double and lack the effect below): one kernel
  per element, in fp32 ("opmath"): the moments with
  fused multiply-adds (one rounding each instead of two or three) and betas rounded to fp32,
  then `bias_correction = 1 - powf(fl32(beta), fl32(t))` in fp32. The moments and the bias
  corrections use the same rounded betas, so the betas' rounding cancels (at t = 1 exactly: the
  fused kernel is Adam with betas fl32(beta)). What does not cancel is the rounding of
  powf(beta, t), a value near 1 (ulp 2**-24 = 6e-8), before 1 - powf cancels it down to
  1 - 0.999**t = 1e-3 * t: half an ulp there is 1.5e-5 of bias_correction2 at t = 2, 7.5e-6 of
  sqrt(bias_correction2) and so of every update (~lr): 7.5e-8 per step at lr 1e-2. The H100 run
  saw "master of embed.weight off by 5.22e-08, 1.76x its bound" (the bound then had only the
  per-op roundings).

The bound per master element after T steps is the CPU one ([Note: bf16 optimizer bound]) plus two
terms. With L2 weight decay (Adam, not AdamW) both kernels first form grad + wd * param, rounded
differently (`decay_term`): where that sum cancels to near 0 and the update is steepest (lr / eps
per unit of grad), a few u32 of |grad| + wd * |param| reach the param. And per step t, the
bias-correction error times the largest possible update (`bias_correction_term`):
    sum_t lr * R_t * (eps_bc(beta1, t) + eps_bc(beta2, t) / 2)
where eps_bc(beta, t) = (t * |fl32(beta) - beta| * beta**(t-1) + POWF_ULPS * 2**-24) / (1 - beta**t)
bounds the relative error of the fused kernel's 1 - beta**t against the exact one (the first
part, the betas' rounding, mostly cancels as said; kept, it over-states the bound by less than
the powf allowance), and R_t bounds |m_hat| / sqrt(v_hat)
for any grads (Cauchy-Schwarz on the two moving averages, eps >= 0 only shrinks it):
    R_t = (1 - beta1) / sqrt(1 - beta2) * sqrt(1 - beta2**t) / (1 - beta1**t)
          * sqrt(sum_{j<t} (beta1**2 / beta2)**j)
(R_1 = 1; ~1.004 at t = 3 for the default betas). With lr 1e-2 that is up to ~1.3e-6 per step, the
decay term (lr 1e-2, eps 1e-4, wd 0.1, |param| <= 0.3) is of the same order: a dropped or
doubled step (~lr) is still ~10**3 times larger. POWF_ULPS = 4 is an allowance for
powf's error, not a measured figure (the emulation on CPU uses the host's powf).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

FP32_U = 2.0**-24
POWF_ULPS = 4  # allowance for CUDA powf's error, in ulps of a result in [0.5, 1): 2**-24 each


def fp32(x: float) -> float:
    """`x` rounded to the nearest fp32, back as a Python float."""
    return float(np.float32(x))


def bias_correction_rel_err(beta: float, step: int) -> float:
    """Bound on |(1 - powf(fl32(beta), t)) - (1 - beta**t)| / (1 - beta**t) (fused CUDA kernel)."""
    exact = 1.0 - beta**step
    from_beta = step * abs(fp32(beta) - beta) * max(beta, fp32(beta)) ** (step - 1)
    from_powf = POWF_ULPS * FP32_U  # the power lies in [0.5, 1) for these betas and steps
    return (from_beta + from_powf) / exact


def update_ratio_bound(beta1: float, beta2: float, step: int) -> float:
    """R_t: the largest |m_hat / sqrt(v_hat)| Adam can produce at step t, any grads."""
    geometric = sum((beta1**2 / beta2) ** j for j in range(step))
    return (
        (1 - beta1) / math.sqrt(1 - beta2)
        * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        * math.sqrt(geometric)
    )  # fmt: skip


def bias_correction_term(lr: float, betas: Sequence[float], steps: int) -> float:
    """The bias-correction part of [Note: fused CUDA Adam bound] after `steps` steps (absolute,
    the same for every element of a param group)."""
    beta1, beta2 = betas
    return sum(
        lr * update_ratio_bound(beta1, beta2, t)
        * (bias_correction_rel_err(beta1, t) + bias_correction_rel_err(beta2, t) / 2)
        for t in range(1, steps + 1)
    )  # fmt: skip


def grad_sensitivity(lr: float, betas: Sequence[float], eps: float, step: int) -> float:
    """S_t: a bound on |d update / d grad| at step t (through m and through v; denom >= eps)."""
    beta1, beta2 = betas
    through_m = (1 - beta1) / (1 - beta1**step)
    through_v = (
        update_ratio_bound(beta1, beta2, step) * math.sqrt(1 - beta2) / math.sqrt(1 - beta2**step)
    )
    return lr / eps * (through_m + through_v)


def decay_term(
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    steps: int,
    master_abs: torch.Tensor,
    exp_avg_sq: torch.Tensor,
) -> torch.Tensor:
    """The L2-decay part of [Note: fused CUDA Adam bound] per element: both kernels round
    grad + weight_decay * param differently (one fused multiply-add against separate roundings),
    an error of ~u32 * (|grad| + weight_decay * |param|) that cancellation can leave next to a
    grad near 0, where the update moves by up to S_t per unit of grad. |grad_t| is bounded by
    the reference's final exp_avg_sq: v_T >= (1 - beta2) * beta2**(T - t) * grad_t**2."""
    if not weight_decay:
        return torch.zeros_like(master_abs)
    beta2 = betas[1]
    grad_max = (exp_avg_sq / ((1 - beta2) * beta2 ** (steps - 1))).sqrt()
    per_unit = sum(grad_sensitivity(lr, betas, eps, t) for t in range(1, steps + 1))
    return per_unit * 4 * FP32_U * (grad_max + 2 * weight_decay * master_abs)


def fused_cuda_bound(
    group: dict[str, Any], steps: int, master_abs: torch.Tensor, exp_avg_sq: torch.Tensor
) -> torch.Tensor:
    """Both fused-vs-foreach terms of the Note for the elements of one reference param group
    (`group`: the reference Adam/AdamW's param group; `exp_avg_sq`: its state, same shape)."""
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    decay = 0.0 if group.get("decoupled_weight_decay") else group["weight_decay"]
    return bias_correction_term(lr, betas, steps) + decay_term(
        lr, betas, eps, decay, steps, master_abs, exp_avg_sq
    )


def ran_fused_cuda(inner_optimizers: Sequence[torch.optim.Optimizer]) -> bool:
    """Whether any of megabuf's inner torch optimizers stepped CUDA params with `fused=True`."""
    return any(
        group.get("fused") and any(p.is_cuda for p in group["params"])
        for opt in inner_optimizers
        for group in opt.param_groups
    )


# ---- CPU emulation of the fused CUDA kernel's arithmetic ---------------------------------------


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).to(torch.float64)


def _fma(a: torch.Tensor | float, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, emulated: the fp32 product is exact in fp64, one rounding after
    the add (plus fp64's own, 2**-29 of an fp32 ulp)."""
    return _f32(a * b + c)


def fused_cuda_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One Adam (L2 weight decay) step of fp32 tensors, in place, rounded as the fused CUDA kernel
    rounds (see the Note; powf is the host's)."""
    p, g = param.double(), grad.double()
    m, v = exp_avg.double(), exp_avg_sq.double()
    b1, b2 = fp32(betas[0]), fp32(betas[1])
    if weight_decay:
        g = _fma(p, torch.full_like(p, fp32(weight_decay)), g)
    m = _fma(b1, m, _fma(-b1, g, g))
    gg = _f32(g * g)
    v = _fma(b2, v, _fma(-b2, gg, gg))
    t = torch.tensor(float(step), dtype=torch.float32)
    bc1 = float(1 - torch.pow(torch.tensor(b1, dtype=torch.float32), t))
    bc2 = (1 - torch.pow(torch.tensor(b2, dtype=torch.float32), t)).to(torch.float32)
    bc2_sqrt = float(torch.sqrt(bc2))
    step_size = fp32(fp32(lr) / bc1)
    denom = _f32(_f32(_f32(torch.sqrt(v.float()).double()) / bc2_sqrt) + fp32(eps))
    p = _f32(p - _f32(_f32(step_size * m) / denom))
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
