"""Layout checked against an independent reference written here, element by element.

`reference_cells` lays a buffer out one element at a time from the rules as documented
([Note: buffer layout] in megabuf/pure/layout.py, docs/configuration.md "Layout"), sharing no code
with megabuf:
- params in reverse registration order, never split across buckets;
- a bucket closes after the param that brings it to >= bucket_size elements, or around a param
  that asks for a bucket of its own;
- sharded (distributed optimizer): every param starts at a multiple of 64 elements and every
  bucket ends at a multiple of the smallest multiple of 128 that dp divides (of 2**16 too, for
  high NCCL bus bandwidth); shard r of a bucket is its r-th 1/dp; unsharded: no padding.
The result is a per-element owner map (which param, or padding, in which bucket); from it the
test reads off param slots, buckets, shard ranges and each rank's pieces, and compares them with
`compute_layout` / `shard_pieces` / the planner's buffers over a sweep. Last, the distributed
optimizer's `memory_report()` on real ranks against figures worked out by hand.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from bench_cases import memory_figures
from dist_pool import case_result, run_each

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.plan import ParamSpec, build_plan
from megabuf.pure.layout import compute_layout, shard_pieces

PAD = -1


def pad_multiple(dp: int, high_busbw: bool) -> int:
    step = 2**16 if high_busbw else 128  # 2**16 is itself a multiple of 128
    multiple = step
    while multiple % dp:
        multiple += step
    return multiple


def reference_cells(
    numels: list[int],
    bucket_size: int | None,
    dp: int,
    sharded: bool,
    own: list[bool],
    high_busbw: bool = False,
) -> tuple[list[int], list[int]]:
    """(owner param id or PAD, bucket id) of every buffer element, element by element."""
    owner: list[int] = []
    bucket: list[int] = []
    current, in_bucket = 0, 0  # bucket id being filled, its elements so far (padding included)

    def push(value: int) -> None:
        nonlocal in_bucket
        owner.append(value)
        bucket.append(current)
        in_bucket += 1

    def close() -> None:
        nonlocal current, in_bucket
        while sharded and len(owner) % pad_multiple(dp, high_busbw):
            push(PAD)
        current, in_bucket = current + 1, 0

    for pid in range(len(numels) - 1, -1, -1):
        if own[pid] and in_bucket:
            close()
        while sharded and len(owner) % 64:
            push(PAD)
        for _ in range(numels[pid]):
            push(pid)
        if own[pid] or (bucket_size is not None and in_bucket >= bucket_size):
            close()
    if in_bucket or not owner:
        close()
    return owner, bucket


def reference_view(owner: list[int], bucket: list[int], n_params: int, dp: int, sharded: bool):
    """Param slots, buckets and (if sharded) every rank's pieces, read off the owner map."""
    params = []
    for pid in range(n_params):
        where = [i for i, o in enumerate(owner) if o == pid]
        assert where == list(range(where[0], where[-1] + 1))  # contiguous in the reference too
        params.append((where[0], where[-1] + 1, bucket[where[0]]))
    buckets = []
    for b in range(bucket[-1] + 1 if bucket else 0):
        cells = [i for i, x in enumerate(bucket) if x == b]
        ids = tuple(dict.fromkeys(owner[i] for i in cells if owner[i] != PAD))
        payload = sum(1 for i in cells if owner[i] != PAD)
        buckets.append((b, cells[0], cells[-1] + 1, payload, ids))
    pieces: dict[int, list[tuple[int, ...]]] = {}
    if sharded:
        for rank in range(dp):
            mine, offset = [], 0
            for b, lo, hi, _, _ in buckets:
                shard = (hi - lo) // dp
                for i in range(lo + rank * shard, lo + (rank + 1) * shard):
                    pid = owner[i]
                    if pid != PAD:
                        start = params[pid][0]
                        last = mine[-1] if mine else None
                        if last and last[0] == pid and start + last[3] == i:  # run continues
                            mine[-1] = (*last[:3], last[3] + 1, *last[4:])
                        else:
                            mine.append((pid, b, i - start, i - start + 1, i, offset))
                    offset += 1
            pieces[rank] = mine
    return params, buckets, pieces


