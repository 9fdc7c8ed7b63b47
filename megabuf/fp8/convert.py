"""`convert_fp8_params`: the user's float8 weights become the engine's FP8 params.

Run once by the engine before planning ([Note: FP8 params] in megabuf/fp8/__init__.py): refuse
what is not supported (by name), then, where the strategy keeps a master copy, swap each float8
weight for an FP8 param (one byte per element, one fp32 scale) and keep its high precision value
as the seed of the buffer's fp32 master, until the buffers are built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from megabuf.fp8.adapter import adapter_for, installed_adapters, is_converted_fp8
from megabuf.fp8.spec import Fp8Adapter, Fp8Spec

_MARKERS = ("allreduce", "shared_embedding")  # megabuf's param markers, carried to the FP8 param


@dataclass
class Fp8Params:
    """The engine's FP8 params: each one's spec and adapter, and (until the buffers are built)
    its high precision seed."""

    specs: dict[nn.Parameter, Fp8Spec] = field(default_factory=dict)
    adapters: dict[nn.Parameter, Fp8Adapter] = field(default_factory=dict)
    seeds: dict[nn.Parameter, Tensor] = field(default_factory=dict)  # param-shaped, hp dtype

    def seed(self, param: nn.Parameter) -> Tensor:
        if param not in self.seeds:
            raise RuntimeError(
                f"megabuf: FP8 param {self.specs[param].name!r} has no high precision seed: "
                "its buffer is built at construction and rebuilt by the bucket_size='auto' "
                "re-plan only (a copy of the model is not supported)"
            )
        return self.seeds[param]

    def drop_seeds(self) -> None:
        """The buffers hold the masters now; the full high precision copies go."""
        self.seeds.clear()


@dataclass(frozen=True)
class _Found:
    owners: tuple[tuple[nn.Module, str], ...]  # (module, attribute) holding the weight
    name: str
    param: nn.Parameter
    adapter: Fp8Adapter


def convert_fp8_params(
    module: nn.Module,
    stores_fp8: bool,
    *,
    broadcast: Callable[[Tensor, bool], None] | None,
) -> Fp8Params:
    """Refuse unsupported recipes by name; where `stores_fp8` (a strategy with a master copy)
    swap each float8 weight for an FP8 param. `broadcast(value, expert)` (init_sync): makes dp
    rank 0's high precision value everyone's (an expert weight's: expt_dp rank 0's) before the
    first cast. Without `stores_fp8` (no_shard) the
    weights stay as the library made them, as under torch DDP ([Note: FP8 params])."""
    refuse_unsupported_modules(module)
    found = _find(module)
    for item in found:
        item.adapter.check_recipe(item.owners[0][0], item.name)
    result = Fp8Params()
    if not stores_fp8 or not found:
        return result
    for item in found:
        _convert(item, result, broadcast)
    return result


def _find(module: nn.Module) -> list[_Found]:
    """Every float8 weight once (tied weights: every module holding it), in module order."""
    adapters = installed_adapters()
    if not adapters:
        return []
    by_param: dict[nn.Parameter, list[tuple[nn.Module, str, str]]] = {}
    for prefix, mod in module.named_modules(remove_duplicate=False):
        for attr, param in mod.named_parameters(recurse=False):
            if adapter_for(param) is not None:
                name = f"{prefix}.{attr}" if prefix else attr
                by_param.setdefault(param, []).append((mod, attr, name))
    found = []
    for param, owners in by_param.items():
        adapter = adapter_for(param)
        if adapter is None or adapter.is_converted(param):
            raise ValueError(
                f"megabuf: {owners[0][2]!r} is already an engine FP8 param: a model can be "
                "wrapped by one DistributedDataParallel only"
            )
        found.append(_Found(tuple((m, a) for m, a, _ in owners), owners[0][2], param, adapter))
    return found


def _convert(
    item: _Found, result: Fp8Params, broadcast: Callable[[Tensor, bool], None] | None
) -> None:
    adapter, old = item.adapter, item.param
    spec = adapter.spec(item.owners[0][0], old, item.name)
    seed = adapter.hp_value(old).clone()
    if broadcast is not None:
        broadcast(seed, getattr(old, "allreduce", True) is False)
    with torch.no_grad():
        scale = adapter.scale(seed.abs().max().to(torch.float32), spec)
        data = adapter.cast(seed, scale, spec)
    new = adapter.new_param(data, scale, spec)
    new.requires_grad_(old.requires_grad)
    for marker in _MARKERS:
        if hasattr(old, marker):
            setattr(new, marker, getattr(old, marker))
    for mod, attr in item.owners:
        setattr(mod, attr, new)
    result.specs[new] = spec
    result.adapters[new] = adapter
    result.seeds[new] = seed


def refuse_unsupported_modules(module: nn.Module) -> None:
    """Every installed library's modules with a recipe megabuf does not support, by name."""
    adapters = installed_adapters()
    for name, mod in module.named_modules():
        for adapter in adapters:
            adapter.check_module(mod, name)


def refuse_fp8_params(models: nn.Module | Sequence[nn.Module], what: str) -> None:
    """Raise ValueError naming the first FP8 param of `models` (wrapped models or modules):
    `what` does not support FP8 params yet (docs/fp8.md lists what does)."""
    for model in [models] if isinstance(models, nn.Module) else models:
        for name, param in model.named_parameters():
            if is_converted_fp8(param):
                raise ValueError(
                    f"megabuf: {what} does not support FP8 params yet ({name!r} is one); "
                    "docs/fp8.md lists what FP8 params support. Wrap the model without "
                    "enable_fsdp_float8_all_gather (torchao then casts in forward) to use it"
                )
