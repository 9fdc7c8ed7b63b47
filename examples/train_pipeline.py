"""Train a small GPT with pipeline x data parallelism (PP=2 x DP=2) on 4 CPU ranks.

    python examples/train_pipeline.py                           # spawns 4 CPU ranks by itself
    torchrun --nproc-per-node 4 examples/train_pipeline.py      # or let torchrun start them
    python examples/train_pipeline.py --check                   # and compare with one process

What every rank does (configs/pipeline.toml):

1. `megabuf.init_distributed(pp_size=2)` lays the ranks out as (pp, dp): ranks 0, 1 are stage 0
   and ranks 2, 3 stage 1 (see [Note: rank order] in megabuf/transport/process_groups.py).
2. The GPT is cut into pp_size * chunks stages (`megabuf.testing.stages.split_gpt`); this rank
   keeps chunk c = stage c * pp_size + pp_rank. The first and last stage each hold a copy of the
   tied word embedding, marked `shared_embedding`.
3. `megabuf.wrap_model_chunks` wraps the chunks (one bucket group on later stages and chunks,
   where DP communication is off the critical path), `megabuf.build_optimizer` builds the
   (distributed) optimizer, `megabuf.default_schedule_hooks` wires no_sync / start_grad_sync /
   start_param_sync / finalize_model_grads into the schedule as Megatron's training loop does.
4. Each step, `get_forward_backward_func(pp_size, chunks)` runs 1F1B (or interleaved 1F1B) over
   the micro-batches, sending activations and grads between stages point-to-point;
   `finalize_model_grads` sums the tied embedding grads of the first and last stage.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    import megabuf
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import megabuf
from megabuf.config import tomllib
from megabuf.testing import GPT, GPTConfig, corpus_tokens, gpt_loss, lm_batches, spawn
from megabuf.testing.stages import split_gpt, stage_index

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "pipeline.toml")
    parser.add_argument("--steps", type=int, default=None, help="override [pipeline] steps")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    return parser.parse_args(argv)


def forward_step(data_iterator: Any, model: Any) -> Any:
    tokens, targets = next(data_iterator)
    logits = model(tokens)  # stages after the first read their input from set_input_tensor
    return logits, partial(_loss, targets)


def _loss(targets: torch.Tensor, logits: torch.Tensor) -> Any:
    loss = gpt_loss(logits, targets)
    return loss, {"loss": float(loss.detach())}


def train(config_path: Path, steps_override: int | None) -> dict[str, Any]:
    with open(config_path, "rb") as f:
        raw = tomllib.load(f)
    pipe, gcfg = raw["pipeline"], GPTConfig(**raw["model"])
    steps = steps_override or pipe["steps"]
    pp, n_chunks, m_count, mbs = (pipe[k] for k in ("pp_size", "chunks", "microbatches",
                                                    "micro_batch_size"))  # fmt: skip
    pgs = megabuf.init_distributed(pp_size=pp)
    stages = split_gpt(GPT(gcfg, seed=0), pp * n_chunks)
    mine = [stages[stage_index(pgs.pp_rank, c, pp)] for c in range(n_chunks)]
    ddp_cfg = megabuf.DistributedDataParallelConfig.from_toml(config_path)
    chunks = megabuf.wrap_model_chunks(mine, ddp_cfg, pgs)
    opt = megabuf.build_optimizer(chunks, megabuf.OptimizerConfig.from_toml(config_path))
    hooks = megabuf.default_schedule_hooks(chunks)
    schedule = megabuf.get_forward_backward_func(pp, n_chunks)
    tokens = corpus_tokens(20_000, gcfg.vocab_size, seed=0)
    rows = pgs.dp_size * m_count * mbs
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = lm_batches(tokens, rows, gcfg.seq_len, step)
        lo = pgs.dp_rank * m_count * mbs
        batches = [(x[lo + i * mbs : lo + (i + 1) * mbs], y[lo + i * mbs : lo + (i + 1) * mbs])
                   for i in range(m_count)]  # fmt: skip
        metrics = schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(batches) for _ in chunks] if n_chunks > 1 else iter(batches),
            model=chunks if n_chunks > 1 else chunks[0],
            num_microbatches=m_count,
            tensor_shape=(mbs, gcfg.seq_len, gcfg.d_model),
            hooks=hooks,
        )
        opt.step()
        losses.append(_mean_loss(metrics, chunks[0]))
        if dist.get_rank() == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    for chunk in chunks:
        chunk.publish_params()  # params are valid to read (e.g. to save) from here on
    return {"losses": losses, "pp_rank": pgs.pp_rank}  # plain floats: picklable across ranks


def _mean_loss(metrics: list[Any], chunk: megabuf.DistributedDataParallel) -> float:
    """Mean loss over micro-batches and dp ranks, known on every rank (last stage broadcasts)."""
    pgs, coll = chunk.process_groups, chunk.engine.collectives
    local = sum(m["loss"] for m in metrics) / max(1, len(metrics))
    value = torch.tensor([local], dtype=torch.float64)
    coll.broadcast(value, pgs.pp_size - 1, pgs.pp)
    coll.all_reduce(value, pgs.dp, average=True, async_op=False)
    return float(value.item())


def reference(config_path: Path, steps_override: int | None) -> list[float]:
    """The whole GPT in one process on the global batch with the same optimizer."""
    with open(config_path, "rb") as f:
        raw = tomllib.load(f)
    pipe, gcfg = raw["pipeline"], GPTConfig(**raw["model"])
    opt_cfg = raw["optimizer"]
    gpt = GPT(gcfg, seed=0)
    opt = torch.optim.AdamW(
        gpt.parameters(), lr=opt_cfg["lr"], weight_decay=opt_cfg["weight_decay"]
    )
    tokens = corpus_tokens(20_000, gcfg.vocab_size, seed=0)
    rows = (4 // pipe["pp_size"]) * pipe["microbatches"] * pipe["micro_batch_size"]  # 4 ranks
    losses = []
    for step in range(steps_override or pipe["steps"]):
        x, y = lm_batches(tokens, rows, gcfg.seq_len, step)
        loss = gpt_loss(gpt(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = spawn(train, 4, args.config, args.steps)
    if not args.check:
        return
    ref = reference(args.config, args.steps)
    worst = max(abs(a - b) for a, b in zip(results[0]["losses"], ref, strict=True))
    print(f"--check: largest |pipeline loss - one-process loss| over {len(ref)} steps: {worst:.2e}")
    if worst > 1e-4:
        raise SystemExit("--check failed: the pipeline run diverged from one-process training")


if __name__ == "__main__":
    main()
