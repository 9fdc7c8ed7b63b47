"""`export_weights`: the full params of a trained engine, streamed bucket group by bucket group.

[Note: streamed export]
The iterator yields one `WeightBucket` per bucket group of every model chunk (chunk order, then
the engine's group order: dense then expert), each holding the full values of the group's
params after the last completed optimizer step, under consumer names (`name_map`) and in the
requested dtype (`dtype`, e.g. bf16 for inference). Before the first item every param gather in
flight is waited for (`publish_params()`, [Note: who waits for param gathers]), so a param is
never read mid-gather. At most `max_buckets` groups are materialised at once:
- optim_grads_params: every unit is released first; then each group is gathered (a collective
  over its dp group: every dp rank iterates the whole export, in step) `max_buckets - 1`
  groups ahead of the one yielded, and released when the iterator moves past it. The ledger's
  "unsharded_params" peak during the export is the largest sum of `max_buckets` consecutive
  groups' full bytes.
- the other strategies hold whole params already: an item's tensors are views of the model's
  memory (no copy) unless `dtype` differs from the params' or `name_map` makes new tensors;
  copies made by the cast are counted in the ledger as "weight_export" while the item is
  current.
An item's tensors are valid until the iterator advances (ZeRO-3 releases them): copy what you
keep. The weight version is the optimizer's count of applied updates (`weight_version`;
skipped steps do not count), or the `version` given.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megabuf.bucket_group import BucketGroup
from megabuf.ddp import DistributedDataParallel, as_model_chunks
from megabuf.optimizer.base import MegabufOptimizer

EXPORT_CATEGORY = "weight_export"
NameMap = Callable[[str, Tensor], Iterable[tuple[str, Tensor]]]
"""(trainer name, full tensor) -> (consumer name, tensor) pairs: rename, split a fused qkv."""


@dataclass(frozen=True)
class WeightBucket:
    """One bucket group's full weights (valid until the iterator advances)."""

    version: int  # optimizer updates applied to these weights
    index: int  # position in the export (0, 1, ...)
    named: list[tuple[str, Tensor]]  # consumer names, in the group's param order

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named)


def weight_version(optimizer: MegabufOptimizer) -> int:
    """Optimizer updates applied so far (skipped steps excluded; not saved in checkpoints)."""
    return optimizer._completed_steps


def resolve_version(optimizer: MegabufOptimizer | None, version: int | None) -> int:
    if (optimizer is None) == (version is None):
        raise ValueError(
            "megabuf: pass exactly one of optimizer= (the version is its count of applied "
            "updates) or version= to name which step the weights are from"
        )
    return weight_version(optimizer) if optimizer is not None else int(version)  # type: ignore[arg-type]


def export_weights(
    model_or_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
    *,
    optimizer: MegabufOptimizer | None = None,
    version: int | None = None,
    dtype: torch.dtype | None = None,
    name_map: NameMap | None = None,
    max_buckets: int = 1,
) -> Iterator[WeightBucket]:
    """See [Note: streamed export]. Collective under optim_grads_params (every dp rank must
    consume the whole iterator); elsewhere not."""
    chunks = as_model_chunks(model_or_chunks, "megabuf.weights.export_weights")
    if max_buckets < 1:
        raise ValueError(f"megabuf: export_weights(max_buckets={max_buckets}) must be >= 1")
    number = resolve_version(optimizer, version)
    for chunk in chunks:
        chunk.engine.residency.check("export_weights()")
        chunk.engine.param_side.publish()  # no param is read mid-gather
        chunk.engine.param_side.reshard()
    groups = [(chunk, g) for chunk in chunks for g in chunk.engine.all_bucket_groups]
    return _stream(groups, number, dtype, name_map, max_buckets)


def _stream(
    groups: list[tuple[DistributedDataParallel, BucketGroup]],
    version: int,
    dtype: torch.dtype | None,
    name_map: NameMap | None,
    max_buckets: int,
) -> Iterator[WeightBucket]:
    gathered: set[int] = set()
    try:
        for index, (chunk, group) in enumerate(groups):
            for ahead in range(index, min(index + max_buckets, len(groups))):
                if ahead not in gathered:
                    _gather(groups[ahead][1])
                    gathered.add(ahead)
            _wait(group)
            named = _named(chunk, group, dtype, name_map)
            copied = sum(t.numel() * t.element_size() for t in _copies(group, named))
            chunk.engine.memory_ledger.alloc(EXPORT_CATEGORY, copied)
            try:
                yield WeightBucket(version, index, named)
            finally:
                chunk.engine.memory_ledger.free(EXPORT_CATEGORY, copied)
                _release(group)
                gathered.discard(index)
    finally:  # a consumer that stopped early (close(), break): nothing stays gathered
        for ahead in sorted(gathered):
            _release(groups[ahead][1])


def _gather(group: BucketGroup) -> None:
    if group.sharded_params is not None:
        group.sharded_params.start_param_gather()


def _wait(group: BucketGroup) -> None:
    if group.sharded_params is not None:
        group.sharded_params.finish_param_gather()


def _release(group: BucketGroup) -> None:
    if group.sharded_params is not None:
        group.sharded_params.ensure_released()


def _named(
    chunk: DistributedDataParallel,
    group: BucketGroup,
    dtype: torch.dtype | None,
    name_map: NameMap | None,
) -> list[tuple[str, Tensor]]:
    out: list[tuple[str, Tensor]] = []
    for param in group.params_list:
        name = chunk.engine.param_to_name[param]
        tensor = param.detach()
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        out.extend(name_map(name, tensor) if name_map is not None else [(name, tensor)])
    return out


def _copies(group: BucketGroup, named: list[tuple[str, Tensor]]) -> list[Tensor]:
    """The item's tensors that are not views of the model's memory (distinct storages)."""
    model = {p.untyped_storage().data_ptr() for p in group.params_list}
    seen: dict[int, Tensor] = {}
    for _, t in named:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model:
            seen.setdefault(ptr, t)
    return list(seen.values())
