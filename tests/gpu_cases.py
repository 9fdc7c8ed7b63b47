"""The device-parametrised sweeps of the GPU tier (tests/test_gpu_tier.py) and their checks.

The rank-side cases are the suite's own (grad_cases, optimizer_cases, pipeline_cases, moe_cases)
with a "device" key ([Note: race windows] and `case_device` in case_devices.py); this module
builds the sweeps for a device, adds the rank side of the checkpoint round trip across devices
(saved on one device, loaded on another), and holds the test-side checks, so the same code runs
on CPU in the normal suite (tests/test_device_cases.py) and on CUDA in the GPU tier.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from case_devices import case_device
from checkpoint_cases import SAVE_AFTER, TOTAL_STEPS, VARIANTS
from dist_pool import case_result, run_each
from grad_cases import grad_case
from moe_cases import grads_case
from optimizer_cases import build_model, build_opt, equality_case, overlap_case, train_step
from pipeline_cases import pipeline_case

import megabuf
from megabuf.checkpoint import wait_for_pending_save

FP32_ATOL = 1e-6  # as tests/test_optimizer_distributed.py and tests/test_ddp_grads.py
NORM_RTOL = 1e-5
CROSS_DEVICE_ATOL = 1e-5  # fp32 Adam continued on another device's kernels: roundoff only
SLEEP_CYCLES = 50_000_000  # ~25-50 ms of GPU clock per window ([Note: race windows])

# ---- rank side ---------------------------------------------------------------------------------


def env_probe(names: list[str]) -> dict[str, Any]:
    """This rank's view of the environment variables `names` and its CUDA binding."""
    return {
        "env": {n: os.environ.get(n) for n in names},
        "backend": dist.get_backend_config(),
        "cuda_device": torch.cuda.current_device() if torch.cuda.is_available() else None,
    }


def _params_cpu(model: megabuf.DistributedDataParallel) -> dict[str, torch.Tensor]:
    """The params by name (collective under ZeRO-3, whose state_dict() gathers them)."""
    names = [n for n, _ in model.module.named_parameters()]
    state = model.state_dict()
    return {n: state[n].detach().float().cpu().clone() for n in names}


def _train(model: Any, opt: Any, steps: range, case: dict[str, Any]) -> None:
    for step in steps:
        ok, _, _ = train_step(model, opt, step, case=case)
        if not ok:
            raise RuntimeError(f"step {step} was skipped on {case_device(case)}")


def save_on_device(root: str, name: str, device: str) -> dict[str, Any]:
    """Train VARIANTS[name] SAVE_AFTER steps on `device`, save, then continue to TOTAL_STEPS."""
    case = {**VARIANTS[name], "device": device}
    model = build_model(case)
    opt = build_opt(model, case)
    _train(model, opt, range(SAVE_AFTER), case)
    megabuf.save_checkpoint(os.path.join(root, name), model, opt, async_save=case.get("async"))
    at_save = _params_cpu(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS), case)  # while an async save is written
    wait_for_pending_save()  # the loading ranks are other processes
    return {"at_save": at_save, "final": _params_cpu(model), "device": str(case_device(case))}


def load_on_device(root: str, name: str, device: str) -> dict[str, Any]:
    """Load the checkpoint of VARIANTS[name] into a fresh model on `device`, continue to
    TOTAL_STEPS."""
    case = {**VARIANTS[name], "device": device}
    model = build_model(case)
    opt = build_opt(model, case)
    megabuf.load_checkpoint(os.path.join(root, name), model, opt)
    loaded = _params_cpu(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS), case)
    return {"loaded": loaded, "final": _params_cpu(model), "device": str(case_device(case))}


# ---- sweeps (test side) ------------------------------------------------------------------------
Sweep = dict[str, tuple[Any, ...]]


def _on(device: str, cases: dict[str, dict[str, Any]], **extra: Any) -> dict[str, dict[str, Any]]:
    """The suite's cases on `device`, without the `native_*` ones (they force gloo's CPU path
    onto NCCL's strategy, which a real NCCL or CUDA tensor already takes)."""
    return {n: {**c, **extra, "device": device} for n, c in cases.items() if not c.get("native")}


def _distopt(case: dict[str, Any]) -> bool:
    ddp = case.get("config", case.get("ddp", {}))
    return bool(ddp.get("use_distributed_optimizer"))


