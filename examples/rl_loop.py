"""The RL / colocated-training loop on megabuf: train a step, publish the new weights to an
inference rank, offload, let inference run, restore (docs/rl-and-colocated-training.md).

    python examples/rl_loop.py --check            # 2 trainer ranks + 1 consumer rank, on CPU
    torchrun --nproc-per-node 3 examples/rl_loop.py

Ranks 0 .. n-2 train `gpt_tiny` data-parallel under `--strategy` (ZeRO-3 by default); the last
rank stands for an inference engine: after every step it receives the weights in bf16 (each
trainer sends its own shard of every bucket: nothing is gathered on rank 0; after the first
version only the changed elements, where that is smaller), loads them into its own copy of the
model and samples a few greedy tokens. The publish is asynchronous (`start_publish`: the sends
go on from a snapshot while the trainers are offloaded; their params, grads and optimizer state
hold no memory) and the trainers are restored when inference is done. `--check` compares, for
every version, the consumer's weights with the trainers' (bitwise, in bf16) and says how many
bytes each offload released and each publish sent.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

if importlib.util.find_spec("megabuf") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.testing import PRESETS, build_model, corpus_tokens, gpt_loss, lm_batches, spawn
from megabuf.weights import Publisher, WeightReceiver, offload, publish_group, restore


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=3, help="ranks to spawn (no torchrun)")
    parser.add_argument("--check", action="store_true")
    return parser.parse_args(argv)


def trainer(args: argparse.Namespace, dp_group: Any, group: Any) -> dict[str, Any]:
    pgs = megabuf.ProcessGroups.for_dp_group(dp_group)
    config = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=args.strategy)
    model = megabuf.DistributedDataParallel(
        build_model("gpt_tiny", seed=0), config, process_groups=pgs
    )
    opt = megabuf.build_optimizer(model, megabuf.OptimizerConfig(optimizer="adamw", lr=1e-3))
    publisher = Publisher(model, group, track_changes=True)  # host copies: element deltas
    cfg = PRESETS["gpt_tiny"]
    tokens = corpus_tokens(10_000, cfg.vocab_size, seed=0)  # type: ignore[union-attr]
    local = args.global_batch // pgs.dp_size
    versions, released, sent = [], [], []
    for step in range(args.steps):
        x, y = lm_batches(tokens, args.global_batch, cfg.seq_len, step)  # type: ignore[union-attr]
        lo = pgs.dp_rank * local
        opt.zero_grad()
        gpt_loss(model(x[lo : lo + local]), y[lo : lo + local]).backward()
        opt.step()
        # 1. fresh weights out: changed elements only, sent from a snapshot in the background
        pending = publisher.start_publish(optimizer=opt, dtype=torch.bfloat16, delta=True)
        versions.append({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
        report = offload(model, opt)  # 2. out of the way: inference has the memory
        released.append(report.total_nbytes)
        dist.barrier(group.group)  # 3. inference runs on the consumer
        pending.wait()  # long done: the consumer received before its barrier
        sent.append(publisher.sent_nbytes)
        restore(model, opt)  # 4. back, bitwise
    return {"versions": versions, "released": released, "sent": sent}


def consumer(args: argparse.Namespace, group: Any) -> dict[str, Any]:
    receiver = WeightReceiver(group)
    policy = build_model("gpt_tiny", seed=1, dtype=torch.bfloat16)  # the inference engine's copy
    versions, samples = [], []
    for _ in range(args.steps):
        weights = receiver.receive()
        # trainable params only: a tied alias (lm_head = tok_emb) comes with its first name
        missing, unexpected = policy.load_state_dict(weights, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
            raise RuntimeError(f"weights do not fit the policy: {missing} {unexpected}")
        versions.append({k: v.clone() for k, v in weights.items()})
        prompt = torch.zeros(1, 4, dtype=torch.long)
        with torch.no_grad():
            for _ in range(4):  # greedy sampling: the "rollout"
                nxt = policy(prompt)[:, -1].argmax(-1, keepdim=True)
                prompt = torch.cat([prompt, nxt], dim=1)
        samples.append(prompt[0].tolist())
        dist.barrier(group.group)  # inference done: the trainers may restore
    return {"versions": versions, "samples": samples, "version": receiver.version}


def run(args: argparse.Namespace) -> dict[str, Any]:
    megabuf.init_distributed(device="cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    trainers = list(range(world - 1))
    dp_group = dist.new_group(trainers)  # every rank creates every group, in the same order
    group = publish_group(trainers, [world - 1], timeout_s=120)
    if rank < world - 1:
        return {"role": "trainer", **trainer(args, dp_group, group)}
    return {"role": "consumer", **consumer(args, group)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = spawn(run, args.world_size, args)
    trainer0, last = results[0], results[-1]
    print(f"consumer received versions 1..{last['version']}; samples {last['samples']}")
    print(f"each offload released {trainer0['released'][0]} bytes on trainer rank 0")
    print(f"trainer rank 0 sent {trainer0['sent']} bytes per version (a delta only where smaller)")
    if not args.check:
        return 0
    same = all(
        got.keys() <= want.keys() and all(torch.equal(got[k], want[k]) for k in got)
        for got, want in zip(last["versions"], trainer0["versions"], strict=True)
    )
    print(f"check: consumer weights == trainers' (bf16) at every version: {same} -> "
          f"{'OK' if same else 'FAILED'}")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
