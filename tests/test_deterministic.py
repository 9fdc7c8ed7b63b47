"""deterministic_reduction and megabuf.verify_reproducible on 4 gloo ranks ([Note: deterministic
reduction], [Note: what verify_reproducible proves]).

At dp=4 the engine's default all-reduce is NOT bucket independent: gloo's ring sums each element
in an order set by its position in the message, so the same grads reduced with another
bucket_size differ in the last bits (test_default_all_reduce_depends_on_the_bucket_size). The
default reduce-scatter on gloo is an all-to-all plus a rank-order sum and happens to be bucket
independent; forced onto the native reduce-scatter NCCL uses, it is not. Under the mode every
variant (bucket size small/large, overlap on/off, a repeat) gives bitwise the same grads, and
each bucket is bitwise a single-process emulation of the fixed-order fp32 sum."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch
from deterministic_cases import (
    TARGET,
    emulation_case,
    errors_case,
    optimizer_case,
    sweep_case,
    verify_case,
)
from dist_pool import case_result, run_each

from megabuf import DistributedDataParallelConfig
from megabuf.comm_hooks import Compress, Deterministic, build
from megabuf.optimizer.clip import NormPart, global_grad_norm
from megabuf.optimizer.exact_norm import exact_grad_norm
from megabuf.transport.collectives import Collectives

DET = {"deterministic_reduction": True}
RS = {"use_distributed_optimizer": True}
FP32_GRADS = {"grad_reduce_in_fp32": True}
NATIVE = {"native": True}  # gloo on the native reduce-scatter (NCCL's path)
AVG = {"average_in_collective": True}

MODE_SWEEPS: dict[str, tuple[Any, ...]] = {
    "on_ar_fp32": (sweep_case, "dense", "fp32", DET),
    "on_rs_fp32": (sweep_case, "dense", "fp32", {**DET, **RS}),
    "on_ar_bf16": (sweep_case, "dense", "bf16", DET),
    "on_rs_bf16": (sweep_case, "dense", "bf16", {**DET, **RS}),
    "on_ar_bf16_fp32_grads": (sweep_case, "dense", "bf16", {**DET, **FP32_GRADS}),
    "on_rs_native_avg": (sweep_case, "dense", "fp32", {**DET, **RS, **NATIVE, **AVG}),
    "on_moe_ep1_ar": (sweep_case, "moe", 1, DET),
    "on_moe_ep2_rs": (sweep_case, "moe", 2, {**DET, **RS}),
}
DEFAULT_SWEEPS: dict[str, tuple[Any, ...]] = {
    "off_ar_fp32": (sweep_case, "dense", "fp32", {}),
    "off_ar_bf16": (sweep_case, "dense", "bf16", {}),
    "off_rs_fp32": (sweep_case, "dense", "fp32", RS),
    "off_rs_native": (sweep_case, "dense", "fp32", {**RS, **NATIVE}),
}
EMULATIONS: dict[str, tuple[Any, ...]] = {
    "emu_ar_fp32": (emulation_case, "dense", "fp32", {}),
    "emu_rs_fp32": (emulation_case, "dense", "fp32", RS),
    "emu_ar_bf16": (emulation_case, "dense", "bf16", {}),
    "emu_rs_bf16": (emulation_case, "dense", "bf16", RS),
    "emu_rs_avg": (emulation_case, "dense", "fp32", {**RS, **AVG}),
    "emu_moe_ep1_ar": (emulation_case, "moe", 1, {}),
    "emu_moe_ep2_rs": (emulation_case, "moe", 2, RS),
}
CASES: dict[str, tuple[Any, ...]] = {
    **MODE_SWEEPS,
    **DEFAULT_SWEEPS,
    **EMULATIONS,
    "verify_on_ar": (verify_case, "fp32", DET),
    "verify_on_rs_bf16": (verify_case, "bf16", {**DET, **RS}),
    "verify_off_ar": (verify_case, "fp32", {}),
    "verify_noisy": (verify_case, "fp32", DET, True),
    "opt_ar": (optimizer_case, DET, 0.01),
    "opt_rs": (optimizer_case, {**DET, **RS}, 0.01),
    "opt_rs_float_norm": (optimizer_case, {**DET, **RS}, 0.01, False),
    "errors": (errors_case,),
}


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(4).run(run_each, CASES)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", sorted(MODE_SWEEPS))
def test_mode_grads_are_bitwise_across_bucket_size_overlap_and_repeats(
    results: Any, name: str
) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["same"] == [True, True, True, True], f"{name} rank {rank}: {res}"
        assert res["hooks"] == ["Deterministic"], res  # every group, dense and expert
        small, large = res["n_buckets"][0], res["n_buckets"][2]
        assert small > large, res  # the variants really differ in their buckets
        if "moe" in name:
            assert res["n_expert_buffers"] >= 1, res
    dtypes = case_result(results, name)[0]["grad_dtypes"]
    if name.endswith("bf16"):
        assert dtypes == ["torch.bfloat16"], dtypes
    elif "fp32" in name:
        assert dtypes == ["torch.float32"], dtypes


@pytest.mark.parametrize("name", ["off_ar_fp32", "off_ar_bf16", "off_rs_native"])
def test_default_reduction_depends_on_the_bucket_size(results: Any, name: str) -> None:
    """What the mode fixes: without it the same grads differ (last bits) across bucket sizes."""
    for rank, res in enumerate(case_result(results, name)):
        same = res["same"]
        assert same[0] and same[3], f"{name} rank {rank}: same buckets, same result: {res}"
        assert not (same[1] and same[2]), f"{name} rank {rank}: {res}"
        assert 0 < res["max_diff"] < 1e-3, res


def test_default_gloo_reduce_scatter_happens_to_be_bucket_independent(results: Any) -> None:
    """gloo's reduce-scatter is an all-to-all and a rank-order sum (not a promise: NCCL's
    native reduce-scatter is not, see off_rs_native)."""
    for res in case_result(results, "off_rs_fp32"):
        assert res["same"] == [True, True, True, True], res


@pytest.mark.parametrize("name", sorted(EMULATIONS))
def test_each_bucket_is_bitwise_the_rank_order_fp32_sum(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["bitwise"] and all(res["bitwise"]), f"{name} rank {rank}: {res}"
        assert len(res["bitwise"]) >= 2, res
        assert res["hooks"] == ["Capture(Deterministic)"], res  # replaced the mode's hook
        # ep=2 at dp=4: expert buckets reduce over expt_dp (2 ranks), dense over dp (4)
        assert res["group_sizes"] == ([2, 4] if "ep2" in name else [4]), res
        assert res["expert"] == ([False, True] if "moe" in name else [False]), res
        if "moe" in name:
            continue  # the MoE's token all-to-all shares the counter
        # wire: the grad dtype's ring all-reduce (all-to-all + all-gather) or reduce-scatter
        ring = res["ring_nbytes"]
        assert sum(ring.values()) == res["want_ring_nbytes"], res
        assert set(ring) == ({"all_to_all"} if "_rs_" in name else {"all_to_all", "all_gather"})
        # persistent memory: the landing zone; a padded copy in AR mode; an fp32 sum shard in AR
        # mode or for bf16 grads (an fp32 reduce-scatter sums straight into the shard)
        want = {"scratch"} | ({"wire"} if "_ar_" in name else set())
        want |= {"sum"} if ("_ar_" in name or "bf16" in name) else set()
        assert set(res["workspaces"]) == want, res


@pytest.mark.parametrize("name", ["verify_on_ar", "verify_on_rs_bf16"])
def test_verify_reproducible_reports_identical_under_the_mode(results: Any, name: str) -> None:
    for res in case_result(results, name):
        assert res["identical"], res["text"]
        assert len(res["variants"]) == 4, res
        assert "bitwise identical" in res["text"], res["text"]


def test_verify_reproducible_finds_the_default_all_reduce_bucket_dependence(
    results: Any,
) -> None:
    for res in case_result(results, "verify_off_ar"):
        assert not res["identical"], res["text"]
        assert res["variants"]["repeat"][0], res  # a repeat is identical
        differing = [v for v in res["variants"].values() if not v[0]]
        assert all(v[1] is not None and v[2] is not None and v[3] > 0 for v in differing), res


def test_verify_reproducible_names_the_param_a_noisy_hook_changes(results: Any) -> None:
    for res in case_result(results, "verify_noisy"):
        variants = res["variants"]
        assert variants["repeat"] == (True, None, None, 0.0), res
        small = next(v for name, v in variants.items() if name.startswith("bucket_size="))
        identical, param, rank, diff = small
        assert not identical and param == TARGET and rank == 0 and diff > 0, res
        cls, message = res["raised"]
        assert cls == "ReproducibilityError", res
        assert TARGET in message and "on rank 0" in message, message


@pytest.mark.parametrize("name", ["opt_ar", "opt_rs"])
def test_clipped_optimizer_steps_are_bitwise(results: Any, name: str) -> None:
    """Mode + Adam with clip_grad (FP32Optimizer; DistributedOptimizer, whose shard ranges move
    with bucket_size): grad norms and params after 2 clipped steps are bitwise across bucket
    size, overlap and a repeat ([Note: exact grad norm])."""
    for res in case_result(results, name):
        assert res["clipped"], res
        assert res["norms_same"] == [True] * 4 and res["params_same"] == [True] * 4, res


def test_without_the_exact_norm_the_distributed_optimizer_differs(results: Any) -> None:
    """Why the exact norm: the distributed optimizer's ordinary norm sums shard pieces, so with
    the mode's bitwise grads but that norm, clipped params differ across bucket sizes."""
    for res in case_result(results, "opt_rs_float_norm"):
        assert res["clipped"], res
        assert res["norms_same"][0] and res["norms_same"][3], res  # overlap, repeat
        assert not all(res["norms_same"]) and not all(res["params_same"]), res


