"""Communication-hook rows of the benchmark: megabuf with a hook next to torch DDP with torch's
equivalent hook, same model, data and run.

Each variant is a row of `HOOK_VARIANTS`: a megabuf one is `megabuf_ar_overlap` with a
`[comm_hook]` table (built by `megabuf.comm_hooks.build`, as the config does), a torch one is
`torch_ddp_gabv` with one of torch's hooks registered. A megabuf variant whose hook name `build`
does not know (a hook not in this installation) is skipped with a printed note, so the table
needs no code change when a hook is added. Every megabuf row names the torch row with the same
hook (`same_as`): the ratio the target is set on (megabuf <= 1.00x torch with the same hook).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.comm_hooks.telemetry import powersgd_factor_numels

# PowerSGD compresses from this step on (torch: start_powerSGD_iter, which must be > 1 with
# error feedback or warm start; megabuf: start_step). The checked step (0) and the warm-up steps
# before it are plain all-reduces, the timed steps (>= 1 + warmup >= 2) compress.
POWERSGD_START = 2
# A lossy hook's one-step check: AdamW moves each param by about lr at most, so an error above
# 2 lr means an update in the wrong direction (the exact-sum tolerance does not apply).
LOSSY_CHECK_ATOL = 2 * OPTIMIZER_KWARGS["lr"]
MEGABUF_BASE = "megabuf_ar_overlap"
TORCH_BASE = "torch_ddp_gabv"


@dataclass(frozen=True)
class HookVariant:
    """One hook row: which engine, the hook, and the torch row it is compared with."""

    engine: str  # "megabuf" | "torch"
    spec: dict[str, Any] = field(default_factory=dict)
    """megabuf: a `[comm_hook]` table; torch: {"hook": "bf16_compress" | "powersgd", "rank": r}."""
    same_as: str | None = None  # the torch row with the same hook (its step time is the 1.00x)
    lossy: bool = False


def _psgd(rank: int) -> dict[str, Any]:
    return {"name": "powersgd", "rank": rank, "start_step": POWERSGD_START}


HOOK_VARIANTS: dict[str, HookVariant] = {
    f"{MEGABUF_BASE}+reduce": HookVariant("megabuf", {"name": "reduce"}, TORCH_BASE),
    f"{MEGABUF_BASE}+bf16": HookVariant(
        "megabuf", {"name": "compress", "dtype": "bfloat16"}, f"{TORCH_BASE}+bf16", True
    ),
    f"{MEGABUF_BASE}+bf16_fp32acc": HookVariant(
        "megabuf",
        {"name": "compress", "dtype": "bfloat16", "accumulate": "fp32"},
        f"{TORCH_BASE}+bf16",
        True,
    ),
    f"{MEGABUF_BASE}+powersgd_r1": HookVariant(
        "megabuf", _psgd(1), f"{TORCH_BASE}+powersgd_r1", True
    ),
    f"{MEGABUF_BASE}+powersgd_r4": HookVariant(
        "megabuf", _psgd(4), f"{TORCH_BASE}+powersgd_r4", True
    ),
    f"{TORCH_BASE}+bf16": HookVariant("torch", {"hook": "bf16_compress"}, lossy=True),
    f"{TORCH_BASE}+powersgd_r1": HookVariant("torch", {"hook": "powersgd", "rank": 1}, lossy=True),
    f"{TORCH_BASE}+powersgd_r4": HookVariant("torch", {"hook": "powersgd", "rank": 4}, lossy=True),
}
"""Every hook row the benchmark knows; `--hooks` picks some (`DEFAULT_HOOKS` on a full run)."""
DEFAULT_HOOKS: tuple[str, ...] = tuple(
    n for n in HOOK_VARIANTS if not n.endswith(("+reduce", "+bf16_fp32acc"))
)
"""The issue's rows: Compress(bf16), PowerSGD r=1 and r=4, and torch's same hooks (about 25 s
each on gpt_small here); `--hooks all` adds megabuf+Reduce and Compress with fp32 sums."""


def parse_hooks(text: str | None, default: Sequence[str]) -> tuple[str, ...]:
    """`--hooks` (comma list of `HOOK_VARIANTS` names, "all" or "none") -> the variants to run,
    each megabuf variant's torch row added after it if missing, in table order."""
    if text is None:
        names: list[str] = list(default)
    elif text.strip() in ("", "none"):
        return ()
    elif text.strip() == "all":
        names = list(HOOK_VARIANTS)
    else:
        names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in HOOK_VARIANTS]
    if unknown:
        raise ValueError(
            f"megabuf.bench: unknown --hooks {unknown}; known: {list(HOOK_VARIANTS)}, all, none"
        )
    wanted = set(names)
    for name in names:
        same = HOOK_VARIANTS[name].same_as
        if same in HOOK_VARIANTS:
            wanted.add(same)
    return tuple(n for n in HOOK_VARIANTS if n in wanted)


