"""The pure memory formula (megabuf/sharding/formula.py, [Note: memory formula]): figures by
hand from a padded layout, the design notes' §2.6 table, CPU offload, transient bounds."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from megabuf.cli import main as cli_main
from megabuf.config import SHARDING_STRATEGIES, DistributedDataParallelConfig
from megabuf.inspect import format_inspection, inspect_model
from megabuf.planning.plan import ParamSpec, Plan, build_plan
from megabuf.sharding.formula import (
    ADAM,
    SGD,
    SGD_MOMENTUM,
    OptimizerStateSpec,
    bytes_per_param,
    optimizer_spec,
    persistent_bytes,
    textbook,
    transient_bounds,
)
from megabuf.sharding.memory_table import memory_per_strategy

F32, BF16 = torch.float32, torch.bfloat16


def plan_for(
    specs: list[ParamSpec], strategy: str, dp: int, expt_dp: int | None = None, **cfg: Any
) -> Plan:
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **cfg)
    expt = dp if expt_dp is None else expt_dp
    return build_plan(
        specs, config, dp_size=dp, expt_dp_size=expt, expert_shares_dp_group=expt == dp
    )


# two bf16 params, 100 and 50 elements, fp32 grads, dp=2. Sharded layout (reverse order):
# b at [0, 50), a at [64, 164) (64-element alignment), bucket padded to 256 (lcm(2, 128)).
# Rank 0's shard [0, 128) holds b (50) and a[0:64] (64): 114 elements in 2 pieces; rank 1's
# [128, 256) holds a[64:100]: 36 elements in 1 piece.
TWO = [ParamSpec("a", 100, BF16), ParamSpec("b", 50, BF16)]
BY_HAND = {  # (strategy, rank) -> params, grads, main, state (8 B/elem + 4 B/piece), scratch
    ("no_shard", 0): (300, 600, 600, 8 * 150 + 4 * 2, 0),
    ("optim", 0): (512, 1024, 456, 8 * 114 + 4 * 2, 1024),
    ("optim", 1): (512, 1024, 144, 8 * 36 + 4 * 1, 1024),
    ("optim_grads", 0): (512, 512, 456, 8 * 114 + 4 * 2, 0),
    ("optim_grads", 1): (512, 512, 144, 8 * 36 + 4 * 1, 0),
    ("optim_grads_params", 0): (256, 512, 456, 8 * 114 + 4 * 2, 0),
    ("optim_grads_params", 1): (256, 512, 144, 8 * 36 + 4 * 1, 0),
}


@pytest.mark.parametrize(("strategy", "rank"), list(BY_HAND), ids=lambda v: str(v))
def test_persistent_bytes_match_figures_by_hand(strategy: str, rank: int) -> None:
    dp = 1 if strategy == "no_shard" else 2
    plan = plan_for(TWO, strategy, dp, grad_reduce_in_fp32=True)
    got = persistent_bytes(plan, strategy, ADAM, dp_rank=rank, reduce_scatter_scratch=True)
    params, grads, main, state, scratch = BY_HAND[strategy, rank]
    assert got == {
        "params": params, "grads": grads, "main_params": main, "optimizer_state": state,
        "comm_scratch": scratch, "host_main_params": 0, "host_optimizer_state": 0, "host_grads": 0,
    }  # fmt: skip


@pytest.mark.parametrize("strategy", SHARDING_STRATEGIES)
@pytest.mark.parametrize("dp", [1, 2, 4, 8])
@pytest.mark.parametrize(
    ("dtype", "fp32_grads", "want_no_shard"), [(BF16, True, 18), (F32, False, 16)]
)
def test_unpadded_model_gives_the_design_table(
    strategy: str, dp: int, dtype: torch.dtype, fp32_grads: bool, want_no_shard: float
) -> None:
    """One param whose numel splits into dp 128-element-aligned shards: no padding, so bytes
    per param are §2.6's (18, 6 + 12/d, 2 + 16/d, 18/d for bf16; 16, 8 + 8/d, 4 + 12/d, 16/d
    for fp32 without a main copy) plus Adam's 4-byte `step` per main-param tensor."""
    numel = 128 * 8 * 3
    d = 1 if strategy == "no_shard" else dp
    plan = plan_for([ParamSpec("w", numel, dtype)], strategy, d, grad_reduce_in_fp32=fp32_grads)
    figures = persistent_bytes(plan, strategy, ADAM, dp_rank=d - 1)
    p = 2 if dtype == BF16 else 4
    want = textbook(strategy, d, param_nbytes=p, main_copy=dtype == BF16)
    assert sum(figures.values()) == want * numel + 4  # one piece: one `step`
    assert bytes_per_param(figures, numel) == want + 4 / numel
    assert textbook("no_shard", d, param_nbytes=p, main_copy=dtype == BF16) == want_no_shard


