"""Rank side of tests/test_checkpoint_hook_state.py: a test-only stateful comm hook with
PowerSGD's shape of state ([Note: comm hook state in checkpoints]), saved at step SAVE_AFTER
and reloaded into new engines."""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from grad_cases import Net
from optimizer_cases import train_step

import megabuf
from megabuf.comm_hooks import GradBucket, Reduce
from megabuf.comm_hooks.contract import MODES

SAVE_AFTER = 3
TOTAL_STEPS = 6
GRID = 2.0**-10  # multiples of it sum exactly in fp32: any reduction order is bitwise


class ResidualQuantize:
    """Quantize each pre-scaled grad onto a grid with a random per-param offset, keep what was
    lost as a per-rank residual added back next step (error feedback), then reduce. State:
    per rank `residual/<param>` (param-shaped); replicated `offset/<param>` (a running mean of
    the random offsets), `step` (synced steps; plain reduction before `start_step`), `rng`
    (uint8 state of the generator that seeds each step's offsets), and two constants (`grid`,
    a float; `format`, a str). Results depend on each of the first four, and do not
    depend on the bucket layout (per-param, elementwise, offsets seeded per param name);
    `layout_bound=True` ties the state to the bucket numels as BatchedPowerSGD's is."""

    modes = MODES
    name = "ResidualQuantize"

    def __init__(self, seed: int = 0, start_step: int = 2, layout_bound: bool = False) -> None:
        self.start_step, self.layout_bound = start_step, layout_bound
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0
        self.residual: dict[str, torch.Tensor] = {}
        self.offset: dict[str, torch.Tensor] = {}
        self.loaded: dict[str, Any] | None = None
        self._calls, self._step_seed = 0, 0

    def setup(self, buckets: list[GradBucket]) -> None:
        self.buckets = buckets
        self.group_size = {n: b.group_size for b in buckets for n in b.param_names}

    def __call__(self, bucket: GradBucket) -> Any:
        if self._calls == 0:
            self._step_seed = int(torch.randint(0, 2**30, (1,), generator=self.generator))
        self._calls += 1
        if self.step >= self.start_step:
            for name, grad in zip(bucket.param_names, bucket.gradients(), strict=True):
                self._quantize(name, grad)
        if self._calls == len(self.buckets):
            self._calls, self.step = 0, self.step + 1
        return Reduce()(bucket)

    def _quantize(self, name: str, grad: torch.Tensor) -> None:
        seed = self._step_seed ^ zlib.crc32(name.encode())
        u = torch.rand(grad.shape, generator=torch.Generator().manual_seed(seed))
        offset = self.offset.setdefault(name, u)  # then updated in place, as the residual:
        offset.mul_(0.5).add_(0.5 * u)  # an async save must copy the state when it is called
        residual = self.residual.setdefault(name, torch.zeros_like(grad))
        x = grad + residual
        q = torch.floor(x / GRID + offset) * GRID
        residual.copy_(x - q)
        grad.copy_(q)

    def _layout(self) -> dict[str, Any]:
        return (
            {"bucket_numels": [b.data.numel() for b in self.buckets]} if self.layout_bound else {}
        )

    def state_dict(self) -> dict[str, Any]:
        replicated: dict[str, Any] = {
            "step": self.step, "rng": self.generator.get_state(), "grid": GRID, "format": "v1",
        }  # fmt: skip
        replicated |= {f"offset/{n}": t for n, t in self.offset.items()}
        per_rank = {f"residual/{n}": t for n, t in self.residual.items()}
        return {"replicated": replicated, "per_rank": per_rank, "layout": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["layout"] != self._layout():
            raise ValueError(
                f"ResidualQuantize state is tied to the bucket layout; saved with "
                f"{state['layout']}, this model has {self._layout()}"
            )
        rep = state["replicated"]
        for key in [*rep, *state["per_rank"]]:
            if "/" in key and key.split("/", 1)[1] not in self.group_size:
                raise ValueError(f"ResidualQuantize: key {key!r} names a param this rank lacks")
        self.step, self.loaded = rep["step"], state
        self.generator.set_state(rep["rng"])
        self.offset = {k.split("/", 1)[1]: v.clone() for k, v in rep.items() if "/" in k}
        self.residual = {}
        for key, value in state["per_rank"].items():
            name = key.split("/", 1)[1]
            merged = state["per_rank_merged"]
            self.residual[name] = value / self.group_size[name] if merged else value.clone()


class OtherStateful(ResidualQuantize):
    name = "OtherStateful"


def hook_of(model: Any) -> Any:
    return model.comm_hooks()["dense"]


def snapshot(hook: ResidualQuantize) -> dict[str, Any]:
    """Copies of the hook's state, for comparisons in the parent process."""
    state = hook.state_dict()
    return {
        "replicated": {k: v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in state["replicated"].items()},
        "per_rank": {k: v.clone() for k, v in state["per_rank"].items()},
    }  # fmt: skip


VARIANTS: dict[str, dict[str, Any]] = {
    "ar": {"ddp": {"bucket_size": 64, "overlap_grad_reduce": True}, "other_bucket": 400},
    "rs_async": {
        "ddp": {"bucket_size": 64, "use_distributed_optimizer": True},
        "other_bucket": None,
        "async": True,
    },
}
ADAM = megabuf.OptimizerConfig(optimizer="adam", lr=1e-2)


def build(ddp: dict[str, Any], hook: Any = "default") -> tuple[Any, Any]:
    torch.manual_seed(0)
    cfg = megabuf.DistributedDataParallelConfig.from_dict(ddp)
    model = megabuf.DistributedDataParallel(Net(), cfg)
    if hook == "default":
        hook = ResidualQuantize()
    if hook is not None:
        model.register_comm_hook(hook)
    return model, megabuf.build_optimizer(model, ADAM)


def train(model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        if not train_step(model, opt, step)[0]:
            raise RuntimeError(f"step {step} was skipped")


def params(model: Any) -> dict[str, torch.Tensor]:
    model.publish_params()
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def save_then_continue(root: str, name: str) -> dict[str, Any]:
    """Save after SAVE_AFTER steps (async: training goes on while it is written), continue;
    new engines load it (same config; another bucket size; hook state dropped) and continue."""
    case = VARIANTS[name]
    path = os.path.join(root, f"{name}_dp{dist.get_world_size()}")
    model, opt = build(case["ddp"])
    train(model, opt, range(SAVE_AFTER))
    at_save = snapshot(hook_of(model))
    megabuf.save_checkpoint(path, model, opt, async_save=case.get("async", False))
    train(model, opt, range(SAVE_AFTER, TOTAL_STEPS))
    out: dict[str, Any] = {"at_save": at_save, "uninterrupted": params(model)}
    other = {**case["ddp"], "bucket_size": case["other_bucket"]}
    for label, ddp in (("same", case["ddp"]), ("other_bucket", other)):
        resumed, resumed_opt = build(ddp)
        megabuf.load_checkpoint(path, resumed, resumed_opt)
        out[f"{label}_loaded"] = snapshot(hook_of(resumed))
        out[f"{label}_merged"] = hook_of(resumed).loaded["per_rank_merged"]
        out[f"{label}_buckets"] = len(hook_of(resumed).buckets)
        train(resumed, resumed_opt, range(SAVE_AFTER, TOTAL_STEPS))
        out[label] = params(resumed)
    lost, lost_opt = build(case["ddp"], hook=None)  # relaxed: the saved state is dropped
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        megabuf.load_checkpoint(path, lost, lost_opt, strict_comm_hooks=False)
    lost.register_comm_hook(ResidualQuantize())
    train(lost, lost_opt, range(SAVE_AFTER, TOTAL_STEPS))
    out["lost"] = params(lost)
    out["lost_warnings"] = [str(w.message) for w in caught if "comm hook" in str(w.message)]
    return out


def load_merged(root: str, name: str, saved_dp: int) -> dict[str, Any]:
    """At this (smaller) world size: load the checkpoint saved at `saved_dp`, then 2 steps."""
    case = VARIANTS[name]
    model, opt = build(case["ddp"])
    megabuf.load_checkpoint(os.path.join(root, f"{name}_dp{saved_dp}"), model, opt)
    hook = hook_of(model)
    out = {"loaded": snapshot(hook), "merged": hook.loaded["per_rank_merged"],
           "counts": hook.loaded["per_rank_counts"]}  # fmt: skip
    train(model, opt, range(SAVE_AFTER, SAVE_AFTER + 2))
    out["step_after"] = hook.step
    return out


# ---- several model chunks; expert buffers -----------------------------------------------------
class _Chained(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h)


def _chunks(hooked: tuple[bool, bool]) -> tuple[list[Any], Any]:
    torch.manual_seed(0)
    cfg = megabuf.DistributedDataParallelConfig(bucket_size=64)
    chunks = [megabuf.DistributedDataParallel(m, cfg) for m in (Net(), _Chained())]
    for seed, (chunk, on) in enumerate(zip(chunks, hooked, strict=True)):
        if on:
            chunk.register_comm_hook(ResidualQuantize(seed=seed, start_step=1))
    return chunks, megabuf.build_optimizer(chunks, ADAM)


def _chunks_step(chunks: list[Any], opt: Any, step: int) -> None:
    from grad_cases import local_slice, loss_fn, make_data

    x, y = make_data(step)
    opt.zero_grad()
    loss_fn(chunks[1](chunks[0](local_slice(x))), local_slice(y)).backward()
    if not opt.step()[0]:
        raise RuntimeError(f"step {step} was skipped")


def chunks_case(root: str) -> dict[str, Any]:
    """Two model chunks, each with its own hook (other seeds): save, continue; new chunks load
    and continue bitwise. Saved with chunk 1 unhooked, loaded with both hooked: chunk 1's hook
    has no saved state (strict: error naming it)."""
    path = os.path.join(root, "chunks")
    chunks, opt = _chunks((True, True))
    for step in range(SAVE_AFTER):
        _chunks_step(chunks, opt, step)
    megabuf.save_checkpoint(path, chunks, opt)
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _chunks_step(chunks, opt, step)
    resumed, resumed_opt = _chunks((True, True))
    megabuf.load_checkpoint(path, resumed, resumed_opt)
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _chunks_step(resumed, resumed_opt, step)
    half, half_opt = _chunks((True, False))
    megabuf.save_checkpoint(path + "_half", half, half_opt)
    both, both_opt = _chunks((True, True))
    return {
        "same": [torch.equal(a, b) for c, r in zip(chunks, resumed, strict=True)
                 for a, b in zip(params(c).values(), params(r).values(), strict=True)],
        "missing": _error(lambda: megabuf.load_checkpoint(path + "_half", both, both_opt)),
        "slots": sorted(megabuf.checkpoint.consolidated_comm_hook_state(path)),
    }  # fmt: skip


def expert_case(root: str) -> dict[str, Any]:
    """MoE at ep=2 x expt_dp=2 (4 ranks), one hook on dense and expert buffers, distributed
    optimizer: save, continue; a new engine loads (each rank only its own experts' keys: the
    hook raises on any other) and continues bitwise."""
    from checkpoint_cases import _ep_step
    from moe_cases import build as build_moe

    def fresh() -> tuple[list[Any], Any]:
        torch.manual_seed(0)
        model = build_moe(
            {"ep": 2, "config": {"use_distributed_optimizer": True, "bucket_size": 300}}
        )
        model.register_comm_hook(ResidualQuantize(start_step=1))
        return [model], megabuf.build_optimizer(model, ADAM)

    path = os.path.join(root, "expert")
    chunks, opt = fresh()
    for step in range(SAVE_AFTER):
        _ep_step(chunks, opt, step)
    megabuf.save_checkpoint(path, chunks, opt)
    hook = chunks[0].comm_hooks()["expert"]
    at_save = snapshot(hook)
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _ep_step(chunks, opt, step)
    resumed, resumed_opt = fresh()
    megabuf.load_checkpoint(path, resumed, resumed_opt)
    loaded = snapshot(resumed[0].comm_hooks()["dense"])
    for step in range(SAVE_AFTER, TOTAL_STEPS):
        _ep_step(resumed, resumed_opt, step)
    return {
        "both_kinds_one_hook": hook is chunks[0].comm_hooks()["dense"],
        "at_save": at_save, "loaded": loaded, "merged": resumed[0].comm_hooks()["dense"].loaded[
            "per_rank_merged"],
        "uninterrupted": params(chunks[0]), "resumed": params(resumed[0]),
    }  # fmt: skip


# ---- errors -------------------------------------------------------------------------------------
def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return "no error"


class _BadState(ResidualQuantize):
    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["replicated"]["bad"] = self.value
        return state


class _RankDependent(ResidualQuantize):
    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["replicated"]["counter"] = torch.tensor([dist.get_rank()])
        return state


def errors_case(root: str) -> dict[str, Any]:
    """Strict and relaxed mismatches, a layout-bound hook at another bucket size, and states
    that cannot be saved."""
    ar = VARIANTS["ar"]["ddp"]
    path, plain_path, bound_path = (os.path.join(root, n) for n in ("err", "plain", "bound"))
    model, opt = build(ar)
    train(model, opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, model, opt)
    plain, plain_opt = build(ar, hook=None)
    train(plain, plain_opt, range(1))
    megabuf.save_checkpoint(plain_path, plain, plain_opt)
    bound, bound_opt = build(ar, hook=ResidualQuantize(layout_bound=True))
    train(bound, bound_opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(bound_path, bound, bound_opt)

    def load(target: str, hook: Any, ddp: dict[str, Any] = ar, **kw: Any) -> Callable[[], Any]:
        def run() -> Any:
            m, o = build(ddp, hook=hook)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                megabuf.load_checkpoint(target, m, o, **kw)
            return m, [str(w.message) for w in caught if "comm hook" in str(w.message)]

        return run

    def bound_hook() -> ResidualQuantize:
        return ResidualQuantize(layout_bound=True)

    relaxed_model, relaxed_warnings = load(plain_path, "default", strict_comm_hooks=False)()
    _, other_warnings = load(path, OtherStateful(), strict_comm_hooks=False)()
    from megabuf.comm_hooks import Compress

    return {
        "no_hook": _error(load(path, None)),
        "stateless_hook": _error(load(path, Compress(torch.bfloat16))),
        "other_class": _error(load(path, OtherStateful())),
        "no_saved_state": _error(load(plain_path, "default")),
        "relaxed_warnings": relaxed_warnings,
        "relaxed_step": hook_of(relaxed_model).step,
        "other_class_relaxed": other_warnings,
        "layout": _error(load(bound_path, bound_hook(), {**ar, "bucket_size": 400})),
        "layout_same": _error(load(bound_path, bound_hook())),
        "object": _error(lambda: megabuf.save_checkpoint(
            os.path.join(root, "x"), *build(ar, hook=_BadState(object())))),
        "group": _error(lambda: megabuf.save_checkpoint(
            os.path.join(root, "x"), *build(ar, hook=_BadState(dist.group.WORLD)))),
        "rank_dependent": _error(lambda: megabuf.save_checkpoint(
            os.path.join(root, "x"), *build(ar, hook=_RankDependent()))),
        "x_exists": os.path.exists(os.path.join(root, "x")),
    }  # fmt: skip


def pipeline_case(root: str) -> dict[str, Any]:
    """pp=2 x dp=2 (1F1B, tied embeddings on both stages), distributed optimizer, a hook on each
    stage's chunk: each stage's state is its own slot; a new engine resumes bitwise."""
    from checkpoint_cases import DISTOPT, _chunk_params, _pp_build, _pp_step

    def fresh() -> tuple[list[Any], Any]:
        torch.manual_seed(0)
        chunks, opt = _pp_build(DISTOPT)
        chunks[0].register_comm_hook(ResidualQuantize(start_step=1))
        return chunks, opt

    def run(chunks: list[Any], opt: Any, steps: range) -> None:
        for step in steps:
            if not _pp_step(chunks, opt, step)[0]:
                raise RuntimeError(f"step {step} was skipped")

    path = os.path.join(root, "pp2")
    chunks, opt = fresh()
    run(chunks, opt, range(SAVE_AFTER))
    megabuf.save_checkpoint(path, chunks, opt)
    at_save = snapshot(hook_of(chunks[0]))
    run(chunks, opt, range(SAVE_AFTER, TOTAL_STEPS))
    resumed, resumed_opt = fresh()
    megabuf.load_checkpoint(path, resumed, resumed_opt)
    loaded = snapshot(hook_of(resumed[0]))
    run(resumed, resumed_opt, range(SAVE_AFTER, TOTAL_STEPS))
    return {
        "at_save": at_save, "loaded": loaded,
        "uninterrupted": _chunk_params(chunks), "resumed": _chunk_params(resumed),
    }  # fmt: skip