def baselines_needed(hooks: Sequence[str]) -> set[str]:
    """Plain systems the hook rows are compared with (torch DDP for megabuf+reduce)."""
    return {
        v.same_as
        for v in (HOOK_VARIANTS[h] for h in hooks)
        if v.same_as and v.same_as not in HOOK_VARIANTS
    }


def unavailable_reason(name: str) -> str | None:
    """Why variant `name` cannot run in this installation (its megabuf hook is not registered in
    `megabuf.comm_hooks.build`, or rejects its options), else None."""
    variant = HOOK_VARIANTS[name]
    if variant.engine != "megabuf":
        return None
    from megabuf.comm_hooks import build

    try:
        build(dict(variant.spec))
    except ValueError as exc:
        return f"comm hook {variant.spec.get('name')!r} not available: {exc}"
    return None


def hook_check_atol(system: str, exact_atol: float) -> float:
    """The one-step check's tolerance for `system`: the exact one unless its hook is lossy."""
    variant = HOOK_VARIANTS.get(system)
    return LOSSY_CHECK_ATOL if variant is not None and variant.lossy else exact_atol


def _bf16_compress_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook`, called unchanged. torch DDP refuses to register it by its
    name without CUDA + NCCL >= 2.10 (a guard in `_check_comm_hook`), but it runs on gloo CPU,
    which all-reduces bf16; under another name it registers."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


_bf16_compress_hook.__annotations__ = {}  # torch checks them against its own classes, not strings


ONE_BUCKET_MB = 1e6
"""torch DDP's `bucket_cap_mb` for the PowerSGD rows: one bucket (see `torch_bucket_cap_mb`)."""


def torch_bucket_cap_mb(spec: dict[str, Any]) -> float | None:
    """torch DDP's bucket size for a torch hook row: its default, except one bucket for
    powerSGD_hook. [Note: torch PowerSGD on gloo] torch's hook issues its second all-reduce
    from the first one's Future callback, which gloo runs on its own thread, while autograd's
    thread issues the next bucket's first all-reduce: the two ranks can enqueue them in
    different orders. With several buckets the run aborts with gloo's "Received data size
    doesn't match expected size" (seen on gpt_small, 2026-11-23). One bucket leaves nothing to
    race, at the cost of torch's overlap; megabuf runs its stages without threads."""
    return ONE_BUCKET_MB if spec.get("hook") == "powersgd" else None


def register_torch_hook(ddp: Any, spec: dict[str, Any], group: Any) -> None:
    """Register torch's hook for `spec` on a torch DDP model."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if spec["hook"] == "bf16_compress":
        ddp.register_comm_hook(group, _bf16_compress_hook)
        return
    if spec["hook"] == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=int(spec["rank"]),
            start_powerSGD_iter=POWERSGD_START,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    raise ValueError(f"megabuf.bench: unknown torch hook spec {spec}")


def torch_hook_ring_nbytes(module: nn.Module, spec: dict[str, Any], dp: int) -> int:
    """The ring figure of torch DDP with hook `spec` per step (after PowerSGD's start), for the
    model's params as one bucket: bf16 halves fp32's bytes; PowerSGD all-reduces its P and Q
    factors and the uncompressed rest."""
    params = [p for p in module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    size = params[0].element_size() if params else 4
    if spec["hook"] == "bf16_compress":
        return 2 * (dp - 1) * numel * 2 // dp
    p_numel, q_numel, compressed = powersgd_factor_numels(
        [tuple(p.shape) for p in params], int(spec["rank"]), 2.0
    )
    return 2 * (dp - 1) * (numel - compressed + p_numel + q_numel) * size // dp


def build_hooked(name: str, module: nn.Module, pgs: Any, overrides: dict[str, Any]) -> Any:
    """The `Engine` of hook variant `name`; its `theoretical_nbytes` is the hook's formula
    (megabuf: `wire_formula` over its buckets; torch: `torch_hook_ring_nbytes`)."""
    from megabuf.bench.systems import build_megabuf, build_torch_ddp_gabv
    from megabuf.comm_hooks.telemetry import hooked_buckets, wire_formula

    variant = HOOK_VARIANTS[name]
    if variant.engine == "megabuf":
        engine = build_megabuf(MEGABUF_BASE, module, pgs, {**overrides, "comm_hook": variant.spec})
        formulas = [wire_formula(variant.spec, b) for _, b in hooked_buckets(engine.ddp)]
        if None not in formulas:
            engine.theoretical_nbytes = sum(f or 0 for f in formulas)
        engine.notes.append(f"comm_hook {variant.spec}")
        return engine
    engine = build_torch_ddp_gabv(module, pgs, bucket_cap_mb=torch_bucket_cap_mb(variant.spec))
    register_torch_hook(engine.model, variant.spec, pgs.dp)
    engine.theoretical_nbytes = torch_hook_ring_nbytes(module, variant.spec, pgs.dp_size)
    engine.notes.append(f"torch hook {variant.spec}")
    return engine
