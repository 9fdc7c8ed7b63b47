"""DistributedDataParallelConfig: validation, loading, shipped configs; rank layout (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megabuf import DistributedDataParallelConfig
from megabuf.process_groups import rank_layout

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


@pytest.mark.parametrize("name", ["ddp", "ddp_overlap", "distopt_overlap"])
def test_shipped_configs_load(name: str) -> None:
    cfg = DistributedDataParallelConfig.from_toml(CONFIGS / f"{name}.toml")
    assert cfg.use_distributed_optimizer == name.startswith("distopt")
    assert cfg.overlap_grad_reduce == (name != "ddp")


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