def rank_cases(device: str, world_size: int, *, allreduce_only: bool) -> dict[str, Any]:
    """{name: (kind, case)} of the suite's rank-side cases that fit `world_size` ranks on
    `device`; `allreduce_only` drops the distributed optimizer, pipelines and experts (gloo on
    CUDA runs all-reduce and broadcast, not all-to-all or point-to-point)."""
    from test_ddp_grads import BASE_CASES
    from test_moe import GRAD_CASES as MOE_CASES
    from test_optimizer_distributed import EQUAL, OVERLAP_CASES
    from test_pipeline import CASES as PIPELINE_CASES
    from test_pipeline import DISTOPT_OVERLAP
    from test_pipeline import OVERLAP as PIPE_OVERLAP

    one_stage = {
        "one_stage_sync": {"pp": 1},
        "one_stage_overlap_per_token_loss": {"pp": 1, "config": PIPE_OVERLAP, "per_token": True},
        "one_stage_distopt_overlap": {"pp": 1, "config": DISTOPT_OVERLAP},
    }
    kinds: dict[str, tuple[str, dict[str, dict[str, Any]]]] = {
        "grad": ("grad", _on(device, BASE_CASES)),
        "equal": ("equal", _on(device, EQUAL)),
        "overlap": ("overlap", _on(device, OVERLAP_CASES)),
        "pipeline": ("pipeline", _on(device, one_stage)),
        "moe": ("moe", _on(device, {"ep1_per_token_loss": {"ep": 1, "per_token": True}})),
    }
    if world_size == 2:
        pipelined = {n: c for n, c in PIPELINE_CASES.items() if c["pp"] == 2}
        kinds["pipeline"] = ("pipeline", _on(device, {**one_stage, **pipelined}))
        kinds["moe"] = ("moe", _on(device, {n: c for n, c in MOE_CASES.items() if c["ep"] <= 2}))
    out: dict[str, Any] = {}
    for kind, cases in kinds.values():
        for name, case in cases.items():
            if allreduce_only and (_distopt(case) or kind in ("pipeline", "moe")):
                continue
            out[f"{kind}:{name}"] = (kind, case)
    return out


FUNCS = {
    "grad": grad_case,
    "equal": equality_case,
    "overlap": overlap_case,
    "pipeline": pipeline_case,
    "moe": grads_case,
}


def sweep(cases: dict[str, Any]) -> Sweep:
    return {name: (FUNCS[kind], case) for name, (kind, case) in cases.items()}


def race_cases(device: str, *, allreduce_only: bool) -> dict[str, Any]:
    """Cases with both race windows open ([Note: race windows]), keeping their results."""
    sleep = {"sleep_cycles": {"finish_grad_sync": SLEEP_CYCLES, "step": SLEEP_CYCLES}}
    overlap = {"overlap_grad_reduce": True, "bucket_size": 50}
    cases: dict[str, Any] = {
        "race:grad_overlap": ("grad", {"config": overlap, "keep_grads": True}),
        "race:mixed_adam": ("equal", {"optimizer": "adam", "ddp": overlap, "keep_params": True}),
        "race:distopt_overlap_param_gather": (
            "overlap",
            {
                "optimizer": "adamw",
                "ddp": {**overlap, "use_distributed_optimizer": True},
                "keep_params": True,
            },
        ),
    }
    out = {n: (k, {**c, **sleep, "device": device}) for n, (k, c) in cases.items()}
    if allreduce_only:
        out.pop("race:distopt_overlap_param_gather")
    return out


# ---- checks (test side) ------------------------------------------------------------------------


def check(kind: str, case: dict[str, Any], per_rank: list[Any], where: str, rs: str) -> None:
    """The assertions of the suite's CPU tests for one case, on any device; `rs` is the
    reduce-scatter strategy the run must have taken."""
    {
        "grad": _check_grad, "equal": _check_equal, "overlap": _check_overlap,
        "pipeline": _check_errors, "moe": _check_errors,
    }[kind](case, per_rank, where, rs)  # fmt: skip


