"""Wire bytes per comm hook ([Note: hook wire bytes]) on real gloo ranks at dp=2, all-reduce and
reduce-scatter modes: Reduce's bytes are the engine's own reduction's, Compress(bf16) on fp32
grads sends exactly half of them, Noop sends nothing, every bucket's count equals
`wire_formula`; plus the formula's PowerSGD part and the report's arithmetic without processes."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from hook_wire_cases import STEPS, wire_case

from megabuf.comm_hooks import GradBucket, HookWork, hook_report, wire_formula
from megabuf.comm_hooks.telemetry import powersgd_factor_numels
from megabuf.transport.collectives import Collectives, CommStats

MULTI = {"bucket_size": 64, "overlap_grad_reduce": True}
CASES: dict[str, tuple[Any, ...]] = {
    "ar": (wire_case, MULTI),
    "rs": (wire_case, {**MULTI, "use_distributed_optimizer": True}),
}
ENGINE_OP = {"ar": "all_reduce", "rs": "reduce_scatter"}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, CASES)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["ar", "rs"])
def test_reduce_hook_counts_the_bytes_of_the_engines_own_reduction(results: Any, mode: str) -> None:
    for res in case_result(results, mode):
        plain, reduce = res["none"], res["reduce"]
        op = ENGINE_OP[mode]
        assert reduce["n_buckets"] > 2 and reduce["dispatches"] == [STEPS] * reduce["n_buckets"]
        assert reduce["report_by_op"] == {op: plain["engine"][op]}, res
        # the hook's count is all the engine counted for it (plus, in RS mode, nothing else
        # the test steps issue: no param all-gather without an optimizer)
        assert reduce["report_per_step"] == reduce["engine"][op] == plain["engine"][op]
        assert plain["formula_per_step"] == plain["engine"][op] > 0


@pytest.mark.parametrize("mode", ["ar", "rs"])
def test_compress_bf16_sends_half_of_reduce_per_op(results: Any, mode: str) -> None:
    for res in case_result(results, mode):
        reduce, wire = res["reduce"]["report_by_op"], res["bf16_wire"]["report_by_op"]
        assert all(v % 4 == 0 for v in reduce.values()), reduce  # fp32 elements
        assert wire == {op: v // 2 for op, v in reduce.items()}, res
        fp32 = res["bf16_fp32"]
        # fp32 accumulation: all-to-all [+ all-gather], the same half of the bytes in total,
        # plus, in AR mode, the zero element padding an odd-sized bucket to a multiple of dp=2
        # (2 bf16 bytes on the ring); RS buckets are already padded for the group
        want_ops = {"all_to_all"} if mode == "rs" else {"all_to_all", "all_gather"}
        assert set(fp32["report_by_op"]) == want_ops, fp32
        odd = sum(n % 2 for n in fp32["numels"])
        assert odd == 0 or mode == "ar", fp32
        assert fp32["report_per_step"] == res["reduce"]["report_per_step"] // 2 + 2 * odd, res


@pytest.mark.parametrize("mode", ["ar", "rs"])
def test_every_bucket_count_equals_the_formula(results: Any, mode: str) -> None:
    for res in case_result(results, mode):
        for label in ("reduce", "bf16_wire", "bf16_fp32", "noop"):
            got = res[label]
            assert got["per_bucket_equal"] == [True] * got["n_buckets"], (label, got)
            assert got["formula_per_step"] == got["report_per_step"], (label, got)


@pytest.mark.parametrize("mode", ["ar", "rs"])
def test_noop_sends_nothing_and_reset_clears(results: Any, mode: str) -> None:
    for res in case_result(results, mode):
        noop = res["noop"]
        assert noop["report_per_step"] == 0 and noop["report_by_op"] == {}, noop
        assert noop["dispatches"] == [STEPS] * noop["n_buckets"], noop
        assert noop["engine"] == {}, noop  # nothing at all went over the wire
        assert res["none"]["n_buckets"] == 0 and res["none"]["hooks"] == []  # no hook, no rows
        assert res["bf16_wire"]["hooks"] == ["Compress(bfloat16, wire)"]
        assert res["reduce"]["table_lines"] == res["reduce"]["n_buckets"] + 2
        for label in ("reduce", "bf16_fp32"):
            assert res[label]["after_reset"] == [(0, 0)] * res[label]["n_buckets"], res[label]


# ---- without processes ------------------------------------------------------------------------
def _bucket(shapes: list[tuple[int, ...]], group_size: int = 2, numel: int | None = None) -> Any:
    params = tuple(torch.nn.Parameter(torch.zeros(s)) for s in shapes)
    total = sum(p.numel() for p in params) if numel is None else numel
    return GradBucket(
        index=0, group_id=0, expert=False, mode="all_reduce", data=torch.zeros(total),
        shard=None, params=params, param_names=(), group=None, group_size=group_size,
        group_rank=0, rank=0, average=False, collectives=Collectives(),
    )  # fmt: skip


def test_powersgd_formula_is_sum_of_r_n_plus_m_plus_uncompressed() -> None:
    # 64x32 (compressed at r=1 and r=4: (64+32)*4*2 = 768 < 2048), 8x4 (too small:
    # (8+4)*1*2 = 24 < 32 compresses at r=1, but (8+4)*4*2 = 96 > 32 not at r=4), a bias of 64
    shapes = [(64, 32), (8, 4), (64,)]
    assert powersgd_factor_numels(shapes, 1, 2.0) == (64 + 8, 32 + 4, 2048 + 32)
    assert powersgd_factor_numels(shapes, 4, 2.0) == (64 * 4, 32 * 4, 2048)
    assert powersgd_factor_numels([(3, 2, 5)], 1, 0.0) == (3, 10, 30)  # n x m = 3 x 10
    bucket = _bucket(shapes)  # 2144 fp32 elements
    # dp 2: an all-reduce's ring figure is the tensor's bytes; three all-reduces
    assert wire_formula({"name": "powersgd", "rank": 4}, bucket) == 4 * (96 + 256 + 128)
    assert wire_formula({"name": "powersgd", "rank": 1}, bucket) == 4 * (64 + 72 + 36)
    dp4 = _bucket(shapes, group_size=4)
    assert wire_formula({"name": "powersgd", "rank": 4}, dp4) == sum(
        2 * 3 * 4 * n // 4 for n in (96, 256, 128)
    )
    assert wire_formula({"name": "quantize"}, bucket) is None
    # padding is not sent (the uncompressed all-reduce is of the params only), also in
    # reduce-scatter mode; bf16 factors halve P and Q
    padded = dataclasses.replace(_bucket(shapes, numel=2304), mode="reduce_scatter")
    assert wire_formula({"name": "powersgd", "rank": 4}, padded) == 4 * (96 + 256 + 128)
    bf16_factors = {"name": "powersgd", "rank": 4, "factor_dtype": "bfloat16"}
    assert wire_formula(bf16_factors, bucket) == 4 * 96 + 2 * (256 + 128)


def test_formulas_of_the_built_ins_without_processes() -> None:
    bucket = _bucket([(10,)], group_size=4, numel=10)  # 40 B fp32, not a multiple of 4
    assert wire_formula(None, bucket) == 2 * 3 * 40 // 4
    assert wire_formula({"name": "Reduce"}, bucket) == 60
    assert wire_formula({"name": "compress", "dtype": torch.float16}, bucket) == 2 * 3 * 20 // 4
    # fp32 accumulation pads to 12 elements: all-to-all 9 chunks-elements out, all-gather 3 * 3
    assert wire_formula({"name": "compress", "accumulate": "fp32"}, bucket) == (9 + 9) * 2
    assert wire_formula({"name": "noop"}, bucket) == 0


def test_hook_work_tallies_each_stage_of_a_hook() -> None:
    """Counts taken while a stage runs go to the bucket's tally; counts made between stages
    (another bucket's, the engine's) do not."""
    bucket = _bucket([(4,)])
    stats: CommStats = bucket.collectives.stats

    class Done:
        def wait(self) -> None:
            stats.record("other", input_nbytes=100, output_nbytes=0, ring_nbytes=100)

    def hook(b: GradBucket) -> Any:
        stats.record("all_to_all", input_nbytes=8, output_nbytes=8, ring_nbytes=4)
        yield Done()  # its wait() is not the hook's stage
        stats.record("all_gather", input_nbytes=4, output_nbytes=8, ring_nbytes=4)

    hook.name = "staged"  # type: ignore[attr-defined]
    stats.record("before", input_nbytes=1, output_nbytes=1, ring_nbytes=1)
    for _ in range(2):
        HookWork(hook, bucket).wait()
    tally = bucket.tally
    assert tally.dispatches == 2
    assert dict(tally.stats.ring_nbytes) == {"all_to_all": 8, "all_gather": 8}
    assert dict(tally.stats.calls) == {"all_to_all": 2, "all_gather": 2}
    assert stats.ring_nbytes["other"] == 200  # the engine still counts everything

    group = SimpleNamespace(comm_hook=hook, hook_buckets=[bucket])
    report = hook_report(SimpleNamespace(all_bucket_groups=[group]))
    assert report.ring_nbytes_per_step == 8 and report.buckets[0].hook == "staged"
    assert report.by_hook() == {"staged": {"buckets": 1, "ring_nbytes_per_step": 8,
                                         "calls_per_step": 2}}  # fmt: skip
