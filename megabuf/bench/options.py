"""Command line of the benchmark, the models it runs, and the optimizer every system uses."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

CHECK_ATOL = 1e-5  # params after one step vs the single-process step (each moved by <= lr)

# model preset -> samples per rank per step (sized so a full run stays under 10 minutes here)
DEFAULT_MODELS: dict[str, int] = {"gpt_small": 4, "mlp_34m": 64, "many_small": 32}
QUICK_MODELS: dict[str, int] = {"gpt_tiny": 4, "mlp_tiny": 8, "many_small": 8}

SYSTEM_NAMES: tuple[str, ...] = (
    "no_comm",
    "torch_ddp",
    "torch_ddp_gabv",
    "fsdp2_reshard",
    "fsdp2_no_reshard",
    "zero_ddp",
    "megabuf_ar_overlap",
    "megabuf_ar_auto",  # bucket_size="auto" ([Note: auto bucket re-plan]), re-planned in warm-up
    "megabuf_ar_sync",
    "megabuf_distopt_overlap",
    "megabuf_distopt_auto",  # the same, bucket_size="auto" (ZeRO-1 re-plan, sharded_replan.py)
    "megabuf_distopt_sync",
    "megabuf_zero3",
    "megabuf_zero3_noreshard",
    "megabuf_zero2",
    "megabuf_distopt_verify_collectives",  # megabuf_distopt_overlap + verify (issue 47)
    "megabuf_distopt_verify_replicas",
    "megabuf_distopt_verify_norms",
    "megabuf_distopt_verify_all",
    "mcore_ddp_overlap",  # megatron-core, when it imports, on CUDA ([Note: megatron-core peers])
    "mcore_distopt_overlap",
)
BASELINE = "torch_ddp_gabv"  # ratios are to torch DDP with gradient_as_bucket_view=True
FLOOR = "no_comm"


@dataclass(frozen=True, kw_only=True)
class BenchOptions:
    """Everything one benchmark run needs; built from the command line."""

    models: dict[str, int]
    """Preset name -> samples per rank per step."""
    systems: tuple[str, ...]
    world_size: int
    warmup: int
    """Untimed steps after the checked step."""
    steps: int
    """Timed steps; the table shows their median."""
    isolate: bool
    """One fresh set of rank processes per (model, system): peak RSS is that system's alone."""
    out: str
    """JSON lines file."""
    trace_dir: str | None
    """Write Chrome traces (torch.profiler) and PNG timelines here."""
    trace_steps: int = 3
    repeat: int = 1
    """Passes over every (model, system) pair, the order reversed on every other pass; the table
    shows each pair's median pass and ratios to the baseline taken pass by pass (median)."""
    retries: int = 0
    """How often a noisy job (see `noisy_share`) may be run again (isolated runs only)."""
    noisy_share: float = 0.10
    """A job is noisy when other processes used more than this share of the machine's CPU."""
    retry_budget_s: float = 480.0
    """No retry starts after this many seconds since the start (keeps `make bench` < 10 min)."""
    started_at: float = field(default_factory=time.perf_counter)
    megabuf_overrides: dict[str, object] = field(default_factory=dict)
    """DistributedDataParallelConfig fields set for every megabuf system (e.g. bucket_size)."""
    device: str = "cpu"
    """Where models and batches live: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)."""
    model_overrides: dict[str, int] = field(default_factory=dict)
    """GPTConfig fields set for every GPT preset (`--gpt-width/--gpt-depth/--gpt-seq-len`)."""
    hooks: tuple[str, ...] = ()
    """Comm-hook rows (megabuf/bench/hooks.py `HOOK_VARIANTS`), run on `hook_model` only."""
    hook_model: str = ""
    """The preset the hook rows train (with `hook_batch` samples per rank)."""
    hook_batch: int = 0


