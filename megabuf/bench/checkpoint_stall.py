"""How long a checkpoint save stalls training: synchronous vs asynchronous `save_checkpoint`.

`python -m megabuf.bench.checkpoint_stall [--model gpt_small] [--dp 2] [--saves 3]` trains the
model with the distributed optimizer (AdamW, overlap on) on `--dp` CPU ranks and reports, per
mode, the median over `--saves` saves of
- `call_ms`: how long `save_checkpoint` blocks the training loop;
- `wait_ms`: how long `handle.wait()` then took (checksums, metadata.json, the commit; for an
  asynchronous save also what DCP had not yet written after the window);
- `stall_ms`: the time of the save call, the `--window` steps after it and the wait for the
  save to be committed, minus the time of `--window` steps without a save taken just before
  (paired, modes interleaved, so a drifting machine shifts both alike; an asynchronous save
  writes in the background and competes with those steps for the cores);
and the median step time without saves. One JSON line per mode goes to stdout's last lines.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import megabuf
from megabuf.testing import spawn
from megabuf.testing.models import build_model, loss_fn, make_batch

CONFIG = megabuf.DistributedDataParallelConfig(
    use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True
)


def _step(model: Any, opt: Any, name: str, batch: int, seed: int) -> float:
    start = time.perf_counter()
    x, y = make_batch(name, batch, seed)
    opt.zero_grad()
    loss_fn(name)(model(x), y).backward()
    model.finish_grad_sync()
    opt.step()
    return time.perf_counter() - start


def _window(model: Any, opt: Any, args: argparse.Namespace, seed: int) -> float:
    return sum(_step(model, opt, args.model, args.batch, seed + k) for k in range(args.window))


def _stall(model: Any, opt: Any, args: argparse.Namespace, path: Path, mode: str) -> dict:
    """One paired measurement: `window` steps without a save, then a save and `window` steps."""
    reference = _window(model, opt, args, 0)
    start = time.perf_counter()
    handle = megabuf.save_checkpoint(path, model, opt, async_save=mode == "async")
    call = time.perf_counter() - start
    steps = _window(model, opt, args, args.window)
    waited = time.perf_counter()
    handle.wait()
    wait = time.perf_counter() - waited
    spent = call + steps + wait
    return {"call": call, "wait": wait, "stall": spent - reference, "step": reference / args.window}


def _rank_main(args: argparse.Namespace, root: str) -> list[dict]:
    megabuf.init_distributed()
    model = megabuf.DistributedDataParallel(build_model(args.model), CONFIG)
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-4))
    for seed in range(2):  # warm-up
        _step(model, opt, args.model, args.batch, seed)
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for i in range(args.saves):  # modes interleaved: both see the same machine
        for mode, out in runs.items():
            out.append(_stall(model, opt, args, Path(root) / f"{mode}{i}", mode))
    return [
        {"mode": mode, "model": args.model, "dp": args.dp, "saves": args.saves,
         "window": args.window,
         **{f"{k}_ms": 1e3 * statistics.median(r[k] for r in out)
            for k in ("step", "call", "wait", "stall")}}
        for mode, out in runs.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt_small")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="samples per rank per step")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--window", type=int, default=3, help="steps timed after each save")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = p.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="megabuf-stall-"))
    try:
        results = spawn(_rank_main, args.dp, args, str(root))[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r in results:
        print(
            f"{r['model']} dp={r['dp']} {r['mode']:5s} save call {r['call_ms']:8.1f} ms  "
            f"wait {r['wait_ms']:7.1f} ms  stall {r['stall_ms']:8.1f} ms  "
            f"(step {r['step_ms']:.1f} ms)"
        )
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
