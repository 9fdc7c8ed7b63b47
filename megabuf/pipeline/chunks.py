"""Wrapping pipeline model chunks in `DistributedDataParallel`, and feeding them their input.

[Note: pipeline bucketing]
Bucketing only pays where a grad reduction can overlap with backward compute that is still on
the critical path. Following Megatron:
- Pipeline stages > 0 get a single bucket group (`disable_bucketing=True`): with
  overlap_grad_reduce they launch their reduction from `grad_sync_func` after the cool-down, in
  the bubble while earlier stages are still running backward, so small buckets would only add
  collectives. (Megatron drops the bucket size there; megabuf goes one step further and issues
  one collective per data-parallel group.)
- Model chunks > 0 (interleaved schedule) likewise get a single bucket group: a chunk's last
  backward comes before chunk 0's, so its reduction already overlaps chunk 0's remaining work.
- Only chunk 0 of stage 0 keeps the configured buckets: its last backward is the last compute
  of the step, and only per-bucket overlap hides its reduction.
A param marked `shared_embedding=True` still gets a bucket of its own (layout `own_bucket`), so
the tied embedding's shards line up between the first and last stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.transport.process_groups import ProcessGroups


def single_bucket_group(pp_rank: int, chunk_index: int) -> bool:
    """Pure: whether a chunk gets one bucket group; see [Note: pipeline bucketing]."""
    return pp_rank > 0 or chunk_index > 0


def wrap_model_chunks(
    chunks: Sequence[nn.Module],
    ddp_config: DistributedDataParallelConfig,
    process_groups: ProcessGroups,
) -> list[DistributedDataParallel]:
    """Wrap this rank's model chunks, applying [Note: pipeline bucketing]."""
    pp_rank = process_groups.pp_rank
    return [
        DistributedDataParallel(
            chunk,
            ddp_config,
            process_groups=process_groups,
            disable_bucketing=single_bucket_group(pp_rank, i),
        )
        for i, chunk in enumerate(chunks)
    ]


def unwrap(model: nn.Module) -> nn.Module:
    """The user module inside any number of `.module` wrappers (DDP)."""
    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def set_input_tensor(model: nn.Module, tensor: Tensor | None) -> None:
    """Give a stage its input activation (None on the first stage) via the module's
    `set_input_tensor`, Megatron's convention for pipeline stage modules."""
    inner = unwrap(model)
    setter = getattr(inner, "set_input_tensor", None)
    if setter is None:
        if tensor is None:
            return
        raise ValueError(
            f"megabuf: pipeline stage module {type(inner).__name__} has no set_input_tensor(); "
            "stages after the first receive their input that way (see "
            "megabuf.testing.stages.GPTStage)"
        )
    setter(tensor)