def test_textbook_table_values() -> None:
    assert [textbook(s, 8) for s in SHARDING_STRATEGIES] == [18, 7.5, 4, 2.25]
    fp32 = {"param_nbytes": 4, "main_copy": False}
    assert [textbook(s, 4, **fp32) for s in SHARDING_STRATEGIES] == [16, 10, 7, 4]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("spec", "state_per_elem", "per_tensor"), [(SGD_MOMENTUM, 4, 0), (SGD, 0, 0), (ADAM, 8, 4)]
)
def test_optimizer_kinds(spec: OptimizerStateSpec, state_per_elem: int, per_tensor: int) -> None:
    plan = plan_for(TWO, "optim", 2, grad_reduce_in_fp32=True)
    got = persistent_bytes(plan, "optim", spec, dp_rank=0)
    assert got["optimizer_state"] == state_per_elem * 114 + per_tensor * 2


def test_fp32_params_have_no_main_copy_and_offload_makes_one_on_the_host() -> None:
    specs = [ParamSpec("a", 100, F32), ParamSpec("b", 50, F32)]
    plan = plan_for(specs, "optim", 2)
    plain = persistent_bytes(plan, "optim", ADAM, dp_rank=0)
    assert plain["main_params"] == 0 and plain["optimizer_state"] == 8 * 114 + 8
    off = persistent_bytes(plan, "optim", ADAM, dp_rank=0, cpu_offload=True)
    assert off["main_params"] == off["optimizer_state"] == 0
    assert off["host_main_params"] == 4 * 114
    assert off["host_optimizer_state"] == plain["optimizer_state"]
    assert off["host_grads"] == 4 * 114
    assert off["params"] == plain["params"] and off["grads"] == plain["grads"]


def test_expert_buffers_use_the_expert_rank_and_size() -> None:
    """dp=4, ep=2: expert buffers are sharded over expt_dp=2 with the expt_dp rank."""
    specs = [ParamSpec("a", 100, BF16), ParamSpec("e", 50, BF16, expert=True)]
    plan = plan_for(specs, "optim", 4, expt_dp=2, grad_reduce_in_fp32=True)
    dense, expert = plan.buffers
    assert (dense.dp_size, expert.dp_size) == (4, 2)
    got = persistent_bytes(plan, "optim_grads", ADAM, dp_rank=3, expt_dp_rank=0)
    # dense: a at [0, 100) padded to 128, rank 3's shard [96, 128) holds a[96:100];
    # expert: e at [0, 50), padded to 128, expt rank 0's shard [0, 64) holds all of e
    assert got["grads"] == 128 * 4 // 4 + 128 * 4 // 2
    assert got["main_params"] == 4 * (4 + 50)
    assert got["optimizer_state"] == 8 * (4 + 50) + 4 * 2


def test_plan_of_another_strategy_is_refused() -> None:
    plan = plan_for(TWO, "no_shard", 2)
    with pytest.raises(ValueError, match=r"sharding padding.*'optim'"):
        persistent_bytes(plan, "optim", ADAM, dp_rank=0)
    with pytest.raises(ValueError, match="not one of"):
        persistent_bytes(plan, "zero4", ADAM, dp_rank=0)