ERRORS = {
    "reduce_hook": ("DeterministicReductionError", "does not declare `deterministic = True`"),
    "wire_from_config": ("DeterministicReductionError", "deterministic_reduction=True"),
    "twice": ("CommHookRegistrationError", "already registered for the dense buffers"),
    "bad_steps": ("ValueError", "steps must be >= 1"),
}


@pytest.mark.parametrize("what", sorted(ERRORS))
def test_named_errors(results: Any, what: str) -> None:
    cls, text = ERRORS[what]
    for rank, res in enumerate(case_result(results, "errors")):
        got = res[what]
        assert got is not None, f"{what}: nothing raised on rank {rank}"
        assert got[0] == cls and text in got[1], got
        if what != "bad_steps":
            assert f"rank {rank}" in got[1], got


def test_a_deterministic_hook_from_the_config_stands_in_for_the_mode(results: Any) -> None:
    for res in case_result(results, "errors"):
        assert res["allowed_hooks"] == ["Compress(bfloat16, fp32)"], res
        assert res["installed"] == ["Deterministic"], res


# ---- without processes ---------------------------------------------------------------------------
def test_config_field_and_toml(tmp_path: Any) -> None:
    assert DistributedDataParallelConfig().deterministic_reduction is False
    assert "deterministic_reduction = False" in (DistributedDataParallelConfig.__doc__ or "")
    path = tmp_path / "det.toml"
    path.write_text("[ddp]\ndeterministic_reduction = true\nbucket_size = 1000\n")
    assert DistributedDataParallelConfig.from_toml(path).deterministic_reduction is True


