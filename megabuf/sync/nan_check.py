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
a rank that raised will not issue. With a pipeline the other stages must raise too, or they go
on into the step's collectives over pp while this stage raised (a hang): one more MAX over pp
of a flag per stage, so every rank of every stage raises, the clean stages naming the stages
that saw a non-finite grad. The grads are then already reduced (NaN everywhere), so
before raising every group drops them (`abandon_grad_sync`, back to IDLE, as if no backward
ran): an optimizer step after the caught error refuses them, and `zero_grad_buffer()` starts
the next iteration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup

from megabuf.transport.collectives import Collectives

if TYPE_CHECKING:
    from megabuf.buckets.bucket_group import BucketGroup


def raise_on_nonfinite_grads(
    groups: Sequence[BucketGroup],
    collectives: Collectives,
    dp_group: ProcessGroup | None,
    *,
    dp_rank: int,
    dp_size: int,
    rank: int,
    pp_group: ProcessGroup | None = None,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> None:
    """The agreement of [Note: NaN check]: one MAX all-reduce over `dp_group` of every
    group's bucket flags (this rank's in column `dp_rank`) and one host read, then with a
    pipeline (`pp_size` > 1) one MAX all-reduce over `pp_group` of which stages saw any; raises
    on every rank of every stage if any rank's grads were not finite. Collective: every dp rank
    calls it with the same groups (same buckets), after their reductions finished, and every
    stage calls it as often (once per model chunk and grad sync)."""
    if not groups:
        return
    device = groups[0].buckets[0].grad_data.device
    rows = [g.nonfinite.per_bucket(g.buckets[0].grad_data.device) for g in groups]
    flags = torch.zeros(sum(len(r) for r in rows), dp_size, dtype=torch.float32, device=device)
    flags[:, dp_rank] = torch.cat(rows)
    collectives.all_reduce_max(flags, dp_group)
    lines = _bad_buckets(groups, flags.tolist(), collectives, dp_group)  # the one host read
    stages = _stages_agree(bool(lines), collectives, pp_group, pp_rank, pp_size, device)
    if not stages:
        return
    mine = [name for g in groups for name in g.nonfinite.names()]
    for group in groups:
        group.abandon_grad_sync()  # the reduced grads are NaN: drop them
    where = f"of {'; '.join(lines)}" if lines else f"on pipeline stage(s) {stages}"
    stage = f", pipeline stage {pp_rank}" if pp_size > 1 else ""
    raise RuntimeError(
        f"megabuf: NaN or Inf in gradients, before reduction, {where}. Every rank raises "
        "(check_for_nan_in_grad) and drops this iteration's grads; call zero_grad_buffer() "
        f"before the next iteration. This rank ({rank}{stage}) has "
        f"non-finite grads in: {', '.join(mine) or 'none'}"
        + ("" if lines else " (the ranks of the stage(s) above name the params)")
    )


def _bad_buckets(
    groups: Sequence[BucketGroup],
    bad_rows: list[list[float]],
    collectives: Collectives,
    dp_group: ProcessGroup | None,
) -> list[str]:
    """One line per bucket some dp rank flagged, naming its params and the global ranks."""
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
    return lines


def _stages_agree(
    bad: bool,
    collectives: Collectives,
    pp_group: ProcessGroup | None,
    pp_rank: int,
    pp_size: int,
    device: torch.device,
) -> list[int]:
    """The pipeline stages whose dp group saw a non-finite grad: without this agreement the
    clean stages would go on into the step's collectives while the others raised (a hang)."""
    if pp_size == 1:
        return [pp_rank] if bad else []
    seen = torch.zeros(1, pp_size, dtype=torch.float32, device=device)
    seen[0, pp_rank] = float(bad)
    collectives.all_reduce_max(seen, pp_group)
    return [s for s, f in enumerate(seen[0].tolist()) if f > 0]
