"""`megabuf inspect`: exact output for a known model, and agreement with a real DDP."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_cases import KnownNet, ddp_layouts
from plan_cases import ddp_vs_inspect
from torch import nn

from megabuf.cli import main
from megabuf.config import DistributedDataParallelConfig
from megabuf.inspect import format_inspection, inspect_model, inspection_to_dict, load_model
from megabuf.planning.replicas import mark_expert_parallel

CONFIGS: dict[str, dict[str, Any]] = {
    "sync": {},
    "overlap": {"overlap_grad_reduce": True},
    "distopt": {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
    "distopt_small_buckets": {"use_distributed_optimizer": True, "bucket_size": 5000},
}


def test_known_model_sharded_layout_text() -> None:
    cfg = DistributedDataParallelConfig(use_distributed_optimizer=True, bucket_size=100)
    text = format_inspection(inspect_model(KnownNet(), cfg, 2, model_name="known"))
    # reverse registration order, params aligned to 64 elements, buckets padded to 128:
    # bucket 0 = p3 [0, 5) + p2 [64, 128); bucket 1 = p1 [128, 165) + p0 [192, 292) -> 384
    expected = [
        "model known: 206 params, dp_size=2",
        "buffer 0 (dense, param float32, grad float32): 4 params, 2 buckets, 384 elements, "
        "padding 178 (46.35%); grad buffer 0.00 MiB, param buffer 0.00 MiB",
        "    bucket 0: [0, 128) 128 elements, 2 params, padding 59 (46.09%)",
        "      dp shards: r0 [0, 64)  r1 [64, 128)",
        "      params: p3 ... p2",
        "    bucket 1: [128, 384) 256 elements, 2 params, padding 119 (46.48%)",
        "      dp shards: r0 [128, 256)  r1 [256, 384)",
        "      params: p1 ... p0",
        "bucket groups (2), in dispatch order:",
        "  0: group 0 = buffer 0 bucket 0",
        "  1: group 1 = buffer 0 bucket 1",
    ]
    for line in expected:
        assert line in text.splitlines(), f"missing line {line!r} in:\n{text}"


def test_known_model_unsharded_has_no_padding_and_one_bucket_without_overlap() -> None:
    info = inspect_model(KnownNet(), DistributedDataParallelConfig(), 4)
    (buf,) = info.buffers
    assert info.bucket_size is None
    assert [(b.start, b.end, b.param_names) for b in buf.buckets] == [
        (0, 206, ("p3", "p2", "p1", "p0"))
    ]
    assert buf.layout.padding_numel == 0 and buf.buckets[0].shard_ranges == ()
    assert buf.grad_nbytes == 206 * 4 and buf.param_nbytes == 0


def test_inspector_matches_a_real_ddp(pools: Any) -> None:
    real = pools(2).run(ddp_layouts, "gpt_tiny", CONFIGS)[0]
    model = load_model("gpt_tiny")
    for name, values in CONFIGS.items():
        info = inspect_model(model, DistributedDataParallelConfig(**values), 2)
        mine = [
            (b.layout.numel, [(k.start, k.end, list(k.param_names)) for k in b.buckets])
            for b in info.buffers
        ]
        assert [list(x) for x in mine] == [list(x) for x in real[name]["buffers"]], name
        order = sorted(info.groups, key=lambda g: g.dispatch_position)
        assert [(g.buffer_index, g.bucket_id) for g in order] == [
            tuple(x) for x in real[name]["order"]
        ], name


def test_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    config = str(Path(__file__).resolve().parents[1] / "configs" / "distopt_overlap.toml")
    argv = ["inspect", "gpt_tiny", "--config", config, "--dp-size", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dp_size=4" in out and "r3 [" in out and "use_distributed_optimizer=True" in out
    assert main([*argv, "--json", "--set", "bucket_size=10000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dp_size"] == 4 and data["bucket_size"] == 10000
    for bucket in data["buffers"][0]["buckets"]:
        assert len(bucket["shard_ranges"]) == 4
        assert (bucket["end"] - bucket["start"]) % 4 == 0


def test_cli_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "no_such_model"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["inspect", "gpt_tiny", "--set", "bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err


def _moe_toy() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    mark_expert_parallel(model[1].parameters())
    return model


@pytest.mark.parametrize(
    "ep_size, chains",
    [
        pytest.param(1, [" chain 0 (dense + expert, over dp): 3 groups"], id="shared-dp-one-chain"),
        pytest.param(
            2,
            [" chain 0 (dense, over dp): 2 groups", " chain 1 (expert, over expt_dp): 1 group"],
            id="own-expt-dp-two-chains",
        ),
    ],
)
def test_report_shows_dispatch_chains(ep_size: int, chains: list[str]) -> None:
    cfg = DistributedDataParallelConfig(bucket_size=50)
    info = inspect_model(_moe_toy(), cfg, 2, ep_size=ep_size)
    lines = format_inspection(info).splitlines()
    assert [line for line in lines if line.startswith(" chain")] == chains
    data = inspection_to_dict(info)
    assert data["chains"] == [list(c) for c in info.plan.chains]
    assert len(info.plan.chains) == len(chains)
    assert {g["chain_id"] for g in data["groups"]} == set(range(len(chains)))


SMALL_OVERLAP = {"overlap_grad_reduce": True, "bucket_size": 200}
DISTOPT_OVERLAP = {"use_distributed_optimizer": True, "overlap_grad_reduce": True}
PLAN_CASES: dict[str, dict[str, Any]] = {
    "ep1_sync": {"ep": 1},
    "ep1_overlap_small_buckets": {"ep": 1, "config": SMALL_OVERLAP},
    "ep1_bf16_experts_fp32_grads": {
        "ep": 1,
        "bf16_experts": True,
        "config": {"grad_reduce_in_fp32": True, "bucket_size": 300},
    },
    "ep1_disable_bucketing": {"ep": 1, "disable_bucketing": True},
    "ep2_distopt_overlap": {"ep": 2, "config": DISTOPT_OVERLAP},
    "ep2_bf16_experts_small_buckets": {"ep": 2, "bf16_experts": True, "config": SMALL_OVERLAP},
    "ep2_disable_bucketing": {"ep": 2, "disable_bucketing": True},
}


def test_ddp_builds_the_plan_inspect_prints(pools: Any) -> None:
    per_rank = pools(2).run(ddp_vs_inspect, PLAN_CASES)
    for rank, results in enumerate(per_rank):
        for name, got in results.items():
            assert got["ddp"] == got["inspect"], (rank, name)
            assert got["same_plan"], (rank, name)
    ep1 = per_rank[0]["ep1_overlap_small_buckets"]["ddp"]
    assert len(ep1["chains"]) == 1 and any(e for _, e, _ in ep1["groups"])  # merged chain
    ep2 = per_rank[0]["ep2_bf16_experts_small_buckets"]["ddp"]
    assert len(ep2["chains"]) == 2 and len({b[1] for b in ep2["buffers"]}) == 2


def test_cli_finds_a_factory_module_in_the_current_directory(tmp_path: Path) -> None:
    """`megabuf inspect mymodel:make` from the directory holding mymodel.py, as `python -m`
    would find it (a console script does not put the current directory on sys.path)."""
    (tmp_path / "mymodel_for_inspect.py").write_text(
        "from torch import nn\n\ndef make():\n    return nn.Linear(3, 5)\n"
    )
    script = Path(sys.executable).with_name("megabuf")
    proc = subprocess.run(
        [str(script), "inspect", "mymodel_for_inspect:make", "--dp-size", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "20 params" in proc.stdout, proc.stdout  # 3 x 5 weight + 5 bias


# ---- shard units (optim_grads_params) ----------------------------------------------------------

ZERO3 = {"data_parallel_sharding_strategy": "optim_grads_params"}


def _mlp_with_head() -> nn.Module:
    from megabuf.testing.models import MLPStack

    model = MLPStack(8, 3)
    model.head = nn.Linear(8, 2)  # registered last, owned by the root unit
    return model


def test_units_text_for_a_known_model() -> None:
    cfg = DistributedDataParallelConfig(**ZERO3)
    text = format_inspection(inspect_model(_mlp_with_head(), cfg, 2, model_name="mlp"))
    # each unit one bucket, padded to 128: the root's head (18 elements) first (registered
    # last), then layers.2, .1, .0 (72 elements each: weight at 0, bias at 64)
    expected = [
        "    bucket 0: [0, 128) 128 elements, 2 params, padding 110 (85.94%), unit 0",
        "    bucket 3: [384, 512) 128 elements, 2 params, padding 56 (43.75%), unit 1",
        "shard units (4; reshard_after_forward=True, prefetch_units=1), gathered and released "
        "together:",
        " unit 0 <root> (MLPStack, root): 2 params, 18 elements, padded 128; gathered params "
        "512 B; buckets: buffer 0 bucket 0; group 0",
        " unit 1 layers.0 (Linear, in unit 0): 2 params, 72 elements, padded 128; gathered params "
        "512 B; buckets: buffer 0 bucket 3; group 1",
        "      params: layers.0.weight ... layers.0.bias",
        "  0: group 0 = buffer 0 bucket 0 (unit 0 <root>)",
        "  3: group 1 = buffer 0 bucket 3 (unit 1 layers.0)",
    ]
    for line in expected:
        assert line in text.splitlines(), f"missing line {line!r} in:\n{text}"


def test_units_agree_with_the_plan_and_cover_every_param() -> None:
    model = load_model("gpt_tiny")  # tied embeddings: tok_emb.weight is the root's
    cfg = DistributedDataParallelConfig(**ZERO3, bucket_size=20_000, grad_reduce_in_fp32=True)
    info = inspect_model(model.to(torch.bfloat16), cfg, 4)
    assert [u.name for u in info.units] == ["", "blocks.0", "blocks.1"]
    assert "tok_emb.weight" in info.units[0].param_names
    owned = [n for u in info.units for n in u.param_names]
    assert sorted(owned) == sorted(n for n, _ in model.named_parameters())
    buckets = {(b.index, k.bucket_id): k for b in info.buffers for k in b.buckets}
    for u in info.units:
        mine = [buckets[pair] for pair in u.buckets]
        assert len(mine) > 1 or u.index == 0  # 20k-element buckets: a block takes two
        assert {k.unit for k in mine} == {u.index}
        assert u.numel == sum(k.numel for k in mine) >= u.numel_unpadded
        assert u.numel_unpadded == sum(k.numel_unpadded for k in mine)
        assert (u.param_nbytes, u.grad_nbytes) == (2 * u.numel, 4 * u.numel)  # bf16, fp32
        assert [g.unit for g in info.plan.groups if g.group_id in u.group_ids] == [u.index]
    data = inspection_to_dict(info)
    assert [u["name"] for u in data["units"]] == ["", "blocks.0", "blocks.1"]  # type: ignore[index]
    json.dumps(data)  # serialisable


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_other_strategies_show_no_units(strategy: str) -> None:
    cfg = DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    info = inspect_model(_mlp_with_head(), cfg, 2)
    assert info.units == () and all(g.unit is None for g in info.groups)
    assert "shard units" not in format_inspection(info) and "unit 0" not in format_inspection(info)
    assert inspection_to_dict(info)["units"] == []


def test_cli_shows_units_from_set_and_reports_bad_units(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["inspect", "gpt_tiny", "--set", "data_parallel_sharding_strategy=optim_grads_params"]
    assert main([*argv, "--set", "shard_units=_Block,pos_emb", "--json"]) == 0
    units = json.loads(capsys.readouterr().out)["units"]
    assert [u["name"] for u in units] == ["", "pos_emb", "blocks.0", "blocks.1"]
    assert units[1]["params"] == ["pos_emb.weight"] and units[1]["parent"] == 0
    assert main([*argv, "--set", "shard_units=Blok"]) == 2
    assert "entry 'Blok' matches no module" in capsys.readouterr().err
    assert main([*argv, "--set", "shard_units=lm_head"]) == 2
    assert "splits shared param 'tok_emb.weight'" in capsys.readouterr().err


def test_whole_model_one_unit_warns_in_inspect() -> None:
    cfg = DistributedDataParallelConfig(**ZERO3, shard_units=("blocks",))
    model = load_model("gpt_tiny")
    for p in [*model.tok_emb.parameters(), *model.pos_emb.parameters(), *model.ln_f.parameters()]:
        p.requires_grad_(False)
    with pytest.warns(UserWarning, match="every trainable param in one shard unit"):
        info = inspect_model(model, cfg, 2)
    assert [len(u.param_names) for u in info.units] == [0, 22]