def test_which_hooks_declare_determinism() -> None:
    assert isinstance(build({"name": "deterministic"}), Deterministic)
    assert Deterministic.deterministic is True
    assert Compress(torch.bfloat16, "fp32").deterministic is True
    assert Compress(torch.bfloat16, "wire").deterministic is False


def test_exact_grad_norm_is_exact_and_split_independent() -> None:
    torch.manual_seed(0)
    g = torch.randn(10_007) * torch.logspace(-20, 10, 10_007)  # 30 decades of magnitudes
    coll = Collectives()
    whole = exact_grad_norm([NormPart([g], ())], coll)
    pieces = [NormPart([g[7000:], g[:3000]], ()), NormPart([g[3000:7000]], ())]
    assert exact_grad_norm(pieces, coll) == whole  # bitwise, any split and order
    exact_sum = sum(Fraction(v) ** 2 for v in g.double().tolist())
    assert whole == math.sqrt(float(exact_sum))  # the exact sum, rounded once
    assert global_grad_norm([NormPart([g], ())], coll) != whole  # the fp32 sum is not
    half = g[:5000].bfloat16()
    assert exact_grad_norm([NormPart([half], ())], coll) == pytest.approx(
        torch.linalg.vector_norm(half.double()).item(), rel=1e-15
    )
    one_inf, nan = torch.tensor([1.0, float("inf")]), torch.tensor([float("nan"), float("inf")])
    assert exact_grad_norm([NormPart([one_inf], ())], coll) == float("inf")
    assert math.isnan(exact_grad_norm([NormPart([nan], ())], coll))
    assert exact_grad_norm([NormPart([torch.zeros(3)], ())], coll) == 0.0


# ---- GPU tier ------------------------------------------------------------------------------------
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(
    GPUS < 2,
    reason=f"needs >= 2 CUDA devices for an NCCL group ({GPUS} on this machine); at dp=2 a sum "
    "is order independent, so >= 3 says more",
)
def test_nccl_mode_is_bitwise_across_bucket_size_and_overlap(pools: Any) -> None:
    world = min(GPUS, 4)
    cases = {
        "ar": (sweep_case, "dense", "fp32", DET),
        "rs_bf16": (sweep_case, "dense", "bf16", {**DET, **RS}),
        "emu_ar": (emulation_case, "dense", "fp32", {}),
        "emu_rs_bf16": (emulation_case, "dense", "bf16", RS),
    }
    results = pools(world, "nccl").run(run_each, cases)
    for name in ("ar", "rs_bf16"):
        for res in case_result(results, name):
            assert res["same"] == [True] * 4 and res["hooks"] == ["Deterministic"], res
    for name in ("emu_ar", "emu_rs_bf16"):
        for res in case_result(results, name):
            assert all(res["bitwise"]) and res["group_sizes"] == [world], res
