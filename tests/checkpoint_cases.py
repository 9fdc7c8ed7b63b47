"""Rank-side code for the checkpoint tests: save at one dp size, resume at another; pipeline
(pp=2) and expert-parallel (ep=2) models saved and resumed at the same sizes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from moe_cases import build as build_moe
from moe_cases import groups, run_step
from optimizer_cases import Reference, build_model, build_opt, train_step
from pipeline_cases import GCFG, MBS, global_batch

import megabuf
from megabuf.testing.models import GPT, gpt_loss
from megabuf.testing.stages import split_gpt, stage_index

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
    "bf16_adamw": {  # saved asynchronously
        "optimizer": "adamw",
        "bf16": True,
        "async": True,
        "eps": 1e-4,
        "ddp": {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "bucket_size": 60},
    },
    "zero3_adamw": {  # saved under ZeRO-3; resumed under ZeRO-1 at dp=2, no_shard at dp=1
        "optimizer": "adamw",
        "ddp": {"data_parallel_sharding_strategy": "optim_grads_params", "bucket_size": 100},
        "resume_ddp": {37: {"use_distributed_optimizer": True}, None: {}},  # by bucket size
    },
    "mixed_bf16_sgd": {  # non-distributed MixedPrecisionOptimizer: dp rank 0 writes whole params
        "optimizer": "sgd",
        "bf16": True,
        "ddp": {"grad_reduce_in_fp32": True, "overlap_grad_reduce": True, "bucket_size": 80},
    },
}


def final_params(model: megabuf.DistributedDataParallel) -> dict[str, torch.Tensor]:
    """The params by name (collective under ZeRO-3, whose state_dict() gathers them)."""
    names = [n for n, _ in model.module.named_parameters()]
    state = model.state_dict()
    return {n: state[n].detach().float().clone() for n in names}


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
    megabuf.save_checkpoint(path, model, opt, async_save=case.get("async", False))  # replaced
    _train(model, opt, range(1, SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt, async_save=case.get("async", False))
    at_save = final_params(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))  # while an async save is written
    resumed_model, resumed_opt = _fresh(case)  # load_checkpoint finishes the pending save
    megabuf.load_checkpoint(path, resumed_model, resumed_opt)
    _train(resumed_model, resumed_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "uninterrupted": final_params(model),
        "same_dp": final_params(resumed_model),
        "at_save": at_save,
        "reference_state": _reference_state(case),
    }


def _reference_state(case: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """torch's optimizer state after SAVE_AFTER single-process steps on the global batch, by
    param name: what the saved optimizer state holds, up to the dp sums' rounding."""
    ref = Reference(case)
    for step in range(SAVE_AFTER):
        ref.step(step)
    names = [n for n, _ in ref.model.named_parameters()]
    return {
        name: {k: v.clone() for k, v in ref.opt.state[master].items() if v.dim() > 0}
        for name, master in zip(names, ref.masters, strict=True)
    }


def leftovers(root: str) -> list[str]:
    """Temporary files the saves left behind (none expected)."""
    return sorted(f for f in os.listdir(root) if f.endswith((".tmp", ".old")))


def resume(root: str, name: str, bucket_size: int | None) -> dict[str, torch.Tensor]:
    """At another dp size and bucket size: load and run the remaining steps."""
    case = VARIANTS[name]
    ddp = case.get("resume_ddp", {}).get(bucket_size, case["ddp"])
    case = {**case, "ddp": {**ddp, "bucket_size": bucket_size}}
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


# ---- pipeline- and expert-parallel checkpoints (4 ranks: pp=2 x dp=2, ep=2 x expt_dp=2) -----
Chunks = list[megabuf.DistributedDataParallel]
ADAM = megabuf.OptimizerConfig(optimizer="adam", lr=1e-2)
DISTOPT = megabuf.DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=300
)
ALLREDUCE = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=300)


def _pp_build(cfg: megabuf.DistributedDataParallelConfig) -> tuple[Chunks, Any]:
    pgs = groups(pp_size=2)
    stages = split_gpt(GPT(GCFG, seed=0), 2)
    chunks = megabuf.wrap_model_chunks([stages[stage_index(pgs.pp_rank, 0, 2)]], cfg, pgs)
    return chunks, megabuf.build_optimizer(chunks, ADAM)


def _lm_loss(targets: torch.Tensor, logits: torch.Tensor) -> Any:
    loss = gpt_loss(logits, targets)
    return loss, {"loss": loss.detach()}


def _gpt_forward_step(data_iterator: Iterator[Any], model: Any) -> Any:
    tokens, targets = next(data_iterator)
    return model(tokens), partial(_lm_loss, targets)