def cases() -> list[dict[str, Any]]:
    """Hand-picked edges, then a seeded random sweep."""
    out: list[dict[str, Any]] = [
        dict(numels=[64], bucket_size=None, dp=2, sharded=True),  # exactly aligned, no padding
        dict(numels=[128], bucket_size=None, dp=2, sharded=True),  # bucket exactly one multiple
        dict(numels=[129], bucket_size=None, dp=3, sharded=True),  # lcm(3, 128) = 384
        dict(numels=[1, 63, 65, 64], bucket_size=64, dp=8, sharded=True),
        dict(numels=[5, 64, 37, 100], bucket_size=100, dp=4, sharded=True),
        dict(numels=[100, 37, 64, 5], bucket_size=100, dp=2, sharded=True),  # KnownNet
        dict(numels=[10, 20, 30, 40], bucket_size=30, dp=6, sharded=True),  # lcm(6, 128) = 384
        dict(numels=[7, 7, 7], bucket_size=14, dp=1, sharded=False),  # closes at exactly 14
        dict(numels=[50, 1, 50], bucket_size=None, dp=5, sharded=True, own=[False, True, False]),
        dict(numels=[1000, 3], bucket_size=None, dp=8, sharded=True, high_busbw=True),
    ]
    rng = random.Random(16)
    for _ in range(200):
        n = rng.randint(1, 12)
        out.append(dict(
            numels=[rng.choice([rng.randint(1, 200), 64, 128, 63, 65, 1]) for _ in range(n)],
            bucket_size=rng.choice([None, rng.randint(1, 400), 64, 128]),
            dp=rng.randint(1, 8), sharded=rng.random() < 0.7,
            own=[rng.random() < 0.15 for _ in range(n)],
        ))  # fmt: skip
    return out


CASES = cases()


