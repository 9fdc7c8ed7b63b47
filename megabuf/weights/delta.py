"""Element-level deltas of a published slice (pure: tensors in, tensors out).

[Note: element deltas]
With `publish(delta=True)` a trainer sends, for each of its slices, only the elements that
changed since the version it sent last, as (int32 index, value) pairs, where that is fewer
bytes than the whole slice; consumers write the values at those indices into their copy.
- Detector: the slice is compared *bitwise* (an integer view of the same width) with the host
  copy of what this trainer sent last (`Publisher(track_changes=True)`), so no changed element
  is missed (no false negatives: -0.0 vs 0.0 and NaN payloads count as changes, a value that
  changed and changed back does not, since the consumer holds the sent copy). The cheaper
  low-byte detector of the issue (no full previous copy) is not implemented.
- Crossover, chosen per slice: k changed elements of an n-element slice of `item` bytes go as a
  delta when k * (4 + item) < n * item (below 1/3 changed for bf16, 1/2 for fp32), else whole.
  Every rank computes the same choice from the headers' counts (`transfer.decide`), so the
  consumers know each message's size.
- A delta is only applied on top of the version it was computed against: `decide` sends deltas
  only when every consumer holds the previous version in this publish's layout ([Note: what a
  consumer holds]: a join, a restart, a dtype switch or a re-plan gets every slice whole), and
  every `anchor_every`-th publish is whole anyway (an "anchor").
"""

from __future__ import annotations

import torch
from torch import Tensor

WHOLE = -1
"""A slice's count in a header or a transfer: sent whole (no comparable copy, or a delta would
not be smaller)."""
INDEX_DTYPE = torch.int32
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_indices(previous: Tensor | None, now: Tensor) -> Tensor | None:
    """Ascending int32 indices where `now` differs bitwise from `previous`; None when there is
    no previous copy of the same dtype and numel (the slice must go whole)."""
    if previous is None or previous.dtype != now.dtype or previous.numel() != now.numel():
        return None
    bits = _BITS[now.element_size()]
    differ = previous.reshape(-1).view(bits) != now.reshape(-1).view(bits)
    return torch.nonzero(differ).view(-1).to(INDEX_DTYPE)


def delta_pays(changed: int, numel: int, item: int) -> bool:
    """`changed` (index, value) pairs are fewer bytes than `numel` values of `item` bytes."""
    return changed * (INDEX_DTYPE.itemsize + item) < numel * item


def count(indices: Tensor | None, numel: int, item: int) -> int:
    """The header's count for a slice: the changed elements when a delta pays, else WHOLE."""
    if indices is None:
        return WHOLE
    changed = int(indices.numel())
    return changed if changed == 0 or delta_pays(changed, numel, item) else WHOLE


def apply(flat: Tensor, indices: Tensor, values: Tensor) -> None:
    """Writes `values` at `indices` of `flat` (a consumer's slice, in place)."""
    flat.index_copy_(0, indices.to(torch.int64), values)
