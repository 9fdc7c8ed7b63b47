"""Distributed and non-distributed megabuf optimizers against a single-process torch optimizer on
the global batch (gloo ranks, dp 1/2/4), overlap_param_gather on/off bitwise equality, clipping,
dynamic loss scaling, exact per-rank byte counts and error messages."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from dist_pool import case_result, run_each
from optimizer_cases import (
    MISUSES,
    equality_case,
    memory_case,
    misuse_error,
    overlap_case,
    scaler_case,
)

FP32_ATOL = 1e-6
# bf16 params (fp32 main params and grads) are checked element by element against a reference
# doing the same bf16 arithmetic: fp32 masters within a few fp32 roundings per step, bf16 params
# within one bf16 ulp ([Note: bf16 optimizer bound] in optimizer_cases.py). bf16 Adam cases keep
# eps=1e-4 from the global-batch reference they used to have.
NORM_RTOL = 1e-5

DISTOPT = {"use_distributed_optimizer": True}
OVERLAP = {**DISTOPT, "overlap_grad_reduce": True, "bucket_size": 50}
BF16_DDP = {"grad_reduce_in_fp32": True}
EQUAL: dict[str, dict[str, Any]] = {
    "distopt_adam_fp32": {"optimizer": "adam", "ddp": {**DISTOPT, "bucket_size": 100}},
    "distopt_adamw_fp32_overlap": {"optimizer": "adamw", "ddp": OVERLAP},
    "distopt_sgd_fp32": {"optimizer": "sgd", "ddp": {**OVERLAP, "bucket_size": 100}},
    "distopt_adam_clip": {"optimizer": "adam", "clip": 0.05, "ddp": DISTOPT},
    "distopt_builder_adamw_clip": {
        "optimizer": "adamw",
        "clip": 0.05,
        "builder": True,
        "ddp": OVERLAP,
    },
    "distopt_adamw_bf16": {
        "optimizer": "adamw",
        "bf16": True,
        "eps": 1e-4,
        "ddp": {**OVERLAP, **BF16_DDP},
    },
    "distopt_sgd_bf16": {"optimizer": "sgd", "bf16": True, "ddp": {**DISTOPT, **BF16_DDP}},
    "distopt_adam_bf16_builder": {
        "optimizer": "adam",
        "bf16": True,
        "eps": 1e-4,
        "builder": True,
        "ddp": {**DISTOPT, **BF16_DDP, "bucket_size": 100},
    },
    "mixed_adam_fp32": {
        "optimizer": "adam",
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 50},
    },
    "mixed_sgd_fp32_clip": {"optimizer": "sgd", "clip": 0.05, "builder": True, "ddp": {}},
    "distopt_dense_and_expert_clip": {
        "optimizer": "adamw",
        "clip": 0.05,
        "expert": True,
        "ddp": OVERLAP,
    },
    "mixed_dense_and_expert_clip": {"optimizer": "adam", "clip": 0.05, "expert": True, "ddp": {}},
    "mixed_adamw_bf16": {"optimizer": "adamw", "bf16": True, "eps": 1e-4, "ddp": BF16_DDP},
}
OVERLAP_CASES: dict[str, dict[str, Any]] = {
    "overlap_registration_order": {
        "model": "net",
        "optimizer": "adamw",
        "clip": 0.5,
        "ddp": OVERLAP,
    },
    "overlap_permuted_forward": {"model": "permuted", "ddp": OVERLAP},
    "overlap_parent_reads_child_param": {
        "model": "parent_reads",
        "optimizer": "sgd",
        "ddp": OVERLAP,
    },
    "overlap_sibling_reads_param_before_its_forward": {
        "model": "sibling_reads",
        "optimizer": "sgd",
        "ddp": OVERLAP,
    },
    "overlap_bf16": {
        "model": "permuted",
        "bf16": True,
        "eps": 1e-4,
        "ddp": {**OVERLAP, **BF16_DDP},
    },
}
# gloo forced onto NCCL's strategy (native reduce-scatter and all-gather, emulated AVG), same
# references: reduce-scatter, grad-reduce overlap, average_in_collective, overlap_param_gather.
NATIVE_EQUAL = {
    f"native_{name}": {**EQUAL[name], "native": True}
    for name in ["distopt_adam_fp32", "distopt_adamw_fp32_overlap", "distopt_adamw_bf16"]
}
NATIVE_EQUAL["native_distopt_adam_avg"] = {
    "optimizer": "adam",
    "native": True,
    "ddp": {**OVERLAP, "average_in_collective": True},
}
EQUAL.update(NATIVE_EQUAL)
OVERLAP_CASES.update(
    {
        f"native_{name}": {**OVERLAP_CASES[name], "native": True}
        for name in ["overlap_registration_order", "overlap_bf16"]
    }
)
SCALER = {"initial_scale": 1024.0, "hysteresis": 1, "growth_interval": 2}
SCALER_CASES: dict[str, dict[str, Any]] = {
    "scaler_distopt": {"steps": 6, "poison_step": 2, "scaler": SCALER, "ddp": DISTOPT},
    "scaler_mixed": {"steps": 6, "poison_step": 2, "scaler": SCALER, "ddp": {}},
}
FP16_SCALER = {"initial_scale": 2.0**20, "hysteresis": 1, "growth_interval": 1000}
FP16_CASES: dict[str, dict[str, Any]] = {  # fp16 params and grads: overflow at the start
    "fp16_distopt": {"fp16": True, "steps": 10, "eps": 1e-4, "scaler": FP16_SCALER, "ddp": DISTOPT},
    "fp16_mixed": {"fp16": True, "steps": 10, "eps": 1e-4, "scaler": FP16_SCALER, "ddp": {}},
}
FP16_ULPS = 2 * 2.0**-10
MEMORY_CASES: dict[str, dict[str, Any]] = {
    "memory_bf16": {"bf16": True, "ddp": {**DISTOPT, **BF16_DDP, "bucket_size": 100}},
    "memory_fp32": {"ddp": {**DISTOPT, "bucket_size": 100}},
}


KINDS: list[tuple[Callable[[dict[str, Any]], Any], dict[str, dict[str, Any]]]] = [
    (equality_case, EQUAL),
    (overlap_case, OVERLAP_CASES),
    (scaler_case, SCALER_CASES),
    (scaler_case, FP16_CASES),
    (memory_case, MEMORY_CASES),
]


def all_cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {}
    for fn, group in KINDS:
        cases.update({name: (fn, case) for name, case in group.items()})
    cases.update({label: (misuse_error, label) for label in MISUSES})
    return cases


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda ws: f"dp{ws}")
def results(request: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    return request.param, pools(request.param).run(run_each, all_cases())


def _worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda kv: kv[1])


def _check_params(case: dict[str, Any], res: dict[str, Any], where: str) -> None:
    """fp32: every param within FP32_ATOL of the reference. bf16: every fp32 master element
    within its bound and every bf16 param within one ulp ([Note: bf16 optimizer bound]). And the
    case ran the collective strategy it names (native_*: NCCL's, on gloo)."""
    want = ("native", "native") if case.get("native") else ("all_to_all", "p2p")
    assert res["strategy"] == want, f"{where}: ran the {res['strategy']} strategy"
    if not case.get("bf16"):
        worst = _worst(res["errors"])
        assert worst[1] <= FP32_ATOL, f"{where}: {worst} > {FP32_ATOL:.3g}"
        return
    name, (err, ratio) = max(res["masters"].items(), key=lambda kv: kv[1][1])
    assert ratio <= 1.0, f"{where}: master of {name} off by {err:.3g}, {ratio:.3g}x its bound"
    worst = _worst(res["ulps"])
    assert worst[1] <= 1.0, f"{where}: bf16 param {worst[0]} off by {worst[1]:.3g} ulps"


@pytest.mark.parametrize("name", EQUAL)
def test_params_match_single_process_torch_optimizer(results: Any, name: str) -> None:
    """Adam/AdamW/SGD-momentum, fp32 and bf16, two param groups with different lr/wd, with and
    without clipping: params after 3 steps equal torch's on the global batch."""
    world_size, per_rank = results
    case = EQUAL[name]
    for rank, res in enumerate(case_result(per_rank, name)):
        _check_params(case, res, f"dp={world_size} rank {rank} {name}")


@pytest.mark.parametrize("name", EQUAL)
def test_grad_norm_and_zero_count_match_torch(results: Any, name: str) -> None:
    """The returned global grad norm equals clip_grad_norm_'s on the reference; num_zeros equals
    the reference's count of zero grad elements (the `dead` param, counted once over ranks)."""
    world_size, per_rank = results
    for res in case_result(per_rank, name):
        for got, want in res["norms"]:
            assert got == pytest.approx(want, rel=NORM_RTOL), (world_size, name)
        assert all(got == want for got, want in res["zeros"]), (world_size, name, res["zeros"])


@pytest.mark.parametrize(
    ("name", "domains"),
    [
        ("distopt_dense_and_expert_clip", ["dense", "expert"]),
        ("mixed_dense_and_expert_clip", ["dense", "expert"]),
        ("distopt_adam_fp32", ["dense"]),
    ],
)
def test_dense_and_expert_params_step_under_one_norm(
    results: Any, name: str, domains: list[str]
) -> None:
    """Params marked expert-parallel get their own inner optimizer; the clipped result still
    equals torch's clip_grad_norm_ over all params (checked in the two tests above)."""
    _, per_rank = results
    assert case_result(per_rank, name)[0]["domains"] == domains, name


@pytest.mark.parametrize("name", OVERLAP_CASES)
def test_overlap_param_gather_is_bitwise_equal_and_in_flight(results: Any, name: str) -> None:
    """overlap_param_gather on/off give bitwise equal params after 4 steps, also when the forward
    order is a permutation of registration order and when a parent reads a child's param
    directly (F.linear, ParameterList); with it on, step() returns with every group's gather
    dispatched and not waited for ([Note: publishing params])."""
    world_size, per_rank = results
    case = OVERLAP_CASES[name]
    for rank, out in enumerate(case_result(per_rank, name)):
        assert out["bitwise"], f"dp={world_size} rank {rank} {name}: on != off"
        assert out["in_flight"], f"{name}: step() did not leave every gather in flight"
        _check_params(case, out, f"dp={world_size} rank {rank} {name} vs reference")


@pytest.mark.parametrize("name", SCALER_CASES)
def test_dynamic_loss_scaling_skips_inf_steps_and_recovers(results: Any, name: str) -> None:
    """An inf in one rank's own grad shard skips the step on every rank; the scale halves, then
    grows again after `growth_interval` good steps; params equal a reference without that step."""
    world_size, per_rank = results
    for out in case_result(per_rank, name):
        assert out["oks"] == [True, True, False, True, True, True], (world_size, name)
        assert out["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0, 2048.0], name
        assert _worst(out["errors"])[1] <= FP32_ATOL, (world_size, name, out["errors"])


@pytest.mark.parametrize("name", FP16_CASES)
def test_fp16_overflow_backs_off_until_steps_succeed(results: Any, name: str) -> None:
    """fp16 params with a too-large initial scale: the first steps overflow in fp16 and are skipped
    on every rank, the scale halves each time, then training proceeds and matches a torch
    mixed-precision reference that took the same steps (2 fp16 ulps)."""
    world_size, per_rank = results
    outs = case_result(per_rank, name)
    for out in outs:
        assert not out["oks"][0] and all(out["oks"][-3:]), (world_size, name, out["oks"])
        assert out["scales"][-1] < FP16_SCALER["initial_scale"]
        worst = _worst(out["errors"])
        assert worst[1] <= FP16_ULPS * out["scale"], (world_size, name, worst)
    if world_size > 1:  # every rank skipped the same steps (each saw its own slice's overflow)
        assert len({tuple(out["oks"]) for out in outs}) == 1, [out["oks"] for out in outs]


@pytest.mark.parametrize("name", MEMORY_CASES)
def test_per_rank_optimizer_bytes_are_exact(results: Any, name: str) -> None:
    """Adam: 8 state bytes per owned element (+ 4 for an fp32 main copy of bf16 params, 0 for fp32
    params whose buffer is stepped in place); every rank's shard (owned + padding, the report's
    padding being the difference) is 1/dp of the padded buffers; the ranks' owned elements and
    state add up to exactly the unsharded params and torch optimizer's state."""
    world_size, per_rank = results
    outs = case_result(per_rank, name)
    reports = [res["report"] for res in outs]
    first = outs[0]
    main_bytes_per_elem = 4 if name == "memory_bf16" else 0
    for rep in reports:
        assert rep.state_nbytes == 8 * rep.owned_numel, (name, rep)
        assert rep.main_param_nbytes == main_bytes_per_elem * rep.owned_numel, (name, rep)
        assert rep.shard_numel == first["numel_padded"] // world_size, (name, rep)
        assert rep.optimizer_nbytes <= (8 + main_bytes_per_elem + 4) * rep.shard_numel
    assert sum(r.owned_numel for r in reports) == first["numel_unpadded"], name
    assert sum(r.state_nbytes for r in reports) == first["ref_state_nbytes"], name


MISUSE_MESSAGES = {
    "distopt_on_plain_ddp": ["use_distributed_optimizer=True"],
    "mixed_on_distopt": ["DistributedOptimizer"],
    "param_in_no_group": ["in no param group", "embed.weight"],
    "fp32_optimizer_bf16": ["FP32Optimizer needs fp32 params"],
}


@pytest.mark.parametrize("label", MISUSES)
def test_misuse_raises_clear_errors(results: Any, label: str) -> None:
    _, per_rank = results
    for rank, message in enumerate(case_result(per_rank, label)):
        for part in MISUSE_MESSAGES[label]:
            assert part in message, (label, rank, message)
