"""Rank-side code for tests/test_checkpoint_trust.py: torch optimizers, every megabuf optimizer
into a fresh model, damaged files, interrupted swaps, `extra=` and export."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import torch
from checkpoint_cases import SAVE_AFTER, TOTAL_STEPS, final_params
from optimizer_cases import (
    TORCH_OPTIMIZERS,
    build_model,
    build_opt,
    local_slice,
    loss_fn,
    make_data,
    optimizer_kwargs,
    param_groups,
    train_step,
)

import megabuf
import megabuf.checkpoint

# ---- plain torch optimizers on the all-reduce path -----------------------------------------
TORCH_CASES: dict[str, dict[str, Any]] = {
    "torch_adamw": {"optimizer": "adamw", "ddp": {"bucket_size": 100}},
    "torch_sgd_overlap": {
        "optimizer": "sgd",
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 60},
    },
    "torch_adam_expert": {"optimizer": "adam", "expert": True, "ddp": {"bucket_size": 100}},
}


def _torch_opt(model: megabuf.DistributedDataParallel, case: dict[str, Any]) -> Any:
    name = case["optimizer"]
    kwargs = optimizer_kwargs(name, case)
    return TORCH_OPTIMIZERS[name](param_groups(model.module, kwargs["lr"]), **kwargs)


def _torch_step(model: megabuf.DistributedDataParallel, opt: Any, step: int) -> None:
    x, y = make_data(step)
    model.zero_grad_buffer()
    loss_fn(model(local_slice(x)), local_slice(y)).backward()
    model.finish_grad_sync()
    opt.step()


def torch_optimizer_save(root: str, name: str) -> dict[str, Any]:
    """Train SAVE_AFTER steps with a plain torch optimizer, save, continue to TOTAL_STEPS; a
    fresh model and optimizer load the checkpoint here and run the same remaining steps."""
    case, path = TORCH_CASES[name], os.path.join(root, name)
    model = build_model(case)
    opt = _torch_opt(model, case)
    for step in range(SAVE_AFTER):
        _torch_step(model, opt, step)
    megabuf.save_checkpoint(path, model, opt)
    state = {
        n: {k: v.clone() for k, v in opt.state[p].items()}
        for n, p in model.module.named_parameters()
    }
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _torch_step(model, opt, step)
    return {
        "uninterrupted": final_params(model), "state_at_save": state,
        "same_dp": torch_optimizer_resume(root, name),
    }  # fmt: skip


def torch_optimizer_resume(root: str, name: str, bucket_size: int | None = 37) -> Any:
    case = TORCH_CASES[name]
    case = {**case, "ddp": {**case["ddp"], "bucket_size": bucket_size}}
    model = build_model(case)
    opt = _torch_opt(model, case)
    megabuf.load_checkpoint(os.path.join(root, name), model, opt)
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _torch_step(model, opt, step)
    return final_params(model)


# ---- megabuf optimizers: save, load into a fresh model, resume ----------------------------
FRESH_CASES: dict[str, dict[str, Any]] = {
    "fp32_allreduce_built": {"optimizer": "adam", "builder": True, "ddp": {"bucket_size": 100}},
    "fp32_allreduce_expert_built": {
        "optimizer": "adamw", "builder": True, "expert": True,
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 60},
    },
    "bf16_allreduce_expert": {
        "optimizer": "adam", "bf16": True, "eps": 1e-4, "expert": True,
        "ddp": {"grad_reduce_in_fp32": True, "bucket_size": 80},
    },
    "bf16_distopt_expert": {
        "optimizer": "adamw", "bf16": True, "eps": 1e-4, "expert": True,
        "ddp": {"use_distributed_optimizer": True, "overlap_param_gather": True,
                "grad_reduce_in_fp32": True, "bucket_size": 64},
    },
    "fp32_distopt_built": {
        "optimizer": "sgd", "builder": True,
        "ddp": {"use_distributed_optimizer": True, "bucket_size": 50},
    },
}  # fmt: skip


def _train(model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        if not train_step(model, opt, step)[0]:
            raise RuntimeError(f"step {step} was skipped")


def fresh_model_resume(root: str, name: str) -> dict[str, Any]:
    """Save after SAVE_AFTER steps; a freshly built model and optimizer load it and run the
    remaining steps next to the uninterrupted run."""
    case, path = FRESH_CASES[name], os.path.join(root, name)
    model = build_model(case)
    opt = build_opt(model, case)
    _train(model, opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt)
    at_save = final_params(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    fresh = build_model(case)
    fresh_opt = build_opt(fresh, case)
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    loaded = final_params(fresh)
    _train(fresh, fresh_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "kind": type(opt).__name__, "at_save": at_save, "loaded": loaded,
        "uninterrupted": final_params(model), "resumed": final_params(fresh),
    }  # fmt: skip


# loaded into another kind of optimizer / overlap / bucket size at the same dp size:
# (checkpoint written by a FRESH_CASES case, the case that loads it)
CROSS: dict[str, tuple[str, dict[str, Any]]] = {
    "distopt_to_allreduce": ("fp32_distopt_built", {
        "optimizer": "sgd", "builder": True,
        "ddp": {"overlap_grad_reduce": True, "bucket_size": 30}}),
    "allreduce_to_distopt": ("fp32_allreduce_built", {
        "optimizer": "adam", "builder": True,
        "ddp": {"use_distributed_optimizer": True, "overlap_param_gather": True,
                "bucket_size": 40}}),
    "bf16_distopt_to_allreduce": ("bf16_distopt_expert", {
        "optimizer": "adamw", "bf16": True, "eps": 1e-4, "expert": True,
        "ddp": {"grad_reduce_in_fp32": True, "overlap_grad_reduce": True, "bucket_size": 30}}),
}  # fmt: skip


def cross_resume(root: str, label: str) -> dict[str, Any]:
    saved_name, case = CROSS[label]
    model = build_model(case)
    opt = build_opt(model, case)
    megabuf.load_checkpoint(os.path.join(root, saved_name), model, opt)
    loaded = final_params(model)
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {"kind": type(opt).__name__, "loaded": loaded, "resumed": final_params(model)}


def async_saves(root: str) -> dict[str, Any]:
    """Two asynchronous saves while training goes on (the second waits for the first); a fresh
    model loads each and the first resumes."""
    case = {**FP32, "ddp": {**FP32["ddp"], "overlap_param_gather": True}}
    model = build_model(case)
    opt = build_opt(model, case)
    _train(model, opt, range(SAVE_AFTER))
    first = megabuf.save_checkpoint(os.path.join(root, "async1"), model, opt, async_save=True)
    at_first = final_params(model)
    _train(model, opt, range(SAVE_AFTER, SAVE_AFTER + 2))  # while it is written
    second = megabuf.save_checkpoint(os.path.join(root, "async2"), model, opt, async_save=True)
    first_done = first.done  # the second save finished the first one
    at_second = final_params(model)
    _train(model, opt, range(SAVE_AFTER + 2, TOTAL_STEPS))
    second.wait()
    fresh = build_model(case)
    fresh_opt = build_opt(fresh, case)
    megabuf.load_checkpoint(os.path.join(root, "async2"), fresh, fresh_opt)
    loaded_second = final_params(fresh)
    megabuf.load_checkpoint(os.path.join(root, "async1"), fresh, fresh_opt)
    loaded_first = final_params(fresh)
    _train(fresh, fresh_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "first_done": first_done, "at_first": at_first, "at_second": at_second,
        "loaded_first": loaded_first, "loaded_second": loaded_second,
        "uninterrupted": final_params(model), "resumed": final_params(fresh),
    }  # fmt: skip


# ---- damaged files and interrupted saves (the test side damages the files in between) -----
FP32 = {"optimizer": "adam", "ddp": {"use_distributed_optimizer": True, "bucket_size": 100}}


def save_after(root: str, name: str, steps: int) -> dict[str, torch.Tensor]:
    """Train `steps` steps (fp32, distributed optimizer), save to root/name; the params saved."""
    model = build_model(FP32)
    opt = build_opt(model, FP32)
    _train(model, opt, range(steps))
    megabuf.save_checkpoint(os.path.join(root, name), model, opt)
    return final_params(model)


def load_outcome(root: str, name: str) -> dict[str, Any]:
    """Load root/name into a fresh model: its params, or the ValueError's message."""
    model = build_model(FP32)
    opt = build_opt(model, FP32)
    try:
        megabuf.load_checkpoint(os.path.join(root, name), model, opt)
    except ValueError as exc:
        return {"error": str(exc)}
    return {"params": final_params(model)}


