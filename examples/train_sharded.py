"""What fairscale's ShardedDDP + OSS and FullyShardedDataParallel users did, on megabuf.

    python examples/train_sharded.py --like sharded_ddp --check   # ZeRO-2, 2 CPU ranks
    python examples/train_sharded.py --like fsdp --check          # ZeRO-3 / FSDP
    torchrun --nproc-per-node 2 examples/train_sharded.py --like fsdp

megabuf grew from fairscale's two sharded engines (docs/sharding.md; seeds 000 and
001). Their users' loop, line for line:

    fairscale ShardedDDP + OSS                  megabuf (--like sharded_ddp)
    opt = OSS(params, optim=AdamW, lr=...)      DDPConfig(data_parallel_sharding_strategy=
    model = ShardedDDP(model, opt)                  "optim_grads"); build_optimizer(model, cfg)
    with model.no_sync(): loss.backward()       with model.no_sync(): loss.backward()
    opt.clip_grad_norm(1.0); opt.step()         OptimizerConfig(clip_grad=1.0); opt.step()
    opt.consolidate_state_dict(0); save         megabuf.save_checkpoint(dir, model, opt)

    fairscale FullyShardedDataParallel          megabuf (--like fsdp)
    auto_wrap(policy: one FSDP per block)       shard_units=("_Block",)  (or the default policy)
    reshard_after_forward=True                  reshard_after_forward=True
    mixed_precision=True (fp32 master)          --bf16: bf16 params, fp32 main params
    cpu_offload=True                            cpu_offload=True (a no-op with a warning on CPU)
    model.state_dict() (full, rank 0)           model.state_dict() (gathered unit by unit)

Each step every rank runs `--microbatches` micro-batches of its slice of the global batch (all
but the last under `no_sync()`), so the run follows one process training on the whole global
batch up to float rounding; `--check` trains that process and compares losses and params, then
saves a checkpoint, loads it into a fresh engine and checks the params came back bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

if importlib.util.find_spec("megabuf") is None:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import megabuf
from megabuf.testing import PRESETS, build_model, corpus_tokens, gpt_loss, lm_batches, spawn

STRATEGY = {"sharded_ddp": "optim_grads", "fsdp": "optim_grads_params"}
CLIP = 1.0
CHECK_RTOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", choices=sorted(STRATEGY), default="fsdp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (no torchrun)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bf16", action="store_true", help="bf16 params, fp32 main params")
    parser.add_argument("--check", action="store_true", help="compare with 1-process training")
    args = parser.parse_args(argv)
    if args.global_batch % (args.world_size * args.microbatches) != 0:
        parser.error("--global-batch must be divisible by --world-size x --microbatches")
    return args


def ddp_config(args: argparse.Namespace) -> megabuf.DistributedDataParallelConfig:
    options: dict[str, Any] = {
        "data_parallel_sharding_strategy": STRATEGY[args.like],
        "overlap_grad_reduce": True,
        "grad_reduce_in_fp32": True,  # fp32 grads for bf16 params, as fairscale's fp32 reduce
    }
    if args.like == "fsdp":
        options.update(shard_units=("_Block",), reshard_after_forward=True, cpu_offload=True)
    return megabuf.DistributedDataParallelConfig(**options)


def optimizer_config(args: argparse.Namespace) -> megabuf.OptimizerConfig:
    return megabuf.OptimizerConfig(optimizer="adamw", lr=args.lr, weight_decay=0.01, clip_grad=CLIP)


def build(args: argparse.Namespace, pgs: megabuf.ProcessGroups) -> tuple[Any, Any]:
    dtype = torch.bfloat16 if args.bf16 else None
    with warnings.catch_warnings():
        # cpu_offload on CPU params warns that there is nothing to offload: expected here
        warnings.filterwarnings("ignore", message=".*cpu_offload.*")
        model = megabuf.DistributedDataParallel(
            build_model("gpt_tiny", seed=0, dtype=dtype), ddp_config(args), process_groups=pgs
        )
        opt = megabuf.build_optimizer(model, optimizer_config(args))
    return model, opt


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rank: the fairscale user's loop on megabuf."""
    pgs = megabuf.init_distributed(device="cpu")
    model, opt = build(args, pgs)
    cfg = PRESETS["gpt_tiny"]
    tokens = corpus_tokens(10_000, cfg.vocab_size, seed=0)  # type: ignore[union-attr]
    local = args.global_batch // pgs.dp_size
    lo = pgs.dp_rank * local
    micro = local // args.microbatches
    losses = []
    for step in range(args.steps):
        x, y = lm_batches(tokens, args.global_batch, cfg.seq_len, step)  # type: ignore[union-attr]
        x, y = x[lo : lo + local], y[lo : lo + local]
        opt.zero_grad()
        total = torch.zeros(())
        for m in range(args.microbatches):
            sl = slice(m * micro, (m + 1) * micro)
            last = m == args.microbatches - 1
            with model.no_sync() if not last else contextlib.nullcontext():
                loss = gpt_loss(model(x[sl]), y[sl]) / args.microbatches
                loss.backward()
            total += loss.detach()
        opt.step()
        dist.all_reduce(total, group=pgs.dp)
        losses.append(total.item() / pgs.dp_size)
        if dist.get_rank() == 0:
            print(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.4f}", flush=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    resumed = _checkpoint_round_trip(args, pgs, model, opt)
    if dist.get_rank() != 0:
        return None
    print(
        f"[{args.like} -> {STRATEGY[args.like]}] done: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
        f"in {args.steps} steps on {pgs.dp_size} ranks",
        flush=True,
    )
    same = all(torch.equal(state[k], resumed[k]) for k in state)
    print(f"checkpoint: saved, loaded into a fresh engine, params bitwise equal: {same}")
    # numpy arrays, not tensors: a tensor returned to the launcher would travel as shared memory
    # that dies with this process
    arrays = {k: v.float().numpy() for k, v in state.items()}
    return {"losses": losses, "state": arrays, "resumed_ok": same}


