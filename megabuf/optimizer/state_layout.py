"""What a checkpoint's optimizer state must look like to fill an optimizer: its layout.

[Note: optimizer state layout]
Checkpoints do not require the class that saved them: torch's fused, foreach and for-loop Adam
(and apex's or Transformer Engine's, for the state they share) keep the same per-param state, so
a checkpoint saved with one implementation loads into another ([Note: optimizer implementation]).
What must match instead:
- per-param state: the same names, each either *elementwise* (one value per param element, of a
  dtype) or a *scalar* (Adam's `step`: a 0-d tensor on some device, or a Python number: all
  one kind, converted to what the loading optimizer keeps). A param saved without state (never
  stepped) fits any layout. The loading optimizer's layout is *probed*: a fresh instance of its
  class with the group's hyperparameters takes one step on a 2-element zero param, since torch
  creates state lazily at the first step;
- param groups: the same hyperparameter names, and equal values of the ALGORITHM_KEYS (Adam
  versus AdamW is `decoupled_weight_decay`, not a class). The other saved values (lr, betas...)
  are restored, as torch's `load_state_dict` does, except the IMPLEMENTATION_KEYS: which
  kernel runs is the loading optimizer's choice, never the checkpoint's.
The class name is still saved ("optimizer_class"), as information only.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

IMPLEMENTATION_KEYS = frozenset({"foreach", "fused", "capturable", "differentiable"})
ALGORITHM_KEYS = ("decoupled_weight_decay", "amsgrad", "nesterov", "maximize", "centered")
NOT_HYPERPARAMETERS = frozenset({"params", "param_keys", "param_names"})
SCALAR = "scalar"
PROBE_NUMEL = 2

Layout = dict[str, str]  # state name -> SCALAR or "elementwise <dtype>"


def entry_kind(size: Sequence[int] | None, dtype: torch.dtype | None, numel: int) -> str:
    """SCALAR, or "elementwise <dtype>" for a tensor of `numel` elements in >= 1 dims (flat or
    param-shaped). A 1-element param's state is all SCALAR: its kinds cannot be told apart."""
    if size is None or len(size) == 0 or numel <= 1 or math.prod(size) != numel:
        return SCALAR
    return f"elementwise {dtype}"


def layout_of(state: Mapping[str, Any], numel: int) -> Layout:
    """The layout of one param's state values (tensors or Python numbers)."""
    return {
        name: entry_kind(list(v.shape), v.dtype, numel) if isinstance(v, Tensor) else SCALAR
        for name, v in state.items()
    }


def expected_layout(probe: Mapping[str, Any], numel: int) -> Layout:
    """The probe's layout (PROBE_NUMEL elements) as it reads for a param of `numel` elements."""
    layout = layout_of(probe, PROBE_NUMEL)
    return {name: SCALAR for name in layout} if numel <= 1 else layout


def probe_state(optimizer: torch.optim.Optimizer, group: Mapping[str, Any]) -> dict[str, Any]:
    """Per-param state that `optimizer`'s class keeps with `group`'s hyperparameters; see
    [Note: optimizer state layout]. Empty for an empty group."""
    if not group["params"]:
        return {}
    like: Tensor = group["params"][0]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {
        k: v
        for k, v in group.items()
        if k not in NOT_HYPERPARAMETERS and (open_kwargs or k in accepted)
    }
    shape = (1, PROBE_NUMEL) if like.dim() == 2 else (PROBE_NUMEL,)  # Muon takes 2-D only
    param = torch.zeros(shape, dtype=like.dtype, device=like.device, requires_grad=True)
    param.grad = torch.zeros_like(param)
    probe = type(optimizer)([param], **kwargs)
    probe.step()
    return dict(probe.state.get(param, {}))


def layout_problems(saved: Layout, expected: Layout) -> list[str]:
    """What differs between a param's saved layout and the loading optimizer's (nothing when
    the param was saved without state)."""
    if not saved:
        return []
    only_saved = saved.keys() - expected.keys()
    problems = [f"state {n!r} saved, this optimizer keeps none" for n in only_saved]
    problems += [f"state {n!r} not saved" for n in expected.keys() - saved.keys()]
    problems += [
        f"state {n!r} saved {saved[n]}, this optimizer keeps {expected[n]}"
        for n in saved.keys() & expected.keys()
        if saved[n] != expected[n]
    ]
    return sorted(problems)


def describe_layout_problems(problems: Mapping[str, Sequence[str]]) -> str:
    """ "<problem> (params a, b, +n more)" for each distinct problem of {param key: problems}."""
    by_problem: dict[str, list[str]] = {}
    for key, found in problems.items():
        for problem in found:
            by_problem.setdefault(problem, []).append(key)
    parts = []
    for problem, keys in sorted(by_problem.items()):
        more = f", +{len(keys) - 2} more" if len(keys) > 2 else ""
        parts.append(f"{problem} (params {', '.join(keys[:2])}{more})")
    return "; ".join(parts)


def group_problems(
    saved: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Param-group hyperparameters that do not fit (groups compared in order)."""
    problems = []
    for gi, (old, new) in enumerate(zip(saved, groups, strict=False)):
        old_keys, new_keys = _hyperparameter_names(old), _hyperparameter_names(new)
        if old_keys != new_keys:
            problems.append(
                f"param group {gi}: hyperparameters {sorted(old_keys - new_keys)} saved only, "
                f"{sorted(new_keys - old_keys)} in this optimizer only"
            )
        problems += [
            f"param group {gi}: {k}={old[k]!r} saved, this optimizer has {k}={new[k]!r}"
            for k in ALGORITHM_KEYS
            if k in old and k in new and old[k] != new[k]
        ]
    return problems


def _hyperparameter_names(group: Mapping[str, Any]) -> set[str]:
    return set(group) - NOT_HYPERPARAMETERS - IMPLEMENTATION_KEYS


def restorable(saved_group: Mapping[str, Any]) -> dict[str, Any]:
    """The saved hyperparameters a load restores: all but the kernel choice and the params."""
    return {
        k: v
        for k, v in saved_group.items()
        if k not in NOT_HYPERPARAMETERS and k not in IMPLEMENTATION_KEYS
    }


def conform_scalars(values: Mapping[str, Any], probe: Mapping[str, Any]) -> dict[str, Any]:
    """Saved scalars (Adam's `step`) as the loading optimizer keeps them: a 0-d tensor of the
    probe's dtype where it keeps a tensor, a Python number where it keeps a number. torch's
    `load_state_dict` then moves them to the device its kernel wants."""
    out = dict(values)
    for name, value in values.items():
        like = probe.get(name)
        if isinstance(like, Tensor) and like.dim() == 0 and not isinstance(value, Tensor):
            out[name] = torch.tensor(float(value), dtype=like.dtype, device=like.device)
        elif like is not None and not isinstance(like, Tensor) and isinstance(value, Tensor):
            out[name] = value.item()
    return out
