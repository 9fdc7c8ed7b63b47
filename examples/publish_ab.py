"""Weight publishing to consumer ranks: megabuf's `Publisher` against the naive way (BENCHMARKS.md,
issue 27).

2 trainer ranks train `gpt_small` under ZeRO-3 (optim_grads_params); C consumer ranks (1 or 2)
want its weights after the step. Two ways, alternated REPEATS times after one training step:
- megabuf: `Publisher.publish()`: every trainer sends its own shard of every bucket to every
  consumer (nothing gathered), one bucket in flight at a time;
- naive: `model.state_dict()` (gathers every unit on every trainer), then rank 0 broadcasts each
  tensor to the consumers over a group of rank 0 and the consumers.
Time: from a barrier of all ranks to the last rank done (max over ranks), median of the repeats.
Bytes: payload bytes leaving trainer ranks (megabuf: every trainer's slices x consumers; naive:
rank 0's tensors x consumers, as if sent point to point). Prints one JSON line per way:

    python examples/publish_ab.py --consumers 1 [--dtype bfloat16]
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


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took.item())


def run(args: argparse.Namespace) -> dict[str, Any]:
    megabuf.init_distributed(device="cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    consumers = list(range(TRAINERS, world))
    dp_group = dist.new_group(list(range(TRAINERS)))
    naive_group = dist.new_group([0, *consumers])
    group = publish_group(list(range(TRAINERS)), consumers, timeout_s=600)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    shapes = {k: v for k, v in build_model("gpt_small", seed=0).state_dict().items()}
    if rank < TRAINERS:
        pgs = megabuf.ProcessGroups.for_dp_group(dp_group)
        config = megabuf.DistributedDataParallelConfig(
            data_parallel_sharding_strategy="optim_grads_params"
        )
        model = megabuf.DistributedDataParallel(
            build_model("gpt_small", seed=0), config, process_groups=pgs
        )
        opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw"))
        cfg = PRESETS["gpt_small"]
        tokens = corpus_tokens(10_000, cfg.vocab_size, seed=0)  # type: ignore[union-attr]
        x, y = lm_batches(tokens, 4, cfg.seq_len, 0)  # type: ignore[union-attr]
        opt.zero_grad()
        gpt_loss(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
        opt.step()
        publisher = Publisher(model, group)
    else:
        receiver = WeightReceiver(group)
    times: dict[str, list[float]] = {"megabuf": [], "naive": []}
    sent: dict[str, int] = {}
    for repeat in range(args.repeats):

        def megabuf_way(version: int = repeat + 1) -> None:
            if rank < TRAINERS:
                publisher.publish(version=version, dtype=dtype)
            else:
                receiver.receive()

        def naive_way() -> None:
            state = model.state_dict() if rank < TRAINERS else shapes
            if rank == 1:
                return
            for tensor in state.values():
                out = tensor.to(dtype) if dtype is not None else tensor.clone()
                dist.broadcast(out, src=0, group=naive_group)

        times["megabuf"].append(_timed(megabuf_way))
        times["naive"].append(_timed(naive_way))
    if rank < TRAINERS:
        total = torch.tensor([publisher.sent_nbytes], dtype=torch.float64)
        dist.all_reduce(total, group=dp_group)
        sent["megabuf"] = int(total.item())
        item = torch.finfo(dtype).bits // 8 if dtype is not None else 4
        sent["naive"] = sum(t.numel() for t in shapes.values()) * item * len(consumers)
    return {"times": times, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--consumers", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    result = spawn(run, TRAINERS + args.consumers, args)[0]
    for way in ("megabuf", "naive"):
        print(json.dumps({
            "way": way, "consumers": args.consumers, "dtype": args.dtype or "float32",
            "median_s": round(statistics.median(result["times"][way]), 4),
            "times_s": [round(t, 4) for t in result["times"][way]],
            "bytes": result["sent"][way],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
