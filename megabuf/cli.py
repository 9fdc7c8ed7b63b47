"""The `megabuf` console script: `megabuf inspect ...` and `megabuf bench ...`."""

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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after "bench" belongs to megabuf.bench
        from megabuf.bench.main import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="megabuf", description="megabuf tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _inspect_parser(sub)
    sub.add_parser("bench", help="run the benchmark (see `megabuf bench --help`)")
    args = parser.parse_args(argv)
    try:
        return run_inspect(args)
    except (ValueError, TypeError) as exc:
        print(f"megabuf inspect: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `megabuf inspect ... | head`
        # Python flushes stdout at exit and would raise again: point it at /dev/null for good.
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - must outlive this function
        return 0


if __name__ == "__main__":
    sys.exit(main())