def _pp_step(chunks: Chunks, opt: megabuf.MegabufOptimizer, step: int) -> Any:
    pgs, n_micro = chunks[0].process_groups, 2
    x, y = global_batch(step, pgs.dp_size * n_micro * MBS)
    rows = [pgs.dp_rank * n_micro * MBS + m * MBS for m in range(n_micro)]
    batches = [(x[r : r + MBS], y[r : r + MBS]) for r in rows]
    opt.zero_grad()
    megabuf.get_forward_backward_func(2, 1)(
        forward_step_func=_gpt_forward_step, data_iterator=iter(batches), model=chunks[0],
        num_microbatches=n_micro, tensor_shape=(MBS, GCFG.seq_len, GCFG.d_model),
        hooks=megabuf.default_schedule_hooks(chunks),
    )  # fmt: skip
    return opt.step()


def _ep_build(distopt: bool) -> tuple[Chunks, Any]:
    model = build_moe(
        {"ep": 2, "config": {"use_distributed_optimizer": distopt, "bucket_size": 300}}
    )
    return [model], megabuf.build_optimizer(model, ADAM)


def _ep_step(chunks: Chunks, opt: megabuf.MegabufOptimizer, step: int) -> Any:
    opt.zero_grad()
    run_step(chunks[0], step, per_token=False)  # finalize_model_grads
    return opt.step()


Builder = Callable[[], tuple[Chunks, megabuf.MegabufOptimizer]]
Stepper = Callable[[Chunks, megabuf.MegabufOptimizer, int], Any]
PARALLEL: dict[str, tuple[Builder, Stepper]] = {
    "pp2": (partial(_pp_build, DISTOPT), _pp_step),
    "ep2": (partial(_ep_build, True), _ep_step),
    # all-reduce path (FP32Optimizer): every rank holds whole params and their state
    "pp2_allreduce": (partial(_pp_build, ALLREDUCE), _pp_step),
    "ep2_allreduce": (partial(_ep_build, False), _ep_step),
}


def _chunk_params(chunks: Chunks) -> dict[str, torch.Tensor]:
    out = {}
    for i, chunk in enumerate(chunks):
        chunk.publish_params()
        out |= {f"{i}/{n}": p.detach().clone() for n, p in chunk.module.named_parameters()}
    return out


def parallel_save_then_resume(root: str, name: str) -> dict[str, Any]:
    """Train SAVE_AFTER steps, save, continue to TOTAL_STEPS; a fresh model and optimizer load
    the checkpoint (same pp / ep / dp sizes) and run the same remaining steps."""
    build, step_fn = PARALLEL[name]
    path = os.path.join(root, name)

    def train(chunks: Chunks, opt: megabuf.MegabufOptimizer, steps: range) -> None:
        for step in steps:
            if not step_fn(chunks, opt, step)[0]:
                raise RuntimeError(f"{name}: step {step} was skipped")

    chunks, opt = build()
    train(chunks, opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, chunks, opt)
    at_save = _chunk_params(chunks)
    train(chunks, opt, range(SAVE_AFTER, TOTAL_STEPS))
    resumed, resumed_opt = build()
    fresh = _chunk_params(resumed)
    megabuf.load_checkpoint(path, resumed, resumed_opt)
    loaded = _chunk_params(resumed)
    train(resumed, resumed_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "uninterrupted": _chunk_params(chunks), "resumed": _chunk_params(resumed),
        "at_save": at_save, "fresh": fresh, "loaded": loaded, "kind": type(opt).__name__,
    }  # fmt: skip


def parallel_mismatch_error(root: str, name: str) -> str:
    """The pp=2 / ep=2 checkpoints loaded at pp=1 / ep=1 (the whole GPT, all experts local):
    the ValueError's message."""
    if name == "pp2":
        chunks = megabuf.wrap_model_chunks([GPT(GCFG, seed=0)], DISTOPT, groups())
    else:
        chunks = [build_moe({"ep": 1, "config": {"use_distributed_optimizer": True}})]
    opt = megabuf.build_optimizer(chunks, ADAM)
    try:
        megabuf.load_checkpoint(os.path.join(root, name), chunks, opt)
    except ValueError as exc:
        return str(exc)
    return "no error"


def parallel_export(name: str) -> dict[str, Any]:
    """full_state_dict of a pp=2 / ep=2 model after SAVE_AFTER steps: rank 0 gathers every
    stage's and every ep rank's entries."""
    build, step_fn = PARALLEL[name]
    chunks, opt = build()
    for step in range(SAVE_AFTER):
        step_fn(chunks, opt, step)
    return {"state": megabuf.full_state_dict(chunks), "params": _chunk_params(chunks)}