def parse_models(text: str) -> dict[str, int]:
    models: dict[str, int] = {}
    for item in text.split(","):
        name, _, batch = item.strip().partition(":")
        if not name:
            continue
        # a model of both lists runs at its full-run batch (many_small: 32, not --quick's 8)
        models[name] = int(batch) if batch else {**QUICK_MODELS, **DEFAULT_MODELS}.get(name, 8)
    if not models:
        raise ValueError(f"megabuf.bench: no models in {text!r}")
    return models


def parse_systems(text: str | None) -> tuple[str, ...]:
    """Comma list of system names; a megabuf system may carry a bucket size in elements,
    `megabuf_ar_overlap@262144` (a row of its own: bucket-size sweeps), and `+pyhooks`."""
    if not text:  # the verify mode's cost rows run only when named (BENCHMARKS.md)
        return tuple(s for s in SYSTEM_NAMES if "_verify_" not in s)
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if split_system(s)[0] not in SYSTEM_NAMES]
    if unknown:
        raise ValueError(f"megabuf.bench: unknown systems {unknown}; known: {list(SYSTEM_NAMES)}")
    return names


PYHOOKS = "+pyhooks"


def split_system(spec: str) -> tuple[str, dict[str, object]]:
    """`name@numel` -> (name, {"bucket_size": numel}); `name+pyhooks` -> (name,
    {"python_hooks": True}): a Python grad hook per param, no counted arrivals ([Note: counted
    arrivals] in megabuf/buckets/arrivals.py), to measure them in the same rounds; a plain name ->
    (name, {})."""
    python_hooks = spec.endswith(PYHOOKS)  # other '+' names are systems of their own
    if python_hooks:
        spec = spec.removesuffix(PYHOOKS)
        if not spec.startswith("megabuf_"):
            raise ValueError(
                f"megabuf.bench: {spec + PYHOOKS!r}: {PYHOOKS!r} follows a megabuf system, e.g. "
                "megabuf_ar_sync+pyhooks"
            )
    hooks: dict[str, object] = {"python_hooks": True} if python_hooks else {}
    name, at, size = spec.partition("@")
    if not at:
        return name, hooks
    if not name.startswith("megabuf_") or not size.isdigit() or int(size) < 1:
        raise ValueError(
            f"megabuf.bench: {spec!r}: '@' takes a bucket size in elements (an int >= 1) after a "
            "megabuf system, e.g. megabuf_ar_overlap@262144"
        )
    return name, {"bucket_size": int(size), **hooks}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megabuf.bench", description=__doc__)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: tiny models, 1 warm-up + 2 timed steps, one launch",
    )
    p.add_argument("--models", help="comma list of preset[:batch_per_rank], e.g. gpt_small:4")
    p.add_argument("--systems", help=f"comma list out of {', '.join(SYSTEM_NAMES)}")
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks (default: 2 on cpu, every visible GPU on cuda)",
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed warm steps (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 12)")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="run every system in one launch (faster; peak RSS then approximate)",
    )
    p.add_argument("--out", default="bench-results.jsonl", help="JSON lines output")
    p.add_argument("--trace", metavar="DIR", help="write Chrome traces and PNG timelines to DIR")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="passes over all jobs, order reversed every other pass; report each job's median "
        "pass and the median of its per-pass ratios (default 1)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=None,
        help="re-run jobs disturbed by other processes up to N times (default 1)",
    )
    p.add_argument(
        "--retry-budget",
        type=float,
        default=480.0,
        metavar="SECONDS",
        help="start no retry after this many seconds (default 480)",
    )
    p.add_argument(
        "--megabuf-bucket-size",
        type=int,
        metavar="NUMEL",
        help="bucket size (elements) for the megabuf systems (default: megabuf's)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: gloo ranks (default); cuda: NCCL, rank r on GPU r (never run yet)",
    )
    p.add_argument(
        "--hooks",
        help="comm-hook rows: comma list of megabuf/bench/hooks.py HOOK_VARIANTS names, 'all' "
        "or 'none' (default on a full run: Compress(bf16) and PowerSGD r=1/4 on megabuf and "
        "torch DDP; none with --quick or --systems)",
    )
    p.add_argument(
        "--hook-model",
        help="preset[:batch_per_rank] the hook rows train (default: the first GPT of --models)",
    )
    scale = p.add_argument_group("GPT size (every gpt_* model; batch: --models gpt_small:B)")
    scale.add_argument("--gpt-width", type=int, metavar="D", help="d_model (d_ff = 4D, D/64 heads)")
    scale.add_argument("--gpt-depth", type=int, metavar="L", help="transformer blocks")
    scale.add_argument("--gpt-seq-len", type=int, metavar="T", help="tokens per sample")
    return p


