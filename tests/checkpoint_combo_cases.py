"""Rank side of tests/test_checkpoint_combos.py (4 gloo ranks): checkpoints where features meet.

- Plain torch optimizers at pp=2 (the GPT pipeline, 1F1B), ep=2 x expt_dp=2 and pp=2 x ep=2
  (expt_dp=1 != dp=2): save, continue, a fresh model and optimizer load and resume; and two
  checkpoints edited as a faulty save leaves them (only rank 0's param groups; a rank's pieces
  missing from the index), loaded strictly (refused by name) and with strict_optimizer=False.
- megabuf optimizers under every sharding strategy at ep=2, pp=2 and pp=2 x ep=2, with two
  micro-batches per step under no_sync() (so reduce_each_microbatch differs from accumulation).
  The pp shapes here give each stage its own MoE model and train the stages independently: a
  checkpoint sees the pipeline's groups and stage-prefixed keys, not the schedule.
- Round trips where every field is non-trivial: fp16 with a dynamic loss scaler mid-growth
  (scale grown, growth tracker and hysteresis tracker mid-period) and PowerSGD error feedback;
  LocalSGD's counters past start_step and its averaging step.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from moe_cases import CFG, GLOBAL_BATCH, groups
from optimizer_cases import build_model, build_opt, train_step
from pipeline_cases import GCFG, MBS, global_batch

import megabuf
from megabuf.checkpoint.files import write_metadata
from megabuf.comm_hooks import LocalSGD, PeriodicAverager, PowerSGD
from megabuf.testing.models import GPT, gpt_loss
from megabuf.testing.moe import MoEModel, moe_batch
from megabuf.testing.stages import split_gpt, stage_index
from megabuf.training.finalize import finalize_model_grads

SAVE_AFTER = 3
TOTAL_STEPS = 6
Chunks = list[megabuf.DistributedDataParallel]
# name -> (pp_size, ep_size)
SHAPES = {"dp": (1, 1), "ep2": (1, 2), "pp2": (2, 1), "pp2_ep2": (2, 2)}
STRATEGIES: dict[str, dict[str, Any]] = {
    "no_shard": {"data_parallel_sharding_strategy": "no_shard"},
    "optim": {"data_parallel_sharding_strategy": "optim"},
    "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
    "optim_grads_rem": {
        "data_parallel_sharding_strategy": "optim_grads",
        "sharded_grad_accumulation": "reduce_each_microbatch",
    },
    "optim_grads_params": {"data_parallel_sharding_strategy": "optim_grads_params"},
}


# ---- models and steps --------------------------------------------------------------------------
def _stage_moe(shape: str, ddp: dict[str, Any]) -> Chunks:
    """This rank's stage: an MoE model (seeded by stage) with experts over ep."""
    pp, ep = SHAPES[shape]
    pgs = groups(pp_size=pp, ep_size=ep)
    net = MoEModel(CFG, ep_group=pgs.ep, seed=3 + pgs.pp_rank)
    cfg = megabuf.DistributedDataParallelConfig.from_dict({"bucket_size": 300, **ddp})
    model = megabuf.DistributedDataParallel(net, cfg, process_groups=pgs)
    net.moe.collectives = model.engine.collectives
    return [model]


def _moe_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()  # type: ignore[no-any-return]


def _moe_step(chunks: Chunks, opt: Any, step: int) -> bool:
    """This dp rank's rows of the global batch as two micro-batches (the first under no_sync)."""
    model = chunks[0]
    pgs = model.process_groups
    x, y = moe_batch(CFG, GLOBAL_BATCH, seed=100 + step)
    n = GLOBAL_BATCH // pgs.dp_size
    lo, half = pgs.dp_rank * n, n // 2
    model.zero_grad_buffer()
    if isinstance(opt, megabuf.MegabufOptimizer):
        opt.zero_grad()
    with model.no_sync():
        _moe_loss(model, x[lo : lo + half], y[lo : lo + half]).backward()
    _moe_loss(model, x[lo + half : lo + n], y[lo + half : lo + n]).backward()
    finalize_model_grads([model])
    return _step(opt)


def _step(opt: Any) -> bool:
    result = opt.step()
    return True if result is None else bool(result[0])  # torch optimizers return None


def _pp_gpt(ddp: dict[str, Any]) -> Chunks:
    pgs = groups(pp_size=2)
    stages = split_gpt(GPT(GCFG, seed=0), 2)
    cfg = megabuf.DistributedDataParallelConfig.from_dict({"bucket_size": 300, **ddp})
    return megabuf.wrap_model_chunks([stages[stage_index(pgs.pp_rank, 0, 2)]], cfg, pgs)