def test_reference_agrees_with_figures_worked_out_by_hand() -> None:
    # KnownNet at dp 2, bucket_size 100 (also in test_bench.py): p3 [0,5), p2 [64,128): 128
    # elements (alignment padding counts) >= 100 closes bucket 0, already a multiple of 128;
    # p1 [128,165), p0 [192,292): 164 >= 100 closes bucket 1, padded to [128, 384)
    owner, bucket = reference_cells([100, 37, 64, 5], 100, 2, True, [False] * 4)
    params, buckets, pieces = reference_view(owner, bucket, 4, 2, True)
    assert params == [(192, 292, 1), (128, 165, 1), (64, 128, 0), (0, 5, 0)]
    assert [b[1:] for b in buckets] == [(0, 128, 69, (3, 2)), (128, 384, 137, (1, 0))]
    # rank 1 owns [64, 128) (all of p2) and [256, 384) (p0's elements 64..100)
    assert pieces[1] == [(2, 0, 0, 64, 64, 0), (0, 1, 64, 100, 256, 64)]
    assert pad_multiple(3, False) == 384 and pad_multiple(8, False) == 128


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"c{i}")
def test_compute_layout_and_shard_pieces_match_the_reference(case: int) -> None:
    c = CASES[case]
    n = len(c["numels"])
    own = c.get("own", [False] * n)
    high = c.get("high_busbw", False)
    owner, bucket = reference_cells(c["numels"], c["bucket_size"], c["dp"], c["sharded"], own, high)
    params, buckets, pieces = reference_view(owner, bucket, n, c["dp"], c["sharded"])
    layout = compute_layout(
        c["numels"], bucket_size=c["bucket_size"], dp_size=c["dp"], sharded=c["sharded"],
        high_nccl_busbw=high, own_bucket=own,
    )  # fmt: skip
    assert [(s.start, s.end, s.bucket_id) for s in layout.params] == params, c
    got = [(b.bucket_id, b.start, b.end, b.numel_unpadded, b.param_ids) for b in layout.buckets]
    assert got == buckets, c
    assert layout.numel == len(owner) and layout.numel_unpadded == sum(c["numels"]), c
    for rank, expected in pieces.items():
        got_pieces = [
            (p.param_id, p.bucket_id, p.param_start, p.param_end, p.buffer_start, p.shard_offset)
            for p in shard_pieces(layout, rank, c["dp"])
        ]
        assert got_pieces == expected, (c, rank)
        for b, lo, hi, _, _ in buckets:
            shard = (hi - lo) // c["dp"]
            assert layout.buckets[b].shard_range(rank, c["dp"]) == (
                lo + rank * shard, lo + (rank + 1) * shard), (c, rank)  # fmt: skip


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_planned_buffers_match_the_reference(dp: int) -> None:
    """The planner's buffers (dense fp32, dense bf16, expert) each laid out as the reference
    lays out that buffer's own params, at dp (dense) and dp // 2 or 1 (expert)."""
    rng = random.Random(dp)
    dtypes = [torch.float32, torch.bfloat16]
    specs = [
        ParamSpec(f"p{i}", rng.randint(1, 150), rng.choice(dtypes), expert=rng.random() < 0.3)
        for i in range(30)
    ]
    expt_dp = max(1, dp // 2)
    config = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=200)
    plan = build_plan(specs, config, dp_size=dp, expt_dp_size=expt_dp,
                      expert_shares_dp_group=expt_dp == dp)  # fmt: skip
    seen = []
    for buf in plan.buffers:
        size = expt_dp if buf.expert else dp
        numels = [specs[i].numel for i in buf.param_ids]
        assert all(specs[i].expert == buf.expert for i in buf.param_ids)
        owner, bucket = reference_cells(numels, 200, size, True, [False] * len(numels))
        params, buckets, _ = reference_view(owner, bucket, len(numels), size, True)
        assert [(s.start, s.end, s.bucket_id) for s in buf.layout.params] == params, buf.index
        assert [(b.start, b.end) for b in buf.layout.buckets] == [b[1:3] for b in buckets]
        assert buf.layout.numel == len(owner)
        seen.extend(buf.param_ids)
    assert sorted(seen) == list(range(len(specs)))  # every param in exactly one buffer


# KnownNet (fp32 params of 100, 37, 64, 5 elements) at dp 2, bucket_size 100, distributed
# optimizer: bucket 0 = [0, 128) holds p3 [0, 5) and p2 [64, 128); bucket 1 = [128, 384) holds
# p1 [128, 165) and p0 [192, 292) (see the hand test above). Rank 0's shards: [0, 64) and
# [128, 256): p3 (5) + p1 (37) + p0's first 64 = 106 elements; rank 1's: [64, 128) and
# [256, 384): p2 (64) + p0's last 36 = 100. Each rank's shards hold 64 + 128 = 192 elements.
# AdamW keeps two fp32 moments per owned element (8 B); fp32 params are stepped in place (no
# main-param copy), bf16 params get fp32 main params (4 B per owned element); param_data is
# 384 elements of the param dtype, grad_data 384 fp32 (grad_reduce_in_fp32 with bf16).
def memory_by_hand(rank: int, bf16: bool) -> dict[str, int]:
    owned = (106, 100)[rank]
    return {
        "owned_numel": owned,
        "shard_numel": 192,
        "main_param_nbytes": 4 * owned if bf16 else 0,
        "state_nbytes": 8 * owned,
        "param_buffer_nbytes": 384 * (2 if bf16 else 4),
        "grad_buffer_nbytes": 384 * 4,
    }


@pytest.fixture(scope="module")
def memory(pools: Any) -> list[Any]:
    cases = {f"bf16={bf16}": (memory_figures, bf16) for bf16 in (False, True)}
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_memory_report_matches_figures_by_hand(memory: Any, bf16: bool) -> None:
    for rank, got in enumerate(case_result(memory, f"bf16={bf16}")):
        assert got == memory_by_hand(rank, bf16), rank
