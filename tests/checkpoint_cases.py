"""Rank-side code for the checkpoint tests: save at one dp size, resume at another."""

from __future__ import annotations

import os
from typing import Any

import torch
from optimizer_cases import build_model, build_opt, train_step

import megabuf

SAVE_AFTER = 3  # steps 0..2 before the checkpoint
TOTAL_STEPS = 8  # then 5 more

VARIANTS: dict[str, dict[str, Any]] = {
    "fp32_adam": {
        "optimizer": "adam",
        "ddp": {
            "use_distributed_optimizer": True,
            "overlap_param_gather": True,
            "bucket_size": 100,
        },
    },
    "bf16_adamw": {
        "optimizer": "adamw",
        "bf16": True,
        "eps": 1e-4,
        "ddp": {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "bucket_size": 60},
    },
    "mixed_bf16_sgd": {  # non-distributed MixedPrecisionOptimizer: dp rank 0 writes whole params
        "optimizer": "sgd",
        "bf16": True,
        "ddp": {"grad_reduce_in_fp32": True, "overlap_grad_reduce": True, "bucket_size": 80},
    },
}


def final_params(model: megabuf.DistributedDataParallel) -> dict[str, torch.Tensor]:
    model.publish_params()
    return {n: p.detach().float().clone() for n, p in model.module.named_parameters()}


def _train(model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        ok, _, _ = train_step(model, opt, step)
        if not ok:
            raise RuntimeError(f"step {step} was skipped")


def save_then_continue(root: str, name: str) -> dict[str, Any]:
    """At the saving dp size: save after SAVE_AFTER steps (overwriting an earlier save to the same
    path), continue to TOTAL_STEPS; also resume from the file at the same dp size."""
    case = VARIANTS[name]
    path = os.path.join(root, name)
    model, opt = _fresh(case)
    _train(model, opt, range(1))
    megabuf.save_checkpoint(path, model, opt)  # replaced below: tests the swap
    _train(model, opt, range(1, SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt)
    at_save = final_params(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    resumed_model, resumed_opt = _fresh(case)
    megabuf.load_checkpoint(path, resumed_model, resumed_opt)
    _train(resumed_model, resumed_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "uninterrupted": final_params(model),
        "same_dp": final_params(resumed_model),
        "at_save": at_save,
    }


def leftovers(root: str) -> list[str]:
    """Temporary files the saves left behind (none expected)."""
    return sorted(f for f in os.listdir(root) if f.endswith((".tmp", ".old")))


def resume(root: str, name: str, bucket_size: int | None) -> dict[str, torch.Tensor]:
    """At another dp size and bucket size: load and run the remaining steps."""
    case = VARIANTS[name]
    case = {**case, "ddp": {**case["ddp"], "bucket_size": bucket_size}}
    model, opt = _fresh(case)
    megabuf.load_checkpoint(os.path.join(root, name), model, opt)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    return final_params(model)


def _fresh(case: dict[str, Any]) -> tuple[megabuf.DistributedDataParallel, Any]:
    model = build_model(case)
    return model, build_opt(model, case)


FP32 = VARIANTS["fp32_adam"]
# Loading into something that does not fit must say what does not match: (case, saved variant)
MISMATCHES: dict[str, tuple[dict[str, Any], str]] = {
    "other_model": ({**FP32, "model": "permuted"}, "fp32_adam"),
    "other_dtype": (VARIANTS["bf16_adamw"], "fp32_adam"),
    "other_optimizer": ({**FP32, "optimizer": "sgd"}, "fp32_adam"),
    "not_a_checkpoint": (FP32, "does_not_exist"),
}


def mismatch_error(root: str, label: str) -> str:
    """The ValueError's message when loading into something that does not fit."""
    case, name = MISMATCHES[label]
    model, opt = _fresh(case)
    try:
        megabuf.load_checkpoint(os.path.join(root, name), model, opt)
    except ValueError as exc:
        return str(exc)
    return "no error"
