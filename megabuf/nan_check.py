"""`check_for_nan_in_grad`: flags recorded on the device at dispatch, agreed on once per sync.

[Note: NaN check]
A bucket group records, when it is dispatched (inside backward with overlap_grad_reduce), which
of its params' grads hold NaN or Inf *before* the reduction spreads them to every rank: one
infinity norm per param (`torch._foreach_norm`, NaN propagates), compared on the device into a
flag vector that nobody reads yet. A host read there would stall the CPU until the GPU caught up
with backward, and the run-ahead that lets reductions overlap compute would be gone.
`DistributedDataParallel.finish_grad_sync()`, once every reduction has been waited for, puts
every bucket's flag into this dp rank's column of one (buckets x dp_size) matrix, takes its MAX
over dp (one collective, whatever the number of buckets) and reads it (one host read). Every
rank sees the same matrix, so every rank raises, naming the bucket(s), their params and the
global ranks whose grads were not finite; a rank with clean grads never waits for a collective
a rank that raised will not issue. The grads are then already reduced (NaN everywhere), so
before raising every group drops them (`abandon_grad_sync`, back to IDLE, as if no backward
ran): an optimizer step after the caught error refuses them, and `zero_grad_buffer()` starts
the next iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from megabuf.collectives import Collectives

if TYPE_CHECKING:
    from megabuf.bucket_group import BucketGroup


def raise_on_nonfinite_grads(
    groups: Sequence[BucketGroup],
    collectives: Collectives,
    dp_group: ProcessGroup | None,
    *,
    dp_rank: int,
    dp_size: int,
    rank: int,
) -> None:
    """The agreement of [Note: NaN check]: one MAX all-reduce over `dp_group` of every
    group's bucket flags (this rank's in column `dp_rank`) and one host read; raises on every
    rank if any rank's grads were not finite. Collective: every dp rank calls it with the same
    groups (same buckets), after their reductions finished."""
    if not groups:
        return
    device = groups[0].buckets[0].grad_data.device
    rows = [g.bucket_nonfinite_flags() for g in groups]
    flags = torch.zeros(sum(len(r) for r in rows), dp_size, dtype=torch.float32, device=device)
    flags[:, dp_rank] = torch.cat(rows)
    collectives.all_reduce_max(flags, dp_group)
    bad_rows = flags.tolist()  # the one host read
    lines, row = [], 0
    for group in groups:
        for bucket in group.buckets:
            bad = [r for r, f in enumerate(bad_rows[row]) if f > 0]
            row += 1
            if bad:
                names = ", ".join(group.name_of(p) for p in bucket.params_list)
                ranks = [collectives.global_rank(dp_group, r) for r in bad]
                lines.append(
                    f"bucket {bucket.bucket_id} (bucket group {group.group_id}, params: "
                    f"{names}) on rank(s) {ranks}"
                )
    if lines:
        mine = [name for g in groups for name in g.nonfinite_param_names()]
        for group in groups:
            group.abandon_grad_sync()  # the reduced grads are NaN: drop them
        raise RuntimeError(
            f"megabuf: NaN or Inf in gradients, before reduction, of {'; '.join(lines)}. "
            "Every rank raises (check_for_nan_in_grad) and drops this iteration's grads; "
            "call zero_grad_buffer() before the next iteration. This rank "
            f"({rank}) has non-finite grads in: {', '.join(mine) or 'none'}"
        )