def _checkpoint_round_trip(
    args: argparse.Namespace, pgs: megabuf.ProcessGroups, model: Any, opt: Any
) -> dict[str, Tensor]:
    """Save (every rank, atomically), load into a fresh engine and optimizer; its params."""
    root = [tempfile.mkdtemp(prefix="megabuf-sharded-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(root, src=0)
    path = Path(str(root[0])) / "ckpt"
    megabuf.save_checkpoint(path, model, opt)
    fresh, fresh_opt = build(args, pgs)
    megabuf.load_checkpoint(path, fresh, fresh_opt)
    return {k: v.detach().clone() for k, v in fresh.state_dict().items()}


def reference(args: argparse.Namespace) -> tuple[list[float], dict[str, Tensor]]:
    """One process, the whole global batch, torch's AdamW and clip_grad_norm_ (fp32 master
    weights for --bf16, as the engine's optimizer keeps)."""
    cfg = PRESETS["gpt_tiny"]
    model = build_model("gpt_tiny", seed=0)
    if args.bf16:
        model = model.to(torch.bfloat16).float()  # the same rounded start as the bf16 run
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=False)
    tokens = corpus_tokens(10_000, cfg.vocab_size, seed=0)  # type: ignore[union-attr]
    losses = []
    for step in range(args.steps):
        x, y = lm_batches(tokens, args.global_batch, cfg.seq_len, step)  # type: ignore[union-attr]
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def check(args: argparse.Namespace, result: dict[str, Any]) -> bool:
    ref_losses, ref_state = reference(args)
    rtol = CHECK_RTOL[torch.bfloat16 if args.bf16 else torch.float32]
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], ref_losses, strict=True))
    diff_sq = ref_sq = 0.0
    for name, array in result["state"].items():
        p = torch.from_numpy(array)
        diff_sq += (p.double() - ref_state[name].double()).square().sum().item()
        ref_sq += ref_state[name].double().square().sum().item()
    norm_rel = (diff_sq / ref_sq) ** 0.5
    ok = loss_rel <= rtol and norm_rel <= rtol and result["resumed_ok"]
    print(
        f"check vs 1 process: max loss diff {loss_rel:.2e} (relative), |params - ref| / |ref| = "
        f"{norm_rel:.2e}, resumed bitwise: {result['resumed_ok']} -> "
        f"{'OK' if ok else f'FAILED (tolerance {rtol:g})'}",
        flush=True,
    )
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ddp_config(args)  # fail fast on a bad config, before starting any rank
    mine = spawn(train, args.world_size, args)[0]
    if mine is None or not args.check:
        return 0
    return 0 if check(args, mine) else 1


if __name__ == "__main__":
    sys.exit(main())
