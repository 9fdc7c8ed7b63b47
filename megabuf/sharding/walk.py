"""`storage_walk`: the bytes a training setup holds, found by walking tensors, not by bookkeeping.

[Note: storage walk]
An independent check of `memory_report()`: it never reads the ledger, the plan or the layout.
It visits every tensor reachable from
- each model chunk's module: its params (and their `main_grad` and `.grad`) and its buffers;
- each grad buffer, each of its buckets and each bucket group: every tensor attribute, and
  tensors held in list, tuple or dict attributes (one level deep), whatever the strategy names
  them (grad_data, param_data, the reduce-scatter scratch, grad and param shards...);
- the optimizer, if given: every main param, its `.grad`, the model grad and model data it
  stands for, and every tensor of the inner optimizers' state (of a torch optimizer: its
  state);
and sums `untyped_storage().nbytes()` once per storage (keyed by device and data pointer), so
views are counted once and a released storage (resized to 0) counts 0; a DTensor counts its
local shard. Bytes are reported per device type ("cpu", "cuda", ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn


def _tensors_in(obj: object) -> Iterator[Tensor]:
    """Tensor attributes of `obj`, and tensors inside its list/tuple/dict attributes."""
    for value in vars(obj).values():
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, Tensor))


def _chunk_tensors(chunk: nn.Module) -> Iterator[Tensor]:
    module = getattr(chunk, "module", chunk)
    for param in module.parameters():
        yield param
        for name in ("main_grad", "grad"):
            extra = getattr(param, name, None)
            if isinstance(extra, Tensor):
                yield extra
    yield from module.buffers()
    engine = getattr(chunk, "engine", None)  # a megabuf DistributedDataParallel's parts
    for buf in engine.buffers if engine is not None else []:
        yield from _tensors_in(buf)
        if buf.fp8 is not None:  # scales and fp32 masters ([Note: FP8 params])
            yield from _tensors_in(buf.fp8)
        for bucket in buf.buckets:
            yield from _tensors_in(bucket)
    for group in engine.all_bucket_groups if engine is not None else []:
        yield from _tensors_in(group)


def _optimizer_tensors(optimizer: Any) -> Iterator[Tensor]:
    if not hasattr(optimizer, "domains"):
        yield from _foreign_optimizer_tensors(optimizer)
        return
    for domain in optimizer.domains:
        for mp in domain.main_params:
            yield mp.main
            if mp.main.grad is not None:
                yield mp.main.grad
            yield mp.model_grad
            if mp.model_data is not None:
                yield mp.model_data
        for state in domain.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, Tensor))


def _foreign_optimizer_tensors(optimizer: Any) -> Iterator[Tensor]:
    """A torch optimizer's params and state; ZeroRedundancyOptimizer's (`.optim`) and
    megatron-core's (`.chained_optimizers`, each wrapping a torch `.optimizer` whose params are
    its fp32 main params; its `state` is a mapping without `.values()`, so read by key)."""
    for chained in getattr(optimizer, "chained_optimizers", None) or []:
        yield from _foreign_optimizer_tensors(chained)
    inner = getattr(optimizer, "optim", optimizer)
    inner = getattr(inner, "optimizer", inner)
    for group in getattr(inner, "param_groups", []):
        yield from (p for p in group["params"] if isinstance(p, Tensor))
    state = getattr(inner, "state", {})
    for key in list(state):
        yield from (v for v in state[key].values() if isinstance(v, Tensor))


def _plain_tensors(t: Tensor) -> Iterator[Tensor]:
    """The plain tensors holding `t`'s memory: a DTensor's local shard, a wrapper subclass's
    inner tensors (an FP8 param's bytes and scale), or `t` itself."""
    if hasattr(t, "to_local"):  # a DTensor: this rank's shard
        yield t.to_local()
    elif hasattr(type(t), "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        for name in names:
            yield from _plain_tensors(getattr(t, name))
    else:
        yield t


def unique_storage_nbytes(tensors: Iterable[Tensor]) -> dict[str, int]:
    """Bytes of the distinct storages behind `tensors`, per device type."""
    seen: set[tuple[torch.device, int]] = set()
    total: dict[str, int] = {}
    for t in (plain for tensor in tensors for plain in _plain_tensors(tensor)):
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        key = (t.device, storage.data_ptr())
        if nbytes == 0 or key in seen:
            continue
        seen.add(key)
        total[t.device.type] = total.get(t.device.type, 0) + nbytes
    return total


def storage_walk(
    model_chunks: nn.Module | Sequence[nn.Module], optimizer: Any = None
) -> dict[str, int]:
    """Bytes held by `model_chunks` (megabuf DistributedDataParallel or plain modules) and
    `optimizer`, per device type; see [Note: storage walk]."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    tensors = [t for chunk in chunks for t in _chunk_tensors(chunk)]
    if optimizer is not None:
        tensors += list(_optimizer_tensors(optimizer))
    return unique_storage_nbytes(tensors)