def test_optimizer_spec_of_torch_optimizers() -> None:
    w = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_spec(torch.optim.Adam(w)) == ADAM
    assert optimizer_spec(torch.optim.AdamW(w)) == ADAM
    assert optimizer_spec(torch.optim.Adam(w, amsgrad=True)).elementwise == 3
    assert optimizer_spec(torch.optim.SGD(w, lr=0.1, momentum=0.9)) == SGD_MOMENTUM
    assert optimizer_spec(torch.optim.SGD(w, lr=0.1)) == SGD
    with pytest.raises(ValueError, match=r"Adagrad.*OptimizerStateSpec"):
        optimizer_spec(torch.optim.Adagrad(w))


def test_transient_bounds() -> None:
    plan = plan_for(TWO, "optim_grads", 2, grad_reduce_in_fp32=True, bucket_size=40)
    assert len(plan.groups) == 2  # b alone (50 -> 128 padded), then a (100 -> 128 padded)
    assert transient_bounds(plan, "optim_grads") == {
        "grad_buckets": 4 * 256,
        "grad_scratch": 4 * 256,
    }
    assert transient_bounds(plan, "optim") == {}
    # unit-aligned plan: units 0 (the root: a), 1 (b and c), 2 (d), each its own group
    four = [*TWO, ParamSpec("c", 300, BF16), ParamSpec("d", 20, BF16)]
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", bucket_size=40
    )
    sharded = build_plan(
        four, config, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True,
        unit_of_param=(0, 1, 1, 2),
    )  # fmt: skip
    sizes = {g.unit: 2 * sum(sharded.buffers[b].layout.buckets[k].numel for b, k in g.members)
             for g in sharded.groups}  # fmt: skip
    assert sizes == {0: 2 * 128, 1: 2 * (384 + 128), 2: 2 * 128}
    got = transient_bounds(sharded, "optim_grads_params", prefetch_units=0)
    assert got["unsharded_params"] == sizes[0] + sizes[1]  # root + the largest unit
    got = transient_bounds(sharded, "optim_grads_params", prefetch_units=1)
    assert got["unsharded_params"] == sizes[0] + sizes[1] + sizes[2]  # capped at every unit
    got = transient_bounds(sharded, "optim_grads_params", reshard_after_forward=False)
    assert got["unsharded_params"] == sum(sizes.values())
    assert got["grad_buckets"] == got["grad_scratch"] == sum(sizes.values())  # bf16 grads


def test_inspect_shows_memory_per_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    """`megabuf inspect`: one row per strategy from the formula (busiest rank), next to the
    textbook figure; an unpadded fp32 model gives 16, 8 + 8/d, 4 + 12/d, 16/d (+ Adam's step)."""
    model = torch.nn.Sequential(torch.nn.Linear(128, 64, bias=False))
    info = inspect_model(model, DistributedDataParallelConfig(), 4)
    assert [m.strategy for m in info.memory] == list(SHARDING_STRATEGIES)
    numel = 128 * 64
    for row, want in zip(info.memory, [16, 10, 7, 4], strict=True):
        assert row.textbook_bytes_per_param == want
        assert row.bytes_per_param == want + 4 / numel
    text = format_inspection(info)
    assert "persistent memory per strategy at dp_size=4" in text
    assert "optim_grads_params    4.00 B/param (textbook 4.00)" in text
    assert cli_main(["inspect", "gpt_tiny", "--dp-size", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["memory"]
    assert [r["strategy"] for r in rows] == list(SHARDING_STRATEGIES)
    assert rows[0]["bytes_per_param"] > rows[1]["bytes_per_param"] > rows[3]["bytes_per_param"]


def test_memory_table_takes_the_busiest_rank() -> None:
    """Rank 0 holds 114 of TWO's elements, rank 1 36: the optim row is rank 0's."""
    rows = memory_per_strategy(
        TWO, DistributedDataParallelConfig(grad_reduce_in_fp32=True), dp_size=2,
        expt_dp_size=2, expert_shares_dp_group=True,
    )  # fmt: skip
    optim = rows[1]
    assert (optim.strategy, optim.dp_rank) == ("optim", 0)
    plan = plan_for(TWO, "optim", 2, grad_reduce_in_fp32=True)
    assert optim.nbytes == persistent_bytes(plan, "optim", ADAM, dp_rank=0)
    assert optim.textbook_bytes_per_param == 18 - 12 + 12 / 2
