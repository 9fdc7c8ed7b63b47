"""FP8 params ([Note: FP8 params] in megabuf/fp8/__init__.py; docs/fp8.md).

Pure tests: detection, the recipe refusals, the planner's dtype key. Multi-process tests
(fp8_cases.py, real gloo ranks at dp 2 and 4) of the model a user converts with torchao
(`convert_to_float8_training`, `enable_fsdp_float8_all_gather=True`) under optim, optim_grads
and optim_grads_params: every rank's gathered FP8 weight (bytes and scale) bitwise equal to the
others' and to single-process torchao's cast of the full fp32 master; forward bitwise equal to a
single-process torchao model holding that master; one amax all-reduce per step; the param
all-gather at 1 byte per FP8 element; the trajectory against single-process training within the
bound of FP8 grads (below).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("torchao.float8", reason="torchao (the fp8 extra) is not installed")

import fp8_cases as fc

import megabuf
from megabuf.fp8 import convert_fp8_params, is_fp8_param
from megabuf.planning.plan import dtype_key

STRATEGIES = ("optim", "optim_grads", "optim_grads_params")
HYBRID = ("optim", "optim_grads_params")
REFUSALS = {
    "rowwise": "'rowwise' recipe",
    "rowwise_with_gw_hp": "'rowwise_with_gw_hp' recipe",
}
# The trajectory bound: the FP8 grads of data-parallel training are cast per rank (torchao
# scales grad_output by the amax of the rank's micro-batch, e5m2 keeps 2 mantissa bits), so the
# fp32 masters drift from single-process training by the quantisation of the grads, not by
# rounding: after 3 SGD steps (lr 0.1) on weights of magnitude ~0.2 we allow 1e-2.
TRAJECTORY_BOUND = 1e-2


UNSUPPORTED = {
    "publisher": "Publisher does not support FP8 params",
}


def _cases(root: str = "/tmp") -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {s: (fc.numerics_case, s) for s in STRATEGIES}
    cases |= {f"refuse_{k}": (fc.refusal_case, k) for k in REFUSALS}
    cases |= {f"memory_{s}": (fc.memory_case, s) for s in STRATEGIES}
    cases |= {f"unsupported_{k}": (fc.unsupported_case, k, root) for k in UNSUPPORTED}
    cases |= {f"resume_{s}": (fc.resume_case, s, root) for s in STRATEGIES}
    cases |= {f"cross_{s}": (fc.cross_case, s, root) for s in STRATEGIES}
    cases |= {f"hybrid_{s}": (fc.hybrid_case, s) for s in HYBRID}
    cases |= {f"auto_{s}": (fc.auto_case, s) for s in STRATEGIES}
    cases |= {f"offload_{s}": (fc.offload_case, s) for s in STRATEGIES}
    cases |= {f"export_{s}": (fc.export_case, s) for s in STRATEGIES}
    cases |= {f"expert_{s}": (fc.expert_case, s) for s in STRATEGIES}
    return cases | {"no_shard": (fc.no_shard_case,)}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda ws: f"dp{ws}")
def results(request: Any, pools: Any, tmp_path_factory: Any) -> tuple[int, list[dict[str, Any]]]:
    from dist_pool import run_each

    root = str(tmp_path_factory.mktemp(f"fp8_dp{request.param}"))
    return request.param, pools(request.param).run(run_each, _cases(root))


def _one(results: Any, name: str) -> list[Any]:
    from dist_pool import case_result

    return case_result(results[1], name)


def test_detection_and_dtype_key() -> None:
    """torchao's float8 weight is detected (and plain params are not); the planner stores it as
    uint8 under the sharded strategies and as the weight's dtype under no_shard."""
    net = fc.build_net()
    assert is_fp8_param(net.up.weight) and not is_fp8_param(net.up.bias)
    assert not is_fp8_param(fc.build_net(fsdp=False).up.weight)  # torchao casts in forward
    for strategy, stored in (("no_shard", torch.float32), ("optim", torch.uint8)):
        cfg = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
        assert dtype_key(torch.float32, cfg, fp8=True) == (stored, torch.float32)
        assert dtype_key(torch.float32, cfg) == (torch.float32, torch.float32)


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_unsupported_recipe_refused_by_name(recipe: str) -> None:
    """A rowwise recipe is refused, naming the param and the supported recipe."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    net = fc.Net()
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(net, config=config)
    net.up.weight = torch.nn.Parameter(fc.build_net().up.weight)  # a float8 weight under it
    with pytest.raises(ValueError, match=rf"'up.weight'.*'{recipe}' recipe.*'tensorwise' recipe"):
        convert_fp8_params(net, True, broadcast=None)


def test_no_shard_keeps_torchao_weights() -> None:
    """Without a master copy the weights are left as torchao made them (nothing converted)."""
    net = fc.build_net()
    before = {n: type(p) for n, p in net.named_parameters()}
    assert not convert_fp8_params(net, False, broadcast=None).specs
    assert {n: type(p) for n, p in net.named_parameters()} == before


def test_transformer_engine_adapter() -> None:
    """TE's Float8Tensor params are recognised and refused by name, naming the torchao path."""
    pytest.importorskip(
        "transformer_engine.pytorch", reason="transformer_engine is not installed on this machine"
    )
    from megabuf.fp8.te_adapter import te_adapter

    adapter = te_adapter()
    assert adapter is not None
    with pytest.raises(ValueError, match="Transformer Engine"):
        adapter.check_recipe(torch.nn.Linear(2, 2), "w")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gathered_weight_is_torchaos_cast_of_the_master(results: Any, strategy: str) -> None:
    """Every rank's FP8 bytes and scale equal every other rank's and, bitwise, single-process
    torchao's dynamic cast of the full fp32 master; forward equals, bitwise, a single-process
    torchao model holding that master (the max of the shards' amaxes is the full amax, the cast
    is elementwise)."""
    per_rank = _one(results, strategy)
    for r in per_rank:
        assert r["parts"] == per_rank[0]["parts"]
        assert set(r["parts"]) == set(fc.FP8_NAMES)
        for name in fc.FP8_NAMES:
            assert r["parts"][name] == r["torchao"][name], name
        assert r["forward_equal"], r["forward_diff"]
        assert r["types"]["up.weight"] == "Float8TrainingTensor"
        assert r["types"]["up.bias"] == "Parameter"  # mixed in one model and bucket group


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_one_amax_all_reduce_per_step(results: Any, strategy: str) -> None:
    """Exactly one amax all-reduce per step for all FP8 params together."""
    for r in _one(results, strategy):
        assert r["amax_calls"] == r["steps"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_param_gather_moves_one_byte_per_fp8_element(results: Any, strategy: str) -> None:
    """The FP8 buffer is uint8 with high precision grads; the param all-gathers hand over
    (n-1)/n of 1 byte per FP8 element plus 4 per fp32 element (twice per step under
    optim_grads_params: forward and backward)."""
    for r in _one(results, strategy):
        assert r["buffers"][0][:2] == ("torch.uint8", "torch.float32")
        gathers = 2 if strategy == "optim_grads_params" else 1
        assert r["gather_ring_nbytes"] == gathers * r["expected_ring_nbytes"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_trajectory_within_fp8_grad_bound(results: Any, strategy: str) -> None:
    """The fp32 masters after 3 steps against single-process torchao training on the global
    batch: within TRAJECTORY_BOUND (the grads' FP8 casts differ per rank, see the bound)."""
    for r in _one(results, strategy):
        assert r["master_diff"] < TRAJECTORY_BOUND


@pytest.mark.parametrize("kind", REFUSALS)
def test_refused_at_construction_by_name(results: Any, kind: str) -> None:
    for message in _one(results, f"refuse_{kind}"):
        assert REFUSALS[kind] in message, message


def test_no_shard_behaves_as_torch_ddp(results: Any) -> None:
    """no_shard: the weights stay torchao's (high precision, cast in forward), as under torch
    DDP; no uint8 buffer; training follows single-process training within the bound."""
    for r in _one(results, "no_shard"):
        assert r["types"]["up.weight"] == "WeightWithDynamicFloat8CastTensor"
        assert "torch.uint8" not in r["buffers"]
        assert r["master_diff"] < TRAJECTORY_BOUND


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_memory_formula_equals_report_and_storage_walk(results: Any, strategy: str) -> None:
    """FP8 params count 1 byte per element plus a 4-byte scale each (and the fp32 master of
    this rank's padded shard): the formula equals the optimizer's memory report per category
    and the storage walk in total, on every rank ([Note: memory formula])."""
    for r in _one(results, f"memory_{strategy}"):
        dtype, numel, n_params = r["fp8_buffer"]
        assert dtype == "torch.uint8"
        for category, nbytes in r["formula"].items():
            assert r["persistent"].get(category, 0) == nbytes, category
        assert sum(r["walk"].values()) == sum(r["formula"].values())
        shards = 1 if strategy != "optim_grads_params" else results[0]
        fp32_params = r["formula"]["params"] - numel // shards - 4 * n_params
        assert fp32_params >= 0 and fp32_params % 4 == 0  # the rest: the fp32 buffer


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_resume_is_bitwise(results: Any, strategy: str) -> None:
    """A checkpoint of an FP8 model loads into a fresh one (bytes, scales, fp32 masters bitwise
    those saved), and the next step equals the uninterrupted run's bitwise ([Note: FP8 params
    in checkpoints])."""
    for r in _one(results, f"resume_{strategy}"):
        assert r == {"loaded_bitwise": True, "step_bitwise": True, "changed": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_loads_across_fp8_and_plain_models(results: Any, strategy: str) -> None:
    """An FP8 model's checkpoint (entries: the masters in the weight's dtype) loads into the
    model without torchao, and a checkpoint of the model torchao casts in forward loads into the
    FP8 model, whose bytes are then torchao's cast of the loaded masters."""
    for r in _one(results, f"cross_{strategy}"):
        assert r == {"to_plain": True, "from_hp": True, "bytes_are_casts": True}


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize(("saved_dp", "loaded_dp"), [(2, 4), (4, 2)])
def test_checkpoint_reshards(
    pools: Any, tmp_path_factory: Any, strategy: str, saved_dp: int, loaded_dp: int
) -> None:
    """Saved at one dp size, loaded at another: the full masters bitwise those saved, every
    rank's FP8 bytes and scales torchao's cast of them, and a step runs."""
    root = str(tmp_path_factory.mktemp(f"fp8_reshard_{strategy}_{saved_dp}"))
    saved = pools(saved_dp).run(fc.reshard_save_case, strategy, root)[0]
    for r in pools(loaded_dp).run(fc.reshard_load_case, strategy, root, saved_dp):
        assert fc.same(r["masters"], saved)
        assert r["parts"] == r["torchao"]


@pytest.mark.parametrize("strategy", HYBRID)
def test_hybrid_sharding_agrees_over_the_shard_group(results: Any, strategy: str) -> None:
    """Two replicas of a shard group (num_distributed_optimizer_instances=2): the amax
    all-reduce runs over the shard group only (replicas hold equal masters); every rank's bytes
    and scales are equal and torchao's cast of the master; training within the bound."""
    per_rank = _one(results, f"hybrid_{strategy}")
    for r in per_rank:
        assert r["parts"] == per_rank[0]["parts"]
        assert r["parts"] == r["torchao"]
        assert r["master_diff"] < TRAJECTORY_BOUND


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_auto_bucket_rebuild_moves_the_fp8_part(results: Any, strategy: str) -> None:
    """bucket_size="auto" is accepted; the re-plan's rebuild moves each FP8 param's bytes, scale
    and fp32 master to the new buffers: training then equals a model on the new boundaries from
    the start, bitwise."""
    for r in _one(results, f"auto_{strategy}"):
        assert r == {"moved": True, "parts_bitwise": True, "masters_bitwise": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offload_restore_is_bitwise(results: Any, strategy: str) -> None:
    """offload releases the FP8 bytes, scales and fp32 masters; restore brings them back
    bitwise, and the next step equals that of a model never offloaded."""
    for r in _one(results, f"offload_{strategy}"):
        assert r == {"released": True, "restored_bitwise": True, "step_bitwise": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_export_weights_bytes_or_dequantized(results: Any, strategy: str) -> None:
    """export_weights(fp8="bytes"): each FP8 weight's float8 bytes and its scale (`<name>_scale`),
    bitwise what forward reads; fp8="dequantized" with dtype=bf16: bytes / scale in bf16."""
    for r in _one(results, f"export_{strategy}"):
        assert r == {
            "bytes": True,
            "dequantized": True,
            "dtypes": ("torch.float8_e4m3fn", "torch.bfloat16"),
            "names": True,
        }


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_expert_parallel_fp8_weights(results: Any, strategy: str) -> None:
    """Expert-parallel FP8 weights live in expert buffers; their amaxes are agreed over the
    expert shard group (the dense ones' over the dense group): every rank's bytes and scales are
    torchao's cast of its full master, dense bytes equal everywhere, experts differ per ep rank."""
    for r in _one(results, f"expert_{strategy}"):
        assert r == {
            "bytes_are_casts": True,
            "dense_equal": True,
            "experts_differ": True,
            "expert_buffers": 1,
        }


@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_not_yet_supported_is_refused_by_name(results: Any, kind: str) -> None:
    """Publisher refuses FP8 params by name, naming the param and
    docs/fp8.md: never a silent wrong result."""
    for message in _one(results, f"unsupported_{kind}"):
        assert UNSUPPORTED[kind] in message, message
        assert "docs/fp8.md" in message


def test_inspect_shows_fp8_buffers() -> None:
    """`megabuf inspect` of a converted model shows its FP8 buffer by name."""
    from megabuf.inspect import format_inspection, inspect_model

    cfg = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim", bucket_size=3000
    )
    text = format_inspection(inspect_model(fc.build_net(), cfg, dp_size=2))
    assert "param fp8 (uint8 bytes + an fp32 scale each), grad float32): 2 params" in text