def _pp_gpt_step(chunks: Chunks, opt: Any, step: int) -> bool:
    pgs, n_micro = chunks[0].process_groups, 2
    x, y = global_batch(step, pgs.dp_size * n_micro * MBS)
    rows = [pgs.dp_rank * n_micro * MBS + m * MBS for m in range(n_micro)]
    batches = iter([(x[r : r + MBS], y[r : r + MBS]) for r in rows])

    def forward_step(data: Any, model: Any) -> Any:
        tokens, targets = next(data)

        def loss_func(logits: torch.Tensor) -> Any:
            loss = gpt_loss(logits, targets)
            return loss, {"loss": loss.detach()}

        return model(tokens), loss_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    megabuf.get_forward_backward_func(2, 1)(
        forward_step_func=forward_step, data_iterator=batches, model=chunks[0],
        num_microbatches=n_micro, tensor_shape=(MBS, GCFG.seq_len, GCFG.d_model),
        hooks=megabuf.default_schedule_hooks(chunks),
    )  # fmt: skip
    return _step(opt)


Build = Callable[[], tuple[Chunks, Any]]
Step = Callable[[Chunks, Any, int], bool]


def _adamw(chunks: Chunks) -> torch.optim.Optimizer:
    params = [p for c in chunks for p in c.parameters()]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _megabuf_adam(chunks: Chunks) -> Any:
    return megabuf.build_optimizer(chunks, megabuf.OptimizerConfig(optimizer="adam", lr=1e-2))


def _torch_builder(shape: str) -> tuple[Build, Step]:
    if shape == "pp2":  # the real pipeline: tied embeddings on both stages
        return (lambda: _with(_pp_gpt({}), _adamw)), _pp_gpt_step
    return (lambda: _with(_stage_moe(shape, {}), _adamw)), _moe_step


def _with(chunks: Chunks, make_opt: Callable[[Chunks], Any]) -> tuple[Chunks, Any]:
    return chunks, make_opt(chunks)


def params_of(chunks: Chunks) -> dict[str, torch.Tensor]:
    """Every param by chunk and name (state_dict publishes / gathers them first)."""
    out = {}
    for i, chunk in enumerate(chunks):
        state = chunk.state_dict()
        out |= {f"{i}/{n}": state[n].detach().clone() for n, _ in chunk.module.named_parameters()}
    return out


