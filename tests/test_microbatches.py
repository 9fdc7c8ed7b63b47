"""[Note: micro-batch agreement] as pure logic: `MicrobatchAgreement` against a scripted fake of
the collectives (the other ranks' codes), no process group. The real-rank cases are in
test_hybrid.py (`mismatch-*`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megabuf.sync.microbatches import (
    FORWARD,
    LAST_FORWARD,
    SYNC,
    AgreementGroups,
    MicrobatchAgreement,
)

SHARD, DP = "shard", "dp"


class ScriptedPeers:
    """all_reduce_max over SHARD fills the peer's slot with what `peer` does next; over DP
    fills the other dp slots with `dp_flags`. Records every call's group."""

    def __init__(self, peer: list[tuple[int, int]], dp_flags: list[int] | None = None) -> None:
        self.peer = list(peer)  # (kind, count) per shard-group agreement
        self.dp_flags = dp_flags or [0, 0, 0, 0]
        self.calls: list[str] = []

    def all_reduce_max(self, tensor: torch.Tensor, group: Any) -> None:
        self.calls.append(group)
        if group == SHARD:
            kind, count = self.peer.pop(0)
            tensor[1] = 4 * count + kind
        else:
            tensor.copy_(torch.maximum(tensor, torch.tensor(self.dp_flags)))

    def global_rank(self, group: Any, rank: int) -> int:
        return rank


def agreement(peers: ScriptedPeers, hybrid: bool = True) -> MicrobatchAgreement:
    groups = AgreementGroups(group=SHARD, group_rank=0, group_size=2, dp=DP, dp_rank=0,  # type: ignore[arg-type]
                             dp_size=4, hybrid=hybrid)  # fmt: skip
    return MicrobatchAgreement(peers, groups, torch.device("cpu"), rank=0, mode="M")  # type: ignore[arg-type]


def test_ranks_in_lockstep_agree_and_cross_dp_once_per_step() -> None:
    peer = [(FORWARD, 1), (LAST_FORWARD, 2), (SYNC, 2)] * 2
    peers = ScriptedPeers(peer)
    a = agreement(peers)
    for _ in range(2):
        a.forward(last=False)
        a.forward(last=True)
        a.sync()
    # one dp-wide agreement per step, at the step's first last-micro-batch forward
    assert peers.calls == [SHARD, SHARD, DP, SHARD] * 2
    assert a.count == 0 and not a.crossed


def test_explicit_sync_crosses_dp_at_the_sync() -> None:
    peers = ScriptedPeers([(FORWARD, 1), (SYNC, 1)])
    a = agreement(peers)
    a.forward(last=False)
    a.sync()
    assert peers.calls == [SHARD, SHARD, DP]


def test_a_mismatch_raises_names_both_ranks_and_tells_the_other_groups() -> None:
    peers = ScriptedPeers([(FORWARD, 2)])  # the peer starts micro-batch 2, this rank syncs
    a = agreement(peers)
    a.count = 1
    with pytest.raises(RuntimeError) as err:
        a.sync()
    text = str(err.value)
    assert "rank 0 ends the step (grad sync) after 1 micro-batch(es)" in text
    assert "rank 1 runs micro-batch 2 inside no_sync()" in text and "With M" in text
    assert peers.calls == [SHARD, DP]  # the failure is announced over dp
    assert a.count == 0 and not a.crossed


def test_a_clean_group_raises_when_another_group_failed() -> None:
    peers = ScriptedPeers([(LAST_FORWARD, 1)], dp_flags=[0, 0, 1, 1])
    a = agreement(peers)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[2, 3\] of another shard group"):
        a.forward(last=True)


def test_flat_groups_never_cross_dp() -> None:
    peers = ScriptedPeers([(LAST_FORWARD, 1), (SYNC, 1)])
    a = agreement(peers, hybrid=False)
    a.forward(last=True)
    a.sync()
    assert peers.calls == [SHARD, SHARD]