def torch_load_outcome(root: str, name: str) -> dict[str, Any]:
    """Load root/name into a fresh model with a plain torch AdamW: the error's message."""
    case = TORCH_CASES["torch_adamw"]
    model = build_model(case)
    try:
        megabuf.load_checkpoint(os.path.join(root, name), model, _torch_opt(model, case))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"params": final_params(model)}


# ---- extra= ----------------------------------------------------------------------------------
def save_with_extra(root: str) -> dict[str, Any]:
    """Save the RNG states and the loop's own state with the checkpoint; draw what comes next."""
    model = build_model(FP32)
    opt = build_opt(model, FP32)
    _train(model, opt, range(1))
    torch.manual_seed(1234 + torch.distributed.get_rank())  # per-rank streams: rank 0's is kept
    random.seed(99)
    extra = {
        "step": 1, "best_loss": 0.25, "config": {"lr": 1e-2},
        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
    }  # fmt: skip
    megabuf.save_checkpoint(os.path.join(root, "extra"), model, opt, extra=extra)
    megabuf.save_checkpoint(os.path.join(root, "no_extra"), model, opt)
    return {"torch_next": torch.rand(5), "python_next": random.random()}


def load_extra(root: str) -> dict[str, Any]:
    model = build_model(FP32)
    opt = build_opt(model, FP32)
    extra = megabuf.load_checkpoint(os.path.join(root, "extra"), model, opt)
    torch.set_rng_state(extra["torch_rng"])
    random.setstate(extra["python_rng"])
    none = megabuf.load_checkpoint(os.path.join(root, "no_extra"), model, opt)
    return {
        "extra": {k: extra[k] for k in ("step", "best_loss", "config")},
        "torch_next": torch.rand(5), "python_next": random.random(), "without": none,
    }  # fmt: skip


