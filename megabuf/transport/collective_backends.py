"""Which collectives realise megabuf's operations on a (backend, device type): pure choices.

[Note: collective strategies]
A backend's own collective is not always the fastest way to move the bytes. Measured on gloo
(2 CPU ranks, 128 MB fp32; ../shared/notes/gloo-collectives.md): all_reduce ~101 ms,
reduce_scatter_tensor ~175 ms but all_to_all_single + local sum ~55 ms; all_gather_into_tensor
~135 ms but point-to-point send/recv of the shard ~34 ms. So on gloo reduce-scatter is an
all-to-all into a scratch buffer followed by a sum of the dp chunks in fixed rank order (which
is also deterministic), and all-gather is point-to-point. NCCL's native collectives are already
ring-optimal. gloo has no AVG reduction: megabuf sums and divides by the group size on finish.

The strategy is a function of (backend, device type of the tensor), `choose_strategy`: a group
can serve each device type with another backend ("cpu:gloo,cuda:nccl"), and gloo's tricks hold
for CPU tensors only (gloo runs neither all_to_all nor point-to-point on CUDA tensors), so gloo
with CUDA tensors takes the native collectives. The backend comes from the group's
`dist.get_backend_config` ("cpu:gloo,cuda:gloo" for "gloo"; "cpu:gloo" for an
`init_process_group()` without a backend on a machine without an accelerator), never from
`dist.get_backend`, which reports "undefined" or the mixed string there.

[Note: one collective per bucket group]
A bucket group holding several buckets (`disable_bucketing`) is reduced and gathered with as few
collectives as the backend allows, decided by `CollectiveStrategy.coalesce` per (backend, device):
- all-reduce, any backend: buckets that are adjacent views of one buffer are reduced as one view
  over their union (`adjacent_runs`): one call, no copy. (Today's plans give a multi-bucket group
  one bucket per buffer, `disable_bucketing`; the merge is for plans that group adjacent buckets.)
  Elementwise the result is the same sum; the backend may split a longer tensor into other ring
  chunks, so at dp > 2 an element's fp32 summation order can differ from per-bucket calls
  (bitwise-equal at dp <= 2, like any change of bucket size).
- reduce-scatter, never by union: each bucket is sharded separately (rank r owns chunk r of
  *every* bucket), so rank r's rows of the union are not contiguous and one all-to-all or
  reduce-scatter over the union would hand rank r the wrong elements (chunk r of the union).
- coalesce="manager" (NCCL on CUDA): the remaining calls of a group (one per buffer for all-reduce,
  one per bucket for reduce-scatter and all-gather) go into one `_coalescing_manager` batch, which
  torch turns into one grouped NCCL launch (allreduce_coalesced, reduce_scatter_tensor_coalesced,
  allgather_into_tensor_coalesced) with one work handle. Per-tensor results are those of separate
  calls.
- coalesce="none" (gloo, fallback): gloo accepts the same batch but flattens it into a copy and
  does not speed it up (supports_coalescing is False); its reduce-scatter is an all-to-all per
  bucket, and its p2p all-gather sends every bucket's shard in one `batch_isend_irecv`.
`CommStats.calls` counts one call per issued batch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveStrategy:
    """How one backend realises the operations on one device type; see
    [Note: collective strategies]."""

    reduce_scatter: Literal["native", "all_to_all"]
    all_gather: Literal["native", "p2p"]
    has_avg: bool  # backend supports ReduceOp.AVG
    # batch a bucket group's calls ([Note: one collective per bucket group])
    coalesce: Literal["manager", "none"] = "none"


BACKEND_STRATEGIES: dict[tuple[str, str], CollectiveStrategy] = {
    # (backend, device type) -> strategy; pairs not listed take FALLBACK_STRATEGY
    ("gloo", "cpu"): CollectiveStrategy(
        reduce_scatter="all_to_all", all_gather="p2p", has_avg=False
    ),
    ("nccl", "cuda"): CollectiveStrategy(
        reduce_scatter="native", all_gather="native", has_avg=True, coalesce="manager"
    ),
}
FALLBACK_STRATEGY = CollectiveStrategy(reduce_scatter="native", all_gather="native", has_avg=False)


@functools.lru_cache(maxsize=64)
def backend_for_device(backend: str, device_type: str) -> str | None:
    """Pure: the backend that serves `device_type` tensors in a torch.distributed backend string,
    or None if it serves none. `backend` is a name ("gloo": cpu and cuda, "nccl": cuda only, as
    torch's `Backend.backend_capability` says) or "device:backend" pairs ("cpu:gloo,cuda:nccl",
    what `dist.get_backend_config` returns). "undefined" names no device: raises ValueError."""
    text = backend.strip().lower()
    if ":" not in text:
        if text == "undefined":
            raise ValueError(
                "megabuf: backend 'undefined' does not say which backend serves which device; "
                "pass the group's dist.get_backend_config() (e.g. 'cpu:gloo,cuda:nccl')"
            )
        served = dist.Backend.backend_capability.get(text, ["cpu", "cuda"])
        return text if device_type in served else None
    for pair in text.split(","):
        device, _, name = pair.strip().partition(":")
        if device == device_type:
            return name
    return None


def choose_strategy(
    backend: str,
    device_type: str,
    strategies: Mapping[tuple[str, str], CollectiveStrategy] = BACKEND_STRATEGIES,
) -> CollectiveStrategy:
    """Pure: the strategy for `device_type` tensors on a group whose backend string is
    `backend`; see [Note: collective strategies]. Raises ValueError if no backend of the group
    serves that device type (e.g. CPU tensors on an NCCL-only group)."""
    served_by = backend_for_device(backend, device_type)
    if served_by is None:
        raise ValueError(
            f"megabuf: the process group's backend {backend!r} serves no {device_type} "
            f"tensors; move the model to a device it serves, or create the group with a backend "
            f"for {device_type} (megabuf.init_distributed(device={device_type!r}))"
        )
    return strategies.get((served_by, device_type), FALLBACK_STRATEGY)