def gpt_overrides(width: int | None, depth: int | None, seq_len: int | None) -> dict[str, int]:
    """GPTConfig fields for the GPT size flags: width D sets d_model = D, d_ff = 4D and D/64
    heads (one below 64; above 64, D must be a multiple of 64), depth sets n_layers."""
    out: dict[str, int] = {}
    if width is not None:
        heads = max(1, width // 64)
        if width < 1 or (width > 64 and width % 64):
            raise ValueError(
                f"megabuf.bench: --gpt-width {width} must be >= 1 and a multiple of 64"
            )
        out.update(d_model=width, d_ff=4 * width, n_heads=heads)
    if depth is not None:
        out["n_layers"] = depth
    if seq_len is not None:
        out["seq_len"] = seq_len
    return out


def default_world_size(device: str, gpus: int) -> int:
    """2 gloo ranks on the CPU; one rank per visible GPU on CUDA (an error without any)."""
    if device != "cuda":
        return 2
    if gpus < 1:
        raise ValueError("megabuf.bench: --device cuda but no CUDA device is visible")
    return gpus


def parse_options(argv: Sequence[str]) -> BenchOptions:
    args = build_parser().parse_args(list(argv))
    quick = bool(args.quick)
    models = (
        parse_models(args.models) if args.models else (QUICK_MODELS if quick else DEFAULT_MODELS)
    )
    warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    steps = args.steps if args.steps is not None else (2 if quick else 12)
    world_size = args.world_size
    if world_size is None:
        world_size = default_world_size(
            args.device, _visible_gpus() if args.device == "cuda" else 0
        )
    hooks, (hook_model, hook_batch) = _hook_options(
        args.hooks, args.hook_model, quick or bool(args.systems), models
    )
    if steps < 1 or warmup < 0 or world_size < 1:
        raise ValueError("megabuf.bench: need --steps >= 1, --warmup >= 0, --world-size >= 1")
    return BenchOptions(
        models=dict(models), systems=parse_systems(args.systems), world_size=world_size,
        warmup=warmup, steps=steps, isolate=not (quick or args.no_isolate), out=args.out,
        trace_dir=args.trace, trace_steps=2 if quick else 3,
        retries=args.retries if args.retries is not None else (0 if quick else 1),
        retry_budget_s=args.retry_budget, repeat=max(1, args.repeat),
        megabuf_overrides={} if args.megabuf_bucket_size is None
        else {"bucket_size": args.megabuf_bucket_size},
        device=args.device,
        model_overrides=gpt_overrides(args.gpt_width, args.gpt_depth, args.gpt_seq_len),
        hooks=hooks, hook_model=hook_model, hook_batch=hook_batch,
    )  # fmt: skip


def _hook_options(
    text: str | None, model_text: str | None, narrowed: bool, models: dict[str, int]
) -> tuple[tuple[str, ...], tuple[str, int]]:
    """(hook rows, (model, batch per rank) they train): every variant on a full run, none when
    the run is narrowed (--quick, --systems) unless --hooks names some; on --hook-model, else
    the first GPT of `models` (else the first model) with its batch."""
    from megabuf.bench.hooks import DEFAULT_HOOKS, parse_hooks

    hooks = parse_hooks(text, () if narrowed else DEFAULT_HOOKS)
    if model_text:
        return hooks, next(iter(parse_models(model_text).items()))
    gpts = [m for m in models if m.startswith("gpt")]
    name = (gpts or list(models))[0]
    return hooks, (name, models[name])


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