# ---- export ----------------------------------------------------------------------------------
def export_full_state(root: str) -> dict[str, Any]:
    """fp32 distributed optimizer with overlap_param_gather (params stale until published):
    3 steps, then the full state_dict on rank 0 and in a file, and a checkpoint of the same."""
    case = {**FP32, "ddp": {**FP32["ddp"], "overlap_param_gather": True}}
    model = build_model(case)
    opt = build_opt(model, case)
    _train(model, opt, range(SAVE_AFTER))
    state = megabuf.full_state_dict(model, os.path.join(root, "export", "model.pt"))
    megabuf.save_checkpoint(os.path.join(root, "exported"), model, opt)
    return {"state": state, "params": final_params(model)}


# ---- fault injection: a real rank process killed at each stage of a save -------------------
def _die(root: str, stage: str) -> None:
    Path(root, f"died-{stage}-rank{torch.distributed.get_rank()}").touch()
    os.kill(os.getpid(), signal.SIGKILL)


def _inject(root: str, stage: str, final: str) -> None:
    """Make this process kill itself at `stage` of its next save (patching only this process)."""
    import megabuf.checkpoint.files as files
    import megabuf.checkpoint.save as save_module

    rank = torch.distributed.get_rank()
    if stage == "mid_write" and rank == 1:
        import torch.distributed.checkpoint.filesystem as dcp_files

        real_write_item = dcp_files._write_item

        def write_item(transforms: Any, stream: Any, *args: Any) -> Any:
            if stream.tell() > 0:  # one item of its data file written, the next not
                stream.flush()
                _die(root, stage)
            return real_write_item(transforms, stream, *args)

        dcp_files._write_item = write_item
    elif stage == "before_metadata" and rank == 0:
        save_module.write_metadata = lambda *_: _die(root, stage)
    elif stage == "before_renames" and rank == 0:
        save_module.commit = lambda *_: _die(root, stage)
    elif stage in ("between_renames", "after_renames") and rank == 0:
        real_replace = os.replace

        def replace(src: Any, dst: Any) -> None:
            real_replace(src, dst)
            if stage == "after_renames" and str(dst) == final:
                _die(root, stage)
            if stage == "between_renames" and str(src) == final:
                _die(root, stage)

        files.os.replace = replace  # type: ignore[assignment]  # os itself: this process only


def save_twice_and_die(root: str, stage: str) -> None:
    """Under megabuf.testing.spawn: save checkpoint A, train a step, save B to the same path and
    die at `stage` of that save. Each rank's params at A and B go to files beside it."""
    megabuf.init_distributed()
    rank, final = torch.distributed.get_rank(), os.path.join(root, "ckpt")
    model = build_model(FP32)
    opt = build_opt(model, FP32)
    _train(model, opt, range(1))
    megabuf.save_checkpoint(final, model, opt)
    torch.save(final_params(model), os.path.join(root, f"A-rank{rank}.pt"))
    _train(model, opt, range(1, 2))
    torch.save(final_params(model), os.path.join(root, f"B-rank{rank}.pt"))
    _inject(root, stage, final)
    megabuf.save_checkpoint(final, model, opt)
    raise RuntimeError(f"rank {rank} survived stage {stage}")  # the dying rank never gets here