def torch_state_of(chunks: Chunks, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    out = {}
    for i, chunk in enumerate(chunks):
        for name, p in chunk.module.named_parameters():
            out[f"{i}/{name}"] = {k: v.clone() for k, v in opt.state.get(p, {}).items()}
    return out


def _train(chunks: Chunks, opt: Any, step_fn: Step, steps: range) -> None:
    for step in steps:
        if not step_fn(chunks, opt, step):
            raise RuntimeError(f"step {step} was skipped on rank {dist.get_rank()}")


# ---- round trips -------------------------------------------------------------------------------
def _round_trip(path: str, build: Build, step_fn: Step) -> dict[str, Any]:
    chunks, opt = build()
    _train(chunks, opt, step_fn, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, chunks, opt)
    at_save = params_of(chunks)
    state = torch_state_of(chunks, opt) if not isinstance(opt, megabuf.MegabufOptimizer) else {}
    _train(chunks, opt, step_fn, range(SAVE_AFTER, TOTAL_STEPS))
    fresh, fresh_opt = build()
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    loaded = params_of(fresh)
    loaded_state = (
        torch_state_of(fresh, fresh_opt) if not isinstance(opt, megabuf.MegabufOptimizer) else {}
    )
    _train(fresh, fresh_opt, step_fn, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "at_save": at_save, "loaded": loaded, "state_at_save": state,
        "loaded_state": loaded_state, "uninterrupted": params_of(chunks),
        "resumed": params_of(fresh), "kind": type(opt).__name__,
    }  # fmt: skip


def torch_round_trip(root: str, shape: str) -> dict[str, Any]:
    """torch.optim.AdamW over a megabuf-wrapped model at `shape` (no_shard)."""
    build, step_fn = _torch_builder(shape)
    return _round_trip(os.path.join(root, f"torch_{shape}"), build, step_fn)


def megabuf_round_trip(root: str, shape: str, strategy: str) -> dict[str, Any]:
    """megabuf.build_optimizer (Adam) under `strategy` at `shape` (stage MoE models)."""

    def build() -> tuple[Chunks, Any]:
        return _with(_stage_moe(shape, STRATEGIES[strategy]), _megabuf_adam)

    return _round_trip(os.path.join(root, f"{strategy}_{shape}"), build, _moe_step)


def torch_optimizer_refusals() -> dict[str, str]:
    """A plain torch optimizer over a model whose strategy shards the optimizer state, at
    every shape: its first step's error (it never steps, so it has nothing to save)."""
    out = {}
    for shape in SHAPES:
        for strategy in ("optim", "optim_grads", "optim_grads_rem", "optim_grads_params"):
            chunks, opt = _with(_stage_moe(shape, STRATEGIES[strategy]), _adamw)
            try:
                _moe_step(chunks, opt, 0)
                out[f"{strategy}_{shape}"] = "no error"
            except RuntimeError as exc:
                out[f"{strategy}_{shape}"] = str(exc)
    return out


# ---- faulty checkpoints: refused by name, or loaded with strict_optimizer=False ----------------
def _edit(src: str, dst: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Rank 0: copy the checkpoint and change its index (with a valid checksum again)."""
    if dist.get_rank() == 0:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        meta = json.loads(Path(dst, "metadata.json").read_text())
        meta.pop("checksum")
        meta.pop("format")
        change(meta)
        write_metadata(Path(dst), meta)
    dist.barrier()


def _rank0_only(meta: dict[str, Any]) -> None:
    """As saved before the fix: rank 0's param groups alone (its pieces are all there)."""
    for name in meta.pop("torch_commons").values():
        if name != meta["common"]:
            meta["files"] = [r for r in meta["files"] if r["file"] != name]


def _lose_stage1_ep1_experts(meta: dict[str, Any]) -> None:
    meta["optimizer"] = {k: v for k, v in meta["optimizer"].items() if "stage1/ep1/" not in k}


def _outcome(path: str, strict: bool) -> dict[str, Any]:
    build, step_fn = _torch_builder("pp2_ep2")
    chunks, opt = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            megabuf.load_checkpoint(path, chunks, opt, strict_optimizer=strict)
        except ValueError as exc:
            return {"error": str(exc)}
    out = {
        "warnings": [str(w.message) for w in caught if "strict_optimizer" in str(w.message)],
        "loaded": params_of(chunks), "loaded_state": torch_state_of(chunks, opt),
    }  # fmt: skip
    _train(chunks, opt, step_fn, range(SAVE_AFTER, TOTAL_STEPS))
    return {**out, "resumed": params_of(chunks)}


def faulty_loads(root: str) -> dict[str, Any]:
    """The pp2 x ep2 torch checkpoint (saved by torch_round_trip in an earlier case) edited two
    ways, each loaded strictly and with strict_optimizer=False."""
    saved = os.path.join(root, "torch_pp2_ep2")
    out = {}
    for label, change in (("rank0_only", _rank0_only), ("lost", _lose_stage1_ep1_experts)):
        path = os.path.join(root, label)
        _edit(saved, path, change)
        out[label] = {"strict": _outcome(path, True), "relaxed": _outcome(path, False)}
    return out


# ---- round trips at non-trivial states ---------------------------------------------------------
# dynamic scale 2^10, hysteresis 2, growth every 2 good steps; an inf on the last rank at steps 2
# and 5. Saved after step 3: scale 2^11 (grown at step 1), hysteresis 1 of 2 left (step 2),
# growth tracker 1 (step 3); PowerSGD's residuals non-zero (it was reset at step 2, then ran).
FP16_SAVE_AFTER, FP16_STEPS, POISON = 4, 7, (2, 5)
SCALER = {"initial_scale": 2.0**10, "hysteresis": 2, "growth_interval": 2}
FP16 = {
    "fp16": True, "eps": 1e-4, "scaler": SCALER,
    "ddp": {"use_distributed_optimizer": True, "grad_reduce_in_fp32": True, "bucket_size": 100},
}  # fmt: skip


def _scaler_state(opt: Any) -> dict[str, Any]:
    """The scaler's fields as it holds them (not its state_dict: a field it forgets to save
    must show up as a difference after the load)."""
    s = opt.grad_scaler
    return {
        "scale": float(s.scale.item()), "growth_tracker": s.growth_tracker,
        "hysteresis_tracker": s.hysteresis_tracker,
    }  # fmt: skip


def _fp16_engine() -> tuple[Any, Any, PowerSGD]:
    model = build_model(FP16)
    hook = PowerSGD(rank=1, start_step=0)
    model.register_comm_hook(hook)
    return model, build_opt(model, FP16), hook


def _hook_tensors(hook: Any) -> dict[str, torch.Tensor]:
    state = hook.state_dict()
    return {k: v.clone() for k, v in state["per_rank"].items()}


def fp16_scaler_powersgd(root: str) -> dict[str, Any]:
    path = os.path.join(root, "fp16_scaler_powersgd")
    model, opt, hook = _fp16_engine()
    oks = [bool(train_step(model, opt, s, poison=s in POISON)[0]) for s in range(FP16_SAVE_AFTER)]
    megabuf.save_checkpoint(path, model, opt)
    at_save = {"scaler": _scaler_state(opt), "residuals": _hook_tensors(hook)}
    for s in range(FP16_SAVE_AFTER, FP16_STEPS):
        oks.append(bool(train_step(model, opt, s, poison=s in POISON)[0]))
    fresh, fresh_opt, fresh_hook = _fp16_engine()
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    loaded = {"scaler": _scaler_state(fresh_opt), "residuals": _hook_tensors(fresh_hook)}
    for s in range(FP16_SAVE_AFTER, FP16_STEPS):
        train_step(fresh, fresh_opt, s, poison=s in POISON)
    return {
        "oks": oks, "at_save": at_save, "loaded": loaded,
        "scaler_end": _scaler_state(opt), "resumed_scaler_end": _scaler_state(fresh_opt),
        "uninterrupted": params_of([model]), "resumed": params_of([fresh]),
    }  # fmt: skip


# LocalSGD: global all-reduce for 1 step, then in subgroups of 2; averaging every 2 local steps.
# Saved after 3 steps, right after an averaging (the replicas agree; mid-period they differ and
# dp rank 0's params are what a checkpoint keeps): hook step 3, averaged_at 3. Plain SGD: the
# optimizer state of a LocalSGD run differs by rank (it is never averaged), and a checkpoint
# keeps dp rank 0's, so a stateful optimizer would not resume bitwise on the other ranks.
LOCAL = {"ddp": {"bucket_size": 100}}


def _local_engine() -> tuple[Any, Any, LocalSGD, PeriodicAverager]:
    model = build_model(LOCAL)
    hook = LocalSGD(start_step=1, period=2, subgroup_size=2)
    model.register_comm_hook(hook)
    opt = megabuf.MixedPrecisionOptimizer(model, torch.optim.SGD, lr=0.05)
    return model, opt, hook, PeriodicAverager(opt)


def _local_steps(model: Any, opt: Any, averager: PeriodicAverager, steps: range) -> list[bool]:
    averaged = []
    for s in steps:
        train_step(model, opt, s)
        averaged.append(averager.step())
    return averaged


def local_sgd_between_averagings(root: str) -> dict[str, Any]:
    """A save one step after an averaging (the replicas differ) raises on every rank, naming the
    step; the checkpoint saved at the averaging stays and loads."""
    path = os.path.join(root, "local_sgd_between")
    model, opt, _, averager = _local_engine()
    _local_steps(model, opt, averager, range(SAVE_AFTER))  # the last step averaged
    megabuf.save_checkpoint(path, model, opt)
    _local_steps(model, opt, averager, range(SAVE_AFTER, SAVE_AFTER + 1))  # a local step
    error = ""
    try:
        megabuf.save_checkpoint(path, model, opt)
    except ValueError as exc:
        error = str(exc)
    fresh, fresh_opt, fresh_hook, _ = _local_engine()
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    return {"error": error, "loaded_step": fresh_hook.step}


def local_sgd_round_trip(root: str) -> dict[str, Any]:
    path = os.path.join(root, "local_sgd")
    model, opt, hook, averager = _local_engine()
    averaged = _local_steps(model, opt, averager, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt)
    at_save = {"step": hook.step, "averaged_at": hook.averaged_at}
    averaged += _local_steps(model, opt, averager, range(SAVE_AFTER, TOTAL_STEPS + 1))
    fresh, fresh_opt, fresh_hook, fresh_averager = _local_engine()
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    loaded = {"step": fresh_hook.step, "averaged_at": fresh_hook.averaged_at}
    _local_steps(fresh, fresh_opt, fresh_averager, range(SAVE_AFTER, TOTAL_STEPS + 1))
    return {
        "averaged": averaged, "at_save": at_save, "loaded": loaded,
        "uninterrupted": params_of([model]), "resumed": params_of([fresh]),
    }  # fmt: skip
