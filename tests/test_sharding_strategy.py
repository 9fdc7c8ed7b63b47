"""The sharding strategy objects ([Note: sharding strategy objects] in
megabuf/sharding/strategies.py), pure: each answers the table of the Note, builds its parts from
a fake kit ([Note: strategies build their parts]), the config resolves its flags to exactly one
object (`reshard_after_forward=False`: the strategy off the linear chain), and no engine module
reads the flags itself."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.sharding.strategies import (
    NO_RESHARD,
    SHARDING_STRATEGIES,
    STRATEGIES,
    OptimGradsParams,
    OptimGradsParamsNoReshard,
    ShardingStrategy,
    sharding_strategy,
)

REPO = Path(__file__).resolve().parents[1]
# name: (reduction, shards_optimizer, shards_grads, shards_params, param_home,
#        gathers_after_step, exposes_grads, keeps_scratch)
TABLE = {
    "no_shard": ("all_reduce", False, False, False, "module", False, True, False),
    "optim": ("reduce_scatter", True, False, False, "param_data", True, False, True),
    "optim_grads": ("reduce_scatter", True, True, False, "param_data", True, False, False),
    "optim_grads_params": (
        "reduce_scatter", True, True, True, "bucket_params", False, False, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", SHARDING_STRATEGIES)
def test_each_strategy_answers_the_notes_table(name: str) -> None:
    s = sharding_strategy(name)
    got = (
        s.reduction, s.shards_optimizer, s.shards_grads, s.shards_params, s.param_home,
        s.gathers_after_step, s.exposes_grads, s.keeps_scratch,
    )  # fmt: skip
    assert got == TABLE[name]
    assert s.name == name and name in repr(s)


def test_strategies_are_ordered_least_to_most_sharded_each_a_subclass_of_the_last() -> None:
    assert tuple(TABLE) == SHARDING_STRATEGIES
    classes = [type(STRATEGIES[n]) for n in SHARDING_STRATEGIES]
    for weaker, stronger in itertools.pairwise(classes[1:]):  # no_shard is the base
        assert issubclass(stronger, weaker)
    assert all(issubclass(c, ShardingStrategy) for c in classes)


def test_prescaling_follows_the_reduction_and_fp16_always_prescales() -> None:
    for name, s in STRATEGIES.items():
        assert s.prescales(torch.float32) is (name == "no_shard")
        assert s.prescales(torch.bfloat16) is (name == "no_shard")
        assert s.prescales(torch.float16)


def test_memory_rules_divide_by_dp_where_sharded() -> None:
    n, p, g, d = 96, 2, 4, 4
    got = {k: (s.param_nbytes(n, p, d), s.grad_nbytes(n, g, d)) for k, s in STRATEGIES.items()}
    assert got == {
        "no_shard": (192, 384), "optim": (192, 384),
        "optim_grads": (192, 96), "optim_grads_params": (48, 96),
    }  # fmt: skip
    assert [STRATEGIES[k].textbook(2, 4, 12, 8) for k in TABLE] == [18, 7.5, 4, 2.25]


def test_the_config_resolves_both_flags_to_one_object() -> None:
    cfg = DistributedDataParallelConfig
    assert cfg().sharding is STRATEGIES["no_shard"]
    assert cfg(use_distributed_optimizer=True).sharding is STRATEGIES["optim"]
    for name in SHARDING_STRATEGIES:
        assert cfg(data_parallel_sharding_strategy=name).sharding is STRATEGIES[name]


def test_an_unknown_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'zero4' is not one of \['no_shard', 'optim'"):
        sharding_strategy("zero4")


FLAGS = {"use_distributed_optimizer", "data_parallel_sharding_strategy", "reshard_after_forward"}
ALLOWED = {"megabuf/config.py", "megabuf/sharding/strategies.py"}


def test_no_engine_module_reads_the_strategy_flags() -> None:
    """The flags are read in config.py (which resolves them) and nowhere else under megabuf/:
    every other module asks the strategy object. Attribute reads only; strings (messages,
    config literals of the benchmark systems) do not count."""
    reads = []
    for path in sorted((REPO / "megabuf").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in FLAGS:
                reads.append(f"{rel}:{node.lineno} .{node.attr}")
    assert reads == []


class FakeKit:
    """Every kit of [Note: strategies build their parts] at once: each builder returns its own
    name, so a test sees which one the strategy asked for."""

    def sharded_params(self) -> str:
        return "sharded_params"

    def gathered(self) -> str:
        return "gathered"

    def units(self, *, reshard_after_forward: bool) -> str:
        return f"units(reshard_after_forward={reshard_after_forward})"

    def exposed(self) -> str:
        return "exposed"

    def refused(self) -> str:
        return "refused"

    def plan_units(self) -> str:
        return "plan_units"

    def distributed(self) -> str:
        return "distributed"

    def replicated(self) -> str:
        return "replicated"

    def full_grads(self) -> str:
        return "full_grads"

    def sharded_grads(self) -> str:
        return "sharded_grads"

    def all_reduce(self) -> str:
        return "all_reduce"

    def reduce_scatter(self) -> str:
        return "reduce_scatter"


BUILT = {  # name: (param_storage, param_side, exposed_grads, unit_plan, optimizer,
    #              agreement by default, agreement reducing each micro-batch, grad_storage,
    #              first_reduction)
    "no_shard": (
        None, "gathered", "exposed", None, "replicated", None, None, "full_grads", "all_reduce",
    ),
    "optim": (
        None, "gathered", "refused", None, "distributed", None, None, "full_grads",
        "reduce_scatter",
    ),
    "optim_grads": (
        None, "gathered", "refused", None, "distributed", None, "each", "sharded_grads",
        "reduce_scatter",
    ),
    "optim_grads_params": (
        "sharded_params", "units(reshard_after_forward=True)", "refused", "plan_units",
        "distributed", "zero3", "each", "sharded_grads", "reduce_scatter",
    ),
    "optim_grads_params/no_reshard": (
        "sharded_params", "units(reshard_after_forward=False)", "refused", "plan_units",
        "distributed", "zero3", "each", "sharded_grads", "reduce_scatter",
    ),
}  # fmt: skip
EACH = "sharded_grad_accumulation='reduce_each_microbatch'"
ZERO3 = "data_parallel_sharding_strategy='optim_grads_params'"


def _strategy(key: str) -> ShardingStrategy:
    name, _, variant = key.partition("/")
    return sharding_strategy(name, reshard_after_forward=variant != "no_reshard")


@pytest.mark.parametrize("key", BUILT)
def test_each_strategy_builds_its_parts_from_the_kit(key: str) -> None:
    s, kit = _strategy(key), FakeKit()
    got = (
        s.param_storage(kit), s.param_side(kit), s.exposed_grads(kit), s.unit_plan(kit),
        s.optimizer(kit), s.agreement_mode("accumulate_unsharded"),
        s.agreement_mode("reduce_each_microbatch"), s.grad_storage(kit), s.first_reduction(kit),
    )  # fmt: skip
    want = tuple({"each": EACH, "zero3": ZERO3}.get(w, w) if w else w for w in BUILT[key])
    assert got == want


def test_no_reshard_is_a_strategy_off_the_chain_selected_by_the_fsdp2_knob() -> None:
    """`OptimGradsParamsNoReshard` answers as optim_grads_params except when units release, and
    the config resolves `reshard_after_forward=False` to it (and nothing else to it)."""
    s = NO_RESHARD["optim_grads_params"]
    assert type(s) is OptimGradsParamsNoReshard and isinstance(s, OptimGradsParams)
    assert s not in STRATEGIES.values()
    zero3 = STRATEGIES["optim_grads_params"]
    assert (s.name, s.reduction, s.param_home, s.exposes_grads, s.options) == (
        zero3.name,
        zero3.reduction,
        zero3.param_home,
        zero3.exposes_grads,
        zero3.options,
    )
    assert zero3.reshards_after_forward and not s.reshards_after_forward
    assert "reshard_after_forward=False" in repr(s)
    cfg = DistributedDataParallelConfig
    assert cfg(data_parallel_sharding_strategy="optim_grads_params").sharding is zero3
    got = cfg(data_parallel_sharding_strategy="optim_grads_params", reshard_after_forward=False)
    assert got.sharding is s
    with pytest.raises(ValueError, match="reshard_after_forward=False only applies to"):
        sharding_strategy("optim", reshard_after_forward=False)
    with pytest.raises(ValueError, match="reshard_after_forward=False only applies to"):
        cfg(data_parallel_sharding_strategy="optim_grads", reshard_after_forward=False)


def test_transient_bounds_per_strategy() -> None:
    """The memory formula's bound of full grad buckets (sharded grads only) and of gathered
    params: none unsharded; the root plus (1 +
    prefetch) of the largest other group, at most all, resharding; every group otherwise."""
    got = {k: _strategy(k).unsharded_params_bound(10, [4, 7, 5], 1) for k in BUILT}
    assert got == {
        "no_shard": None, "optim": None, "optim_grads": None,
        "optim_grads_params": 10 + 14, "optim_grads_params/no_reshard": 10 + 16,
    }  # fmt: skip
    assert _strategy("optim_grads_params").unsharded_params_bound(10, [4, 7, 5], 5) == 26
    grads = {k: _strategy(k).grad_buckets_bound(64) for k in BUILT}
    assert grads == {k: None if k in ("no_shard", "optim") else 64 for k in BUILT}


def test_options_name_what_each_strategy_reads_and_refuses() -> None:
    """The config refuses an option under a strategy whose `options` lack it (naming those that
    read it) and the options a strategy `refuses`."""
    cfg = DistributedDataParallelConfig
    with pytest.raises(ValueError, match=r"prefetch_units=2 only applies to .*optim_grads_params"):
        cfg(data_parallel_sharding_strategy="optim_grads", prefetch_units=2)
    with pytest.raises(ValueError, match="align_param_gather do not apply to optim_grads_params"):
        cfg(data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True)
    assert cfg(data_parallel_sharding_strategy="optim", cpu_offload=True).cpu_offload
    for name, s in STRATEGIES.items():
        assert ("shard_units" in s.options) is s.shards_params, name
        assert ("cpu_offload" in s.options) is s.shards_optimizer, name
