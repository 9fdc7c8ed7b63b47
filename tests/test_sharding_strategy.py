"""The sharding strategy objects ([Note: sharding strategy objects] in
megabuf/sharding/strategies.py), pure: each answers the table of the Note, the config resolves its
flags to exactly one object, and no engine module reads the flags itself."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch

from megabuf.config import DistributedDataParallelConfig
from megabuf.sharding.strategies import (
    SHARDING_STRATEGIES,
    STRATEGIES,
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


FLAGS = {"use_distributed_optimizer", "data_parallel_sharding_strategy"}
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
