"""`MicrobatchAgreement`: the ranks that pair collectives every micro-batch agree on the count.

[Note: micro-batch agreement]
Under `no_sync()` most modes issue no collective at all, so ranks may run different numbers of
micro-batches per step (each scales its own loss): the step's one reduction pairs up whatever
came before. Two modes issue collectives *every* micro-batch inside the group a bucket is
sharded over (the shard group under a hybrid split, dp when flat): optim_grads* with
`sharded_grad_accumulation="reduce_each_microbatch"` (a reduce-scatter per micro-batch) and
optim_grads_params (param gathers in every forward). There two ranks of one group with
different counts pair one's last micro-batch with the other's next one (silently summing
different micro-batches) and then hang in whatever comes next. So in those modes every training
forward and every grad sync first agrees over that group (one MAX all-reduce of one int per
rank, one host read) on what each rank is about to do: micro-batch k, the step's last (a
forward outside no_sync) or not, or the sync after k. Ranks in lockstep agree; the first
difference is seen before the differing micro-batch issues anything, by every rank of the
group, which raises naming the ranks and their counts.
Different shard groups may still run different counts (nothing they pair crosses the replicate
group before the step's end, test_hybrid's asymmetric case). But a failing group's ranks never
issue the step's replicate all-reduce, which the other groups' ranks would wait for, so under a
hybrid split each rank also agrees once per step over all of dp, at its first last-micro-batch
forward or sync of the step (before any replicate all-reduce), whether its group failed: every
dp rank then raises. Cost, in the two modes only: one all-reduce of S ints in the shard group
per training forward and per grad sync, plus under hybrid one of dp ints over dp per step; each
with a host read (a device sync on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from megabuf.transport.collectives import Collectives

FORWARD, LAST_FORWARD, SYNC = 0, 1, 2  # what a rank is about to do: code = 4 * count + kind
_KIND = {FORWARD: "runs micro-batch {k} inside no_sync()",
         LAST_FORWARD: "runs micro-batch {k} as the step's last (outside no_sync())",
         SYNC: "ends the step (grad sync) after {k} micro-batch(es)"}  # fmt: skip


@dataclass(frozen=True)
class AgreementGroups:
    """Where to agree: the group a bucket is sharded over (`group`, this rank's index in it and
    its size) and, under a hybrid split, all of dp (`dp`, None when flat)."""

    group: ProcessGroup | None
    group_rank: int
    group_size: int
    dp: ProcessGroup | None
    dp_rank: int
    dp_size: int
    hybrid: bool


class MicrobatchAgreement:
    """See [Note: micro-batch agreement]. `mode` names the setting for the message."""

    def __init__(
        self,
        collectives: Collectives,
        groups: AgreementGroups,
        device: torch.device,
        *,
        rank: int,
        mode: str,
    ) -> None:
        self.collectives = collectives
        self.groups = groups
        self.device = device
        self.rank = rank
        self.mode = mode
        self.count = 0  # training forwards since the step began
        self.crossed = False  # the dp-wide agreement ran this step

    def forward(self, last: bool) -> None:
        """A training forward starts (before it issues anything)."""
        self.count += 1
        self._agree(LAST_FORWARD if last else FORWARD, self.count)

    def sync(self) -> None:
        """The grad sync that ends the step starts (before it issues anything)."""
        count, self.count = self.count, 0
        try:
            self._agree(SYNC, count)
        finally:
            self.crossed = False

    def reset(self) -> None:
        self.count, self.crossed = 0, False

    def _agree(self, kind: int, count: int) -> None:
        g = self.groups
        codes = torch.full((g.group_size,), -1, dtype=torch.int64, device=self.device)
        codes[g.group_rank] = 4 * count + kind
        self.collectives.all_reduce_max(codes, g.group)
        got = [int(c) for c in codes.tolist()]  # the one host read
        problem = "" if len(set(got)) == 1 else self._describe(got)
        if g.hybrid and not self.crossed and (kind != FORWARD or problem):
            problem = self._cross_dp(bool(problem)) or problem
        if problem:
            self.reset()
            raise RuntimeError(problem)

    def _describe(self, got: list[int]) -> str:
        ranks = [self.collectives.global_rank(self.groups.group, r) for r in range(len(got))]
        what = "; ".join(
            f"rank {r} " + _KIND[c % 4].format(k=c // 4) for r, c in zip(ranks, got, strict=True)
        )
        where = "shard group" if self.groups.hybrid else "dp group"
        return (
            f"megabuf: the ranks of {where} {ranks} ran different numbers of micro-batches this "
            f"step ({what}). With {self.mode} every micro-batch communicates inside that group, "
            "so its ranks must run the same number of micro-batches per step (and all end it "
            "outside no_sync() or all with finish_grad_sync()); give them the same count, or "
            "use sharded_grad_accumulation='accumulate_unsharded' with optim or optim_grads, "
            "where counts may differ. Every rank raises; build the step again after "
            f"zero_grad_buffer() ([Note: micro-batch agreement]; this is rank {self.rank})"
        )

    def _cross_dp(self, failed: bool) -> str:
        """Once per step under hybrid: every dp rank learns which ranks' groups disagreed."""
        g = self.groups
        self.crossed = True
        flags = torch.zeros(g.dp_size, dtype=torch.int64, device=self.device)
        flags[g.dp_rank] = int(failed)
        self.collectives.all_reduce_max(flags, g.dp)
        bad = [self.collectives.global_rank(g.dp, r) for r, f in enumerate(flags.tolist()) if f]
        if not bad or failed:
            return ""
        return (
            f"megabuf: rank(s) {bad} of another shard group ran different numbers of "
            f"micro-batches this step than the other ranks of their shard group (their error "
            f"names the counts); every rank of dp raises, this is rank {self.rank}, whose "
            "shard group agreed ([Note: micro-batch agreement])"
        )
