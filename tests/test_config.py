"""DistributedDataParallelConfig: validation, loading, shipped configs; rank layout (pure)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from megabuf import DistributedDataParallelConfig, OptimizerConfig
from megabuf.transport.process_groups import rank_layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the same fallback as megabuf/config.py
    import tomli as tomllib

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_are_plain_ddp() -> None:
    cfg = DistributedDataParallelConfig()
    assert not cfg.overlap_grad_reduce and not cfg.use_distributed_optimizer
    assert cfg.bucket_size is None


@pytest.mark.parametrize("field", ["overlap_param_gather", "align_param_gather"])
def test_param_gather_flags_need_distributed_optimizer(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=True requires use_distributed_optimizer"):
        DistributedDataParallelConfig(**{field: True})
    DistributedDataParallelConfig(**{field: True}, use_distributed_optimizer=True)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_bucket_size_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ValueError, match="bucket_size"):
        DistributedDataParallelConfig(bucket_size=bad)  # type: ignore[arg-type]


def test_fields_are_keyword_only_and_documented() -> None:
    with pytest.raises(TypeError):
        DistributedDataParallelConfig(True)  # type: ignore[misc]
    source = Path(__file__).resolve().parent.parent / "megabuf" / "config.py"
    text = source.read_text()
    for name in DistributedDataParallelConfig.__dataclass_fields__:
        head = text.split(f"    {name}:", 1)[1].splitlines()[1]
        assert head.strip().startswith('"""'), f"field {name} has no docstring"


def test_from_dict_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="overlap_grad_reduc"):
        DistributedDataParallelConfig.from_dict({"overlap_grad_reduc": True})


SHIPPED = sorted(p.name for p in CONFIGS.glob("*.toml"))


def test_every_example_config_is_shipped() -> None:
    assert SHIPPED == [
        "ddp.toml", "ddp_auto.toml", "ddp_overlap.toml", "distopt_overlap.toml",
        "hybrid_zero2.toml", "moe.toml", "muon.toml", "pipeline.toml", "zero2.toml", "zero3.toml",
    ]  # fmt: skip


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_config_loads_every_table_value(name: str) -> None:
    """Every file in configs/: the [ddp] table (and the [optimizer] table where present) loads,
    each value as written, every other field at its default."""
    path = CONFIGS / name
    with open(path, "rb") as f:
        tables = tomllib.load(f)
    for cls, table in ((DistributedDataParallelConfig, "ddp"), (OptimizerConfig, "optimizer")):
        if table not in tables:
            assert table == "optimizer", f"{name} has no [ddp] table"
            continue
        cfg = cls.from_toml(path)
        default = cls()
        for field in cls.__dataclass_fields__:
            want = tables[table].get(field, getattr(default, field))
            if field == "data_parallel_sharding_strategy" and field not in tables[table]:
                # derived from use_distributed_optimizer (its alias) when not written
                want = "optim" if tables[table].get("use_distributed_optimizer") else "no_shard"
            if field == "use_distributed_optimizer" and field not in tables[table]:
                strategy = tables[table].get("data_parallel_sharding_strategy", "no_shard")
                want = strategy != "no_shard"  # True under every sharded strategy
            assert getattr(cfg, field) == want, (name, table, field)


def test_ddp_keys_load_at_top_level_or_under_ddp(tmp_path: Path) -> None:
    top, nested = tmp_path / "top.toml", tmp_path / "nested.toml"
    top.write_text("overlap_grad_reduce = true\nbucket_size = 123\n")
    nested.write_text("[ddp]\noverlap_grad_reduce = true\nbucket_size = 123\n")
    want = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=123)
    assert DistributedDataParallelConfig.from_toml(top) == want
    assert DistributedDataParallelConfig.from_toml(nested) == want


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[ddp]\noverlap_param_gather = true\n")
    with pytest.raises(ValueError, match=r"bad\.toml"):
        DistributedDataParallelConfig.from_toml(path)


def test_rank_layout_documented_order() -> None:
    groups = rank_layout(8, pp_size=2, ep_size=2)
    assert groups["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["expt_dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="ep_size=3"):
        rank_layout(8, pp_size=2, ep_size=3)


def test_sharding_strategy_and_its_alias_agree_and_contradictions_are_named() -> None:
    """`use_distributed_optimizer` is the alias of strategy "optim"; one follows the other, a
    contradiction names both fields, options of another strategy are refused by name."""
    C = DistributedDataParallelConfig
    assert (C().data_parallel_sharding_strategy, C().use_distributed_optimizer) == (
        "no_shard", False
    )  # fmt: skip
    assert C(use_distributed_optimizer=True).data_parallel_sharding_strategy == "optim"
    for strategy in ("optim", "optim_grads", "optim_grads_params"):
        assert C(data_parallel_sharding_strategy=strategy).use_distributed_optimizer is True
    zero2 = C(data_parallel_sharding_strategy="optim_grads")
    unsharded = zero2.replace(data_parallel_sharding_strategy="no_shard")
    assert unsharded.use_distributed_optimizer is False
    assert zero2.replace(use_distributed_optimizer=False).data_parallel_sharding_strategy == (
        "no_shard"
    )
    errors = {
        "contradicts use_distributed_optimizer=False": dict(
            data_parallel_sharding_strategy="optim_grads", use_distributed_optimizer=False
        ),
        "is not one of": dict(data_parallel_sharding_strategy="zero3"),
        "shard_units=('Block',) only applies to data_parallel_sharding_strategy "
        "optim_grads_params, not 'optim'": dict(
            data_parallel_sharding_strategy="optim", shard_units=["Block"]
        ),
        "prefetch_units must be an int >= 0": dict(prefetch_units=-1),
        "cpu_offload=True only applies": dict(cpu_offload=True),
        "sharded_grad_accumulation='reduce_each_microbatch' only applies": dict(
            data_parallel_sharding_strategy="optim",
            sharded_grad_accumulation="reduce_each_microbatch",
        ),
        "do not apply to optim_grads_params": dict(
            data_parallel_sharding_strategy="optim_grads_params", overlap_param_gather=True
        ),
    }
    for message, kwargs in errors.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            C(**kwargs)
    units = C(data_parallel_sharding_strategy="optim_grads_params", shard_units="Block")
    assert units.shard_units == ("Block",)