def _check_grad(case: dict[str, Any], per_rank: list[Any], where: str, rs: str) -> None:
    for rank, res in enumerate(per_rank):
        worst = max(res["ratios"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        assert worst[1] <= 1.0, f"{where} rank {rank}: {worst[0]} {worst[1]:.3g}x its bound"
        assert res["linked"], f"{where}: param.grad is not main_grad (None with distopt)"
        assert res["reduce_scatter"] == rs, f"{where}: ran {res['reduce_scatter']}"
        assert res["device"].startswith(case["device"]), f"{where}: grads on {res['device']}"
    checked = set().union(*(res["errors"] for res in per_rank))
    assert checked == set(per_rank[0]["all_params"]), where


def _check_params(case: dict[str, Any], res: dict[str, Any], where: str, rs: str) -> None:
    assert res["strategy"][0] == rs, f"{where}: ran the {res['strategy']} strategy"
    if not case.get("bf16"):
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= FP32_ATOL, f"{where}: {worst} > {FP32_ATOL:.3g}"
        return
    name, (err, ratio) = max(res["masters"].items(), key=lambda kv: kv[1][1])
    assert ratio <= 1.0, f"{where}: master of {name} off by {err:.3g}, {ratio:.3g}x its bound"
    worst = max(res["ulps"].items(), key=lambda kv: kv[1])
    assert worst[1] <= 1.0, f"{where}: bf16 param {worst[0]} off by {worst[1]:.3g} ulps"


def _check_equal(case: dict[str, Any], per_rank: list[Any], where: str, rs: str) -> None:
    for rank, res in enumerate(per_rank):
        _check_params(case, res, f"{where} rank {rank}", rs)
        for got, want in res["norms"]:
            assert abs(got - want) <= NORM_RTOL * abs(want), (where, rank, got, want)
        assert all(got == want for got, want in res["zeros"]), (where, rank, res["zeros"])


def _check_overlap(case: dict[str, Any], per_rank: list[Any], where: str, rs: str) -> None:
    for rank, res in enumerate(per_rank):
        assert res["bitwise"], f"{where} rank {rank}: overlap_param_gather on != off"
        assert res["in_flight"], f"{where}: step() did not leave every gather in flight"
        _check_params(case, res, f"{where} rank {rank}", rs)


def _check_errors(case: dict[str, Any], per_rank: list[Any], where: str, rs: str) -> None:
    """Pipeline and expert cases: every param (grad) within 2e-6 of the one-process model's."""
    for rank, res in enumerate(per_rank):
        worst = max(res["errors"].items(), key=lambda kv: kv[1], default=("-", 0.0))
        assert worst[1] <= 2e-6, f"{where} rank {rank}: {worst[0]} off by {worst[1]:.3g}"


def check_sweep(cases: dict[str, Any], results: list[Any], label: str, rs: str) -> None:
    """Every case of a `sweep` run: pytest.fail with the first case's traceback, else its
    checks; all cases are checked before the first failure is raised."""
    failures = []
    for name, (kind, case) in cases.items():
        try:
            check(kind, case, case_result(results, name), f"{label} {name}", rs)
        except (AssertionError, pytest.fail.Exception) as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, f"{len(failures)} of {len(cases)} cases failed:\n" + "\n".join(failures)


def kept(res: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The grads or params a race case kept."""
    return res.get("main_grads") or res["final"]


LAUNCH_BLOCKING = {"CUDA_LAUNCH_BLOCKING": "1"}


def race_windows_match_launch_blocking(
    get_pool: Any, world_size: int, backend: str, device: str, *, allreduce_only: bool
) -> None:
    """[Note: race windows]: the race cases with the windows open, once as usual and once with
    CUDA_LAUNCH_BLOCKING=1 in the ranks' environment: each within its reference bound, and the
    two runs' grads and params bitwise equal."""
    cases = race_cases(device, allreduce_only=allreduce_only)
    rs = "all_to_all" if (backend, device) == ("gloo", "cpu") else "native"
    runs = []
    for env in ({}, LAUNCH_BLOCKING):
        pool = get_pool(world_size, backend, env or None)
        probe = pool.run(env_probe, ["CUDA_LAUNCH_BLOCKING"])
        assert [p["env"]["CUDA_LAUNCH_BLOCKING"] for p in probe] == [env.get(
            "CUDA_LAUNCH_BLOCKING")] * world_size, probe  # fmt: skip
        results = pool.run(run_each, sweep(cases))
        check_sweep(cases, results, f"{backend} x{world_size} env={env}", rs)
        runs.append({name: [kept(r) for r in case_result(results, name)] for name in cases})
    for name in cases:
        for rank, (plain, blocking) in enumerate(zip(*(run[name] for run in runs), strict=True)):
            differ = [k for k in plain if not torch.equal(plain[k], blocking[k])]
            assert not differ, f"{name} rank {rank}: differ under CUDA_LAUNCH_BLOCKING: {differ}"


def checkpoint_crosses_devices(
    save_pool: Any, save_device: str, load_pool: Any, load_device: str, root: str
) -> None:
    """Save every checkpoint variant on `save_device`, load it on `load_device` (other
    processes): the loaded params equal the saved ones bitwise; fp32 training continued after
    the load stays within CROSS_DEVICE_ATOL of the run that never stopped."""
    saved = save_pool.run(run_each, {n: (save_on_device, root, n, save_device) for n in VARIANTS})
    loaded = load_pool.run(run_each, {n: (load_on_device, root, n, load_device) for n in VARIANTS})
    for name in VARIANTS:
        at_save = case_result(saved, name)[0]
        assert at_save["device"].startswith(save_device), at_save["device"]
        for rank, res in enumerate(case_result(loaded, name)):
            assert res["device"].startswith(load_device), res["device"]
            differ = [
                k for k, v in at_save["at_save"].items() if not torch.equal(v, res["loaded"][k])
            ]
            assert not differ, f"{name} rank {rank}: loaded params differ from saved: {differ}"
            if VARIANTS[name].get("bf16"):
                continue  # bf16 kernels of two devices round differently: bounds per step
            worst = max(
                (res["final"][k] - v).abs().max().item() for k, v in at_save["final"].items()
            )
            assert worst <= CROSS_DEVICE_ATOL, f"{name} rank {rank}: continued run off by {worst}"
