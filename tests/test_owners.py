"""Whole-param owners ([Note: whole-param owners] in megabuf/pure/owners.py), pure: every param
owned once and whole, inside its owner's shard of its bucket, shards equal, balance within the
greedy bound, deterministic; and the planner and config around it."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import ParamSpec, build_plan
from megabuf.pure.layout import PARAM_ALIGN_NUMEL, bucket_pad_multiple, compute_layout, shard_pieces
from megabuf.pure.owners import assign_owners, owner_aligned_layout, owner_cost


def _random_shapes(seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = []
    for _ in range(rng.randint(1, 14)):
        if rng.random() < 0.6:
            shapes.append((rng.randint(1, 96), rng.randint(1, 96)))
        else:
            shapes.append((rng.randint(1, 300),))
    return shapes


def _owned_layout(shapes, dp_size, bucket_size, high=False):
    numels = [int(torch.Size(s).numel()) for s in shapes]
    base = compute_layout(numels, bucket_size=bucket_size, dp_size=dp_size, sharded=True,
                          high_nccl_busbw=high)  # fmt: skip
    costs = [[owner_cost(shapes[p]) for p in b.param_ids] for b in base.buckets]
    sizes = [[numels[p] for p in b.param_ids] for b in base.buckets]
    owners, balance = assign_owners(costs, dp_size, None, sizes)
    owner_of = [0] * len(numels)
    for b, ranks in zip(base.buckets, owners, strict=True):
        for p, r in zip(b.param_ids, ranks, strict=True):
            owner_of[p] = r
    layout = owner_aligned_layout(base, numels, owner_of, dp_size, high_nccl_busbw=high)
    return numels, base, layout, balance, [owner_cost(s) for s in shapes]


CASES = [(seed, dp, bs) for seed in range(12) for dp in (1, 2, 3, 4, 8) for bs in (None, 500)]


@pytest.mark.parametrize(("seed", "dp_size", "bucket_size"), CASES)
def test_every_param_owned_once_whole_inside_its_owners_shard(seed, dp_size, bucket_size):
    shapes = _random_shapes(seed)
    numels, base, layout, _, _ = _owned_layout(shapes, dp_size, bucket_size, high=seed % 5 == 0)
    seen: dict[int, int] = {}
    for rank in range(dp_size):
        for piece in shard_pieces(layout, rank, dp_size):
            assert piece.param_start == 0 and piece.param_end == numels[piece.param_id]
            assert layout.owner_of[piece.param_id] == rank
            assert piece.param_id not in seen
            seen[piece.param_id] = rank
    assert sorted(seen) == list(range(len(numels)))
    spans = sorted((s.start, s.end) for s in layout.params)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
    for slot in layout.params:
        assert slot.start % PARAM_ALIGN_NUMEL == 0
    pad = bucket_pad_multiple(dp_size, seed % 5 == 0)
    for old, new in zip(base.buckets, layout.buckets, strict=True):
        assert sorted(old.param_ids) == sorted(new.param_ids)  # membership (overlap) unchanged
        assert new.numel % pad == 0 and new.numel % dp_size == 0
    assert layout.numel_unpadded == sum(numels)


@pytest.mark.parametrize(("seed", "dp_size", "bucket_size"), CASES)
def test_balance_within_greedy_bound_and_deterministic(seed, dp_size, bucket_size):
    """Cost: max load <= 2 x mean + the largest single cost; elements: each bucket's largest
    shard payload <= 2 x the bucket's mean + its largest param ([Note: whole-param owners]);
    the same inputs give the same owners (every rank plans alike)."""
    shapes = _random_shapes(seed)
    numels, _, layout, balance, costs = _owned_layout(shapes, dp_size, bucket_size)
    assert sum(balance.loads) == sum(costs)
    assert max(balance.loads) <= 2 * sum(costs) / dp_size + max(costs)
    for bucket in layout.buckets:
        held = [0] * dp_size
        for p in bucket.param_ids:
            held[layout.owner_of[p]] += numels[p]
        biggest = max(numels[p] for p in bucket.param_ids)
        assert max(held) <= 2 * sum(held) / dp_size + biggest
    again = _owned_layout(shapes, dp_size, bucket_size)[2]
    assert again == layout


def test_cost_is_newton_schulz_work_plus_elements():
    assert owner_cost((4, 6)) == 4 * 6 * 4 + 24
    assert owner_cost((6, 4)) == owner_cost((4, 6))
    assert owner_cost((10,)) == 10
    assert owner_cost((2, 3, 4)) == 24


def test_greedy_balances_unequal_matrices_over_ranks():
    """Asymmetric costs: a large matrix alone on one rank, the small ones on the other."""
    owners, balance = assign_owners([[owner_cost((64, 64)), owner_cost((16, 16)),
                                      owner_cost((16, 16)), owner_cost((8,))]], 2)  # fmt: skip
    assert owners == ((0, 1, 1, 1),)
    assert balance.max_over_mean == pytest.approx(2 * balance.loads[0] / sum(balance.loads))


def test_owner_layout_rejects_bad_tables():
    base = compute_layout([4, 4], bucket_size=None, dp_size=2, sharded=True)
    with pytest.raises(ValueError, match="owners outside"):
        owner_aligned_layout(base, [4, 4], [0, 2], 2)
    with pytest.raises(ValueError, match="2 numels and 1 owners"):
        owner_aligned_layout(base, [4, 4], [0], 2)
    with pytest.raises(ValueError, match="start_loads has 1 entries"):
        assign_owners([[1]], 2, [0])


def _specs() -> list[ParamSpec]:
    return [
        ParamSpec("embed", 16 * 8, torch.float32, shape=(16, 8)),
        ParamSpec("w1", 24 * 8, torch.float32, shape=(24, 8)),
        ParamSpec("b1", 24, torch.float32, shape=(24,)),
        ParamSpec("w2", 8 * 24, torch.float32, shape=(8, 24)),
        ParamSpec("x", 8 * 8, torch.float32, expert=True, shape=(8, 8)),
    ]


@pytest.mark.parametrize("strategy", ["optim", "optim_grads", "optim_grads_params"])
def test_plan_lays_out_owners_under_every_sharded_strategy(strategy):
    cfg = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, whole_param_owners=True, bucket_size=200
    )
    plan = build_plan(_specs(), cfg, dp_size=4, expt_dp_size=2, expert_shares_dp_group=False)
    assert len(plan.owner_balance) == 2  # dense over dp 4, expert over expt_dp 2
    for buf in plan.buffers:
        owners = buf.layout.owner_of
        assert owners is not None and len(owners) == len(buf.param_ids)
        assert set(owners) <= set(range(buf.dp_size))
        for rank in range(buf.dp_size):
            for piece in shard_pieces(buf.layout, rank, buf.dp_size):
                assert piece.numel == buf.layout.params[piece.param_id].numel
    plain = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    other = build_plan(_specs(), plain, dp_size=4, expt_dp_size=2, expert_shares_dp_group=False)
    assert all(b.layout.owner_of is None for b in other.buffers) and other.owner_balance == ()


def test_whole_param_owners_needs_a_sharded_strategy():
    with pytest.raises(ValueError, match="whole_param_owners=True only applies to"):
        DistributedDataParallelConfig(whole_param_owners=True)


def test_param_larger_than_the_stated_bytes_per_rank_is_refused_by_name():
    cfg = DistributedDataParallelConfig(
        use_distributed_optimizer=True, whole_param_owners=True, whole_param_max_nbytes=700
    )
    with pytest.raises(ValueError, match=r"\('w1', 768\).*whole_param_max_nbytes=700"):
        build_plan(_specs(), cfg, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True)
    with pytest.raises(ValueError, match="whole_param_max_nbytes=100 only applies to"):
        DistributedDataParallelConfig(whole_param_max_nbytes=100)
