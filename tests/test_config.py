"""DistributedDataParallelConfig: validation, loading, shipped configs; rank layout (pure)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megabuf import DistributedDataParallelConfig, OptimizerConfig
from megabuf.process_groups import rank_layout

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
        "ddp.toml", "ddp_overlap.toml", "distopt_overlap.toml", "moe.toml", "pipeline.toml"
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
