"""The `megabuf` console script: `megabuf inspect`, `megabuf plan` and `megabuf bench`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from megabuf.config import DistributedDataParallelConfig


def _parse_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    try:
        return int(text.replace("_", ""))
    except ValueError:
        return text


def load_config(path: str | None, overrides: Sequence[str]) -> DistributedDataParallelConfig:
    """A TOML file (or the defaults) with `key=value` overrides applied."""
    cfg = DistributedDataParallelConfig.from_toml(path) if path else DistributedDataParallelConfig()
    changes = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"megabuf: --set expects key=value, got {item!r}")
        key = key.strip()
        changes[key] = _parse_value(value.strip())
        if key == "shard_units":  # a comma-separated list of class names or module paths
            changes[key] = tuple(u.strip() for u in value.split(",") if u.strip())
    # the strategy and its alias follow each other unless both are set
    pair = ("data_parallel_sharding_strategy", "use_distributed_optimizer")
    for mine, other in (pair, pair[::-1]):
        if mine in changes and other not in changes:
            changes[other] = None
    return DistributedDataParallelConfig.from_dict({**cfg.__dict__, **changes}) if changes else cfg


def _inspect_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "inspect",
        help="print the buffers, buckets and bucket groups megabuf builds for a model",
        description="Lay out a model as DistributedDataParallel would at a fake dp size "
        "(no process group is started).",
    )
    p.add_argument("model", help="a preset (gpt_tiny, gpt_small, mlp_34m, many_small, ...) "
                   "or package.module:factory")  # fmt: skip
    p.add_argument("--config", help="a TOML config (e.g. configs/distopt_overlap.toml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set bucket_size=1000000 or "
                   "--set shard_units=Block,lm_head (comma-separated)")  # fmt: skip
    p.add_argument("--dp-size", type=int, default=2, help="data-parallel size (default 2)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (default 1)")
    p.add_argument("--dp-shard-size", type=int, default=None,
                   help="hybrid sharding: ranks per shard group (dp = replicas x this); or "
                   "--set num_distributed_optimizer_instances=R")  # fmt: skip
    p.add_argument("--disable-bucketing", action="store_true")
    p.add_argument("--bucket-ends", metavar="ENDS",
                   help="show a bucket_size=auto re-plan: the bucket_ends it logged, e.g. "
                   "'14,21,26' (buffers separated by ';')")  # fmt: skip
    p.add_argument("--params", action="store_true", help="list every param of every bucket")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run_inspect(args: argparse.Namespace) -> int:
    from megabuf.inspect import format_inspection, inspect_model, inspection_to_dict, load_model
    from megabuf.pure.bucket_planner import parse_bucket_ends

    config = load_config(args.config, args.set)
    model = load_model(args.model)
    info = inspect_model(
        model, config, args.dp_size, model_name=args.model, ep_size=args.ep_size,
        disable_bucketing=args.disable_bucketing, dp_shard_size=args.dp_shard_size,
        bucket_ends=parse_bucket_ends(args.bucket_ends) if args.bucket_ends else None,
    )  # fmt: skip
    if args.json:
        print(json.dumps(inspection_to_dict(info), indent=1))
    else:
        print(format_inspection(info, show_params=args.params))
    return 0


def _parse_nbytes(text: str) -> int:
    """Bytes, with an optional binary suffix: 123456, 80GiB, 512MiB, 2.5GB."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10**3,
             "mb": 10**6, "gb": 10**9, "tb": 10**12, "b": 1}  # fmt: skip
    lowered = text.strip().lower().replace("_", "")
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered.removesuffix(suffix)) * scale)
    return int(lowered)


def _plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "plan",
        help="choose the configuration that fits a device byte budget (docs/memory-planning.md)",
        description="Predict every candidate configuration's bytes and exposed communication "
        "for a model and choose the one that fits (no process group is started).",
    )
    p.add_argument("model", help="a preset (gpt_tiny, gpt_small, ...) or package.module:factory")
    p.add_argument("--budget", required=True, type=_parse_nbytes,
                   help="device bytes per rank, e.g. 80GiB or 1500000")  # fmt: skip
    p.add_argument("--host-budget", type=_parse_nbytes, default=None, help="host bytes per rank")
    p.add_argument("--dp-size", type=int, default=2, help="data-parallel size (default 2)")
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (default 1)")
    p.add_argument("--optimizer", default="adam", help="adam, adamw or sgd (default adam)")
    p.add_argument("--activations", type=_parse_nbytes, default=0,
                   help="activation bytes of one step at your micro-batch (default 0)")  # fmt: skip
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="forward + backward milliseconds of one step (overlap window)")  # fmt: skip
    p.add_argument("--margin", type=float, default=0.1, help="share of the budget kept free")
    p.add_argument("--accelerator", action="store_true",
                   help="params on an accelerator (cpu_offload candidates; NCCL: no landing "
                   "zones)")  # fmt: skip
    p.add_argument("--config", help="a TOML config whose other fields are kept")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")


def run_plan(args: argparse.Namespace) -> int:
    from megabuf.inspect import load_model
    from megabuf.training.budget import plan_for_budget

    config = load_config(args.config, args.set)
    if not args.config and not args.set:
        config = config.replace(overlap_grad_reduce=True)
    choice = plan_for_budget(
        load_model(args.model), args.budget, optimizer=args.optimizer, dp_size=args.dp_size,
        ep_size=args.ep_size, host_budget_nbytes=args.host_budget,
        activation_nbytes=args.activations, step_compute_s=args.step_ms / 1e3, config=config,
        margin=args.margin, gloo=not args.accelerator, accelerator=args.accelerator,
    )  # fmt: skip
    if args.json:
        print(json.dumps(choice.to_dict(), indent=1, default=str))
    else:
        print(choice.format())
    return 0 if choice.chosen is not None else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to megabuf.bench
        from megabuf.bench.main import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="megabuf", description="megabuf tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _inspect_parser(sub)
    _plan_parser(sub)
    sub.add_parser("bench", help="run the benchmark (see `megabuf bench --help`)")
    args = parser.parse_args(argv)
    try:
        return run_plan(args) if args.command == "plan" else run_inspect(args)
    except (ValueError, TypeError) as exc:
        print(f"megabuf {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `megabuf inspect ... | head`
        # Python flushes stdout at exit and would raise again: point it at /dev/null for good.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - must outlive this function
        return 0


if __name__ == "__main__":
    sys.exit(main())
