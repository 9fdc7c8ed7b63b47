"""Rank-side code for tests/test_checkpoint_impl.py: a checkpoint saved with one optimizer
implementation (torch's fused, foreach or for-loop kernel) resumes with another, on the
distributed optimizer, the all-reduce FP32Optimizer and plain torch optimizers; what does not
fit (other math, other state) is refused naming the difference."""

from __future__ import annotations

import os
from typing import Any

import torch
from checkpoint_cases import final_params
from optimizer_cases import build_model, local_slice, loss_fn, make_data

import megabuf
from megabuf.optimizer.implementation import TORCH_KWARGS

SAVE_AFTER, TOTAL_STEPS = 3, 6
DDP = {"bucket_size": 100}
TORCH_CLASSES = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


class AdamWithTrace(torch.optim.Adam):
    """Adam's math and hyperparameters, one more per-param state entry: same group keys as
    Adam, another state layout."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for state in self.state.values():
            state["trace"] = state["exp_avg"].abs()
        return out


def _build(kind: str, name: str, implementation: str) -> tuple[Any, Any]:
    """kind: "distopt" / "allreduce" (megabuf optimizers from the builder) or "torch"."""
    model = build_model({"ddp": {**DDP, "use_distributed_optimizer": kind == "distopt"}})
    if kind == "torch":
        cls = AdamWithTrace if name == "adam_trace" else TORCH_CLASSES[name]
        return model, cls(model.parameters(), lr=1e-2, **TORCH_KWARGS[implementation])
    cfg = megabuf.OptimizerConfig(
        optimizer=name, implementation=implementation, lr=1e-2, weight_decay=0.1
    )
    return model, megabuf.build_optimizer(model, cfg)


def _inner(opt: Any) -> list[torch.optim.Optimizer]:
    if isinstance(opt, megabuf.MegabufOptimizer):
        return [d.optimizer for d in opt.parts().domains]
    return [opt]


def _kernel_flags(opt: Any) -> list[tuple[Any, Any]]:
    return [(g["fused"], g["foreach"]) for inner in _inner(opt) for g in inner.param_groups]


def _switch_kernel(opt: Any, implementation: str) -> None:
    """What a resume with `implementation` does to a live optimizer: the same state, another
    kernel from the next step on."""
    for inner in _inner(opt):
        for group in inner.param_groups:
            group.update({"fused": None, "foreach": None, **TORCH_KWARGS[implementation]})


def _train(model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        x, y = make_data(step)
        if isinstance(opt, megabuf.MegabufOptimizer):
            opt.zero_grad()
        else:
            model.zero_grad_buffer()
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
        model.finish_grad_sync()
        opt.step()


def save_then_switch(root: str, kind: str, saved_with: str, resumed_with: list[str]) -> Any:
    """Save after SAVE_AFTER steps with `saved_with`; for each implementation in
    `resumed_with`: the uninterrupted run switched to it at the save, and a fresh model and
    optimizer built with it that load the checkpoint, both run to TOTAL_STEPS."""
    path = os.path.join(root, f"{kind}_{saved_with}")
    model, opt = _build(kind, "adamw", saved_with)
    _train(model, opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt)
    at_save = final_params(model)
    state = [dict(inner.state_dict()["state"]) for inner in _inner(opt)]
    out: dict[str, Any] = {"saved_flags": _kernel_flags(opt)}
    for implementation in resumed_with:
        ref_model, ref_opt = _build(kind, "adamw", saved_with)
        _train(ref_model, ref_opt, range(SAVE_AFTER))
        _switch_kernel(ref_opt, implementation)
        _train(ref_model, ref_opt, range(SAVE_AFTER, TOTAL_STEPS))
        resumed, resumed_opt = _build(kind, "adamw", implementation)
        megabuf.load_checkpoint(path, resumed, resumed_opt)
        loaded = [dict(inner.state_dict()["state"]) for inner in _inner(resumed_opt)]
        out[implementation] = {
            "flags": _kernel_flags(resumed_opt),  # the loading optimizer's kernel, kept
            "loaded_params_equal": _equal(final_params(resumed), at_save),
            "loaded_state_equal": _states_equal(loaded, state),
            "resumed": _resume(resumed, resumed_opt),
            "uninterrupted": final_params(ref_model),
        }
    return out


def _resume(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    _train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    return final_params(model)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _states_equal(got: list[dict[Any, Any]], want: list[dict[Any, Any]]) -> bool:
    """Every per-param state entry equal in value (a 0-d `step` compared as a number)."""
    if [sorted(s) for s in got] != [sorted(s) for s in want]:
        return False
    for g, w in zip(got, want, strict=True):
        for index, entries in w.items():
            if entries.keys() != g[index].keys():
                return False
            for name, value in entries.items():
                other = g[index][name]
                if not torch.equal(torch.as_tensor(other).cpu(), torch.as_tensor(value).cpu()):
                    return False
    return True


# label -> (kind, saved optimizer, loading optimizer): loads that must be refused
MISFITS: dict[str, tuple[str, str, str]] = {
    "adam_into_adamw": ("distopt", "adam", "adamw"),
    "adam_into_sgd_torch": ("torch", "adam", "sgd"),
    "adam_into_extra_state": ("torch", "adam", "adam_trace"),
    "extra_state_into_adam": ("torch", "adam_trace", "adam"),
}


def misfit_error(root: str, label: str) -> str:
    """Save with one optimizer, load into another: the ValueError's message."""
    kind, saved, loading = MISFITS[label]
    path = os.path.join(root, f"misfit_{label}")
    model, opt = _build(kind, saved, "foreach")
    _train(model, opt, range(1))
    megabuf.save_checkpoint(path, model, opt)
    model, opt = _build(kind, loading, "for_loop")
    try:
        megabuf.load_checkpoint(path, model, opt)
    except ValueError as exc:
        return str(exc)
    return "no error"
