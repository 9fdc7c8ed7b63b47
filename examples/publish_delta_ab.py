"""Bytes and time per published version: whole, changed buckets, element deltas; and the step
time of asynchronous publishing against none (BENCHMARKS.md, issue 44).

2 trainer ranks train a GPT preset under ZeRO-3 with AdamW at an RL-like learning rate; 1
consumer rank receives in bf16. After every training step the same weights are published three
ways, each by its own `Publisher` to its own `WeightReceiver` (so each way's "previous version"
is the last step's): whole (`publish()`), changed buckets (`changed_only=True`) and element
deltas (`delta=True`; the first version is whole for every way and is left out). The density is
the fraction of bf16 weight elements that changed in the step. Then STEPS more steps are timed
alone and with `start_publish(delta=True)` before each step and `wait()` after it. Time: from a
barrier of all ranks to the last rank done (max over ranks), median. Prints JSON lines:

    python examples/publish_delta_ab.py [--model gpt_small] [--lr 1e-5] [--steps 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if importlib.util.find_spec("megabuf") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.testing import PRESETS, build_model, corpus_tokens, gpt_loss, lm_batches, spawn
from megabuf.weights import Publisher, WeightReceiver, publish_group

TRAINERS = 2
WAYS = {"whole": {}, "changed_buckets": {"changed_only": True}, "delta": {"delta": True}}


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def _step(model: Any, opt: Any, args: argparse.Namespace, step: int, rank: int) -> None:
    cfg = PRESETS[args.model]
    tokens = corpus_tokens(10_000, cfg.vocab_size, seed=0)  # type: ignore[union-attr]
    x, y = lm_batches(tokens, 4, cfg.seq_len, step)  # type: ignore[union-attr]
    opt.zero_grad()
    gpt_loss(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
    opt.step()


def run(args: argparse.Namespace) -> dict[str, Any]:
    megabuf.init_distributed(device="cpu")
    rank = dist.get_rank()
    dp_group = dist.new_group(list(range(TRAINERS)))
    group = publish_group(list(range(TRAINERS)), [TRAINERS], timeout_s=600)
    trainer = rank < TRAINERS
    if trainer:
        config = megabuf.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params"
        )
        pgs = megabuf.ProcessGroups.for_dp_group(dp_group)
        model = megabuf.DistributedDataParallel(
            build_model(args.model, seed=0), config, process_groups=pgs
        )
        opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw", lr=args.lr))
        ends = {w: Publisher(model, group, track_changes=True) for w in WAYS}
    else:
        ends = {w: WeightReceiver(group) for w in WAYS}  # type: ignore[misc]
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    nbytes: dict[str, list[int]] = {w: [] for w in WAYS}
    density: list[float] = []
    before: dict[str, torch.Tensor] = {}
    for version in range(1, args.steps + 2):
        if trainer:
            _step(model, opt, args, version, rank)
            now = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
            if before:
                moved = sum(int((now[k] != before[k]).sum()) for k in now)
                density.append(moved / sum(t.numel() for t in now.values()))
            before = now
        for way, kwargs in WAYS.items():

            def publish(
                way: str = way, kwargs: dict[str, Any] = kwargs, version: int = version
            ) -> None:
                end = ends[way]
                if trainer:
                    end.publish(version=version, dtype=torch.bfloat16, **kwargs)  # type: ignore[union-attr]
                else:
                    end.receive()  # type: ignore[union-attr]

            took = _timed(publish)
            sent = torch.tensor([ends[way].sent_nbytes if trainer else 0])  # type: ignore[union-attr]
            dist.all_reduce(sent)
            if version > 1:
                times[way].append(took)
                nbytes[way].append(int(sent.item()))
    step_s: dict[str, list[float]] = {"no_publish": [], "async_publish": []}
    publisher = ends["delta"]
    for i in range(args.steps):
        base = args.steps + 2 + 2 * i
        step_s["no_publish"].append(
            _timed(lambda base=base: _step(model, opt, args, base, rank) if trainer else None)
        )

        def overlapped(version: int = base + 1) -> None:
            if not trainer:
                ends["delta"].receive()  # type: ignore[union-attr]
                return
            pending = publisher.start_publish(  # type: ignore[union-attr]
                version=version + 100, dtype=torch.bfloat16, delta=True
            )
            _step(model, opt, args, version, rank)
            pending.wait()

        step_s["async_publish"].append(_timed(overlapped))
    return {"times": times, "bytes": nbytes, "density": density, "step_s": step_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    result = spawn(run, TRAINERS + 1, args)[0]
    density = [round(d, 4) for d in result["density"]]
    for way in WAYS:
        print(json.dumps({
            "way": way, "model": args.model, "lr": args.lr, "density": density,
            "bytes_per_version": result["bytes"][way],
            "median_s": round(statistics.median(result["times"][way]), 4),
        }))  # fmt: skip
    for way, times in result["step_s"].items():
        print(json.dumps({"step": way, "median_s": round(statistics.median(times), 4)}))


if __name__ == "__main__":
    main()
