"""Train a small GPT with megabuf data parallelism on CPU ranks (or GPUs with --device cuda).

Run it from the repository root:

    python examples/train_gpt.py                          # spawns 2 CPU ranks by itself
    torchrun --nproc-per-node 2 examples/train_gpt.py     # or let torchrun start the ranks
    python examples/train_gpt.py --check                  # and compare with 1-process training
    python examples/train_gpt.py --config configs/ddp.toml --model gpt_small --steps 50
    python examples/train_gpt.py --config configs/distopt_overlap.toml --check   # ZeRO-1
    python examples/train_gpt.py --device cuda --check    # a rank per GPU, NCCL (never run yet)

What every rank does (see `train` below):

1. `megabuf.init_distributed(device=...)` joins the process group from torchrun's environment
   variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK): gloo for `--device cpu`
   (the default, also on a machine with GPUs), NCCL for `--device cuda`, each rank on GPU
   LOCAL_RANK. The model and every batch are moved to that device.
2. Every rank builds the same GPT from the same seed and wraps it in
   `megabuf.DistributedDataParallel`, which moves all grads into contiguous buffers split into
   buckets (and broadcasts rank 0's params, so the replicas start identical).
3. Each step every rank takes its contiguous slice of the global batch, runs forward and backward
   (with `overlap_grad_reduce`, buckets are all-reduced while backward is still running); the
   end of backward waits for the reductions (the explicit `finish_grad_sync()` below is
   Megatron's habit and then a no-op), so every `param.grad` holds the gradient
   averaged over the data-parallel ranks, and a plain `torch.optim.AdamW` steps.
   With a config that sets `use_distributed_optimizer` (configs/distopt_overlap.toml), grads are
   reduce-scattered instead, `megabuf.build_optimizer` builds a `DistributedOptimizer` that steps
   only this rank's shard of AdamW state, and the step dispatches the updated params'
   all-gathers, which forward pre-hooks of the next forward wait for bucket group by bucket
   group (`overlap_param_gather`).

Because the per-rank slices have equal size, the average of the ranks' mean losses is the mean
loss of the global batch, so data-parallel training follows the same trajectory as one process
training on the whole batch, up to float rounding. `--check` verifies exactly that.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

try:
    import megabuf
except ModuleNotFoundError:  # a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import megabuf
from megabuf.testing import (
    PRESETS,
    GPTConfig,
    build_model,
    corpus_text,
    corpus_tokens,
    gpt_loss,
    lm_batches,
    spawn,
)

REPO = Path(__file__).resolve().parents[1]
CHECK_RTOL = 1e-4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "ddp_overlap.toml")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn (no torchrun)")
    parser.add_argument(
        "--global-batch", type=int, default=16, help="sequences per step, all ranks"
    )
    parser.add_argument("--model", choices=["gpt_tiny", "gpt_small"], default="gpt_tiny")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action="store_true", help="compare with 1-process training")
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model and batches live: cpu (gloo, the default) or cuda (NCCL, one GPU "
        "per rank: GPU LOCAL_RANK)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.global_batch < 1 or args.world_size < 1:
        parser.error("--steps, --global-batch and --world-size must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    return args


def load_config(path: Path) -> megabuf.DistributedDataParallelConfig:
    return megabuf.DistributedDataParallelConfig.from_toml(path)


def make_train_optimizer(model: megabuf.DistributedDataParallel, args: argparse.Namespace) -> Any:
    if model.ddp_config.use_distributed_optimizer:
        # ZeRO-1: each rank holds only its shard's reduced grads, so a plain torch optimizer over
        # all params would step on garbage. megabuf's optimizer steps the shard (same AdamW maths
        # as --check's reference: the config's [optimizer] table says adamw, weight decay 0.01)
        # and all-gathers the updated params.
        opt_cfg = megabuf.OptimizerConfig.from_toml(args.config).replace(lr=args.lr)
        return megabuf.build_optimizer(model, opt_cfg)
    return make_optimizer(model.parameters(), args.lr)


def make_optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor kernels in the DDP and reference runs, for --check.
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, foreach=False)


def log(*parts: object) -> None:
    if dist.get_rank() == 0:
        print(*parts, flush=True)


def train_step(model: megabuf.DistributedDataParallel, opt: Any, x: Tensor, y: Tensor) -> Tensor:
    """One data-parallel step on this rank's slice (x, y); returns the local loss, detached."""
    model.zero_grad_buffer()  # grads accumulate into the buffers: clear them every step
    loss = gpt_loss(model(x), y)
    loss.backward()  # bucket reductions (during backward with overlap); waited for at its end
    model.finish_grad_sync()  # Megatron's explicit call: a no-op once backward synced
    opt.step()  # distributed optimizer: steps this rank's shard, then all-gathers params
    return loss.detach()


def train(args: argparse.Namespace) -> dict[str, Any] | None:
    """Runs on every rank. Rank 0 returns its losses (and, with --check, the check result)."""
    pgs = megabuf.init_distributed(device=args.device)
    device = _device(args)
    cfg = load_config(args.config)
    dp_size, dp_rank = pgs.dp_size, pgs.dp_rank
    if args.global_batch % dp_size != 0:
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by dp={dp_size}")
    local = args.global_batch // dp_size
    lo, hi = dp_rank * local, (dp_rank + 1) * local  # this rank's contiguous slice

    model = megabuf.DistributedDataParallel(
        build_model(args.model, seed=args.seed).to(device), cfg, process_groups=pgs
    )
    opt = make_train_optimizer(model, args)
    gpt_cfg = PRESETS[args.model]
    if not isinstance(gpt_cfg, GPTConfig):
        raise TypeError(f"{args.model} is not a GPT preset")
    tokens = corpus_tokens(_corpus_len(args, gpt_cfg), gpt_cfg.vocab_size, seed=args.seed)
    _print_header(args, cfg, model, dp_size, local)

    losses: list[float] = []
    step_times: list[float] = []
    for step in range(args.steps):
        start = time.perf_counter()
        x, y = lm_batches(tokens, args.global_batch, gpt_cfg.seq_len, step)
        loss = train_step(model, opt, x[lo:hi].to(device), y[lo:hi].to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()  # kernels run asynchronously: time their end
        step_times.append(time.perf_counter() - start)
        # For logging only: the global-batch loss is the mean of the ranks' local means.
        dist.all_reduce(loss, group=pgs.dp)
        losses.append(loss.item() / dp_size)
        tok_s = args.global_batch * gpt_cfg.seq_len / step_times[-1]
        log(f"step {step + 1:4d}/{args.steps}  loss {losses[-1]:.4f}  {tok_s:9,.0f} tok/s")

    model.publish_params()  # overlap_param_gather: wait for the step's gathers before reading
    _print_summary(args, model, losses, step_times, gpt_cfg.seq_len)
    if isinstance(opt, megabuf.MegabufOptimizer):
        mem = opt.memory_report()
        log(
            f"rank 0 optimizer: {mem.owned_numel} of {n_params(model)} params owned, "
            f"{mem.optimizer_nbytes / 1e6:.2f} MB state + main params, "
            f"{mem.padding_numel} padding elements in its shards"
        )
    if dist.get_rank() != 0:
        return None
    result: dict[str, Any] = {"losses": losses}
    if args.check:
        result["check_ok"] = run_check(args, model.module, losses, tokens, gpt_cfg.seq_len)
    return result


def _device(args: argparse.Namespace) -> torch.device:
    """This rank's device: the CPU, or the GPU init_distributed made current (LOCAL_RANK)."""
    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _corpus_len(args: argparse.Namespace, cfg: GPTConfig) -> int:
    # Enough text that no window repeats during the run (lm_batches wraps around otherwise).
    return max(10_000, args.steps * args.global_batch * cfg.seq_len + 1)


def _print_header(
    args: argparse.Namespace,
    cfg: megabuf.DistributedDataParallelConfig,
    model: nn.Module,
    dp_size: int,
    local: int,
) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"megabuf example: {args.model} ({n_params / 1e6:.2f}M params), dp={dp_size}, "
        f"device {args.device}, backend {dist.get_backend_config()}"
    )
    log(
        f"config {args.config}: overlap_grad_reduce={cfg.overlap_grad_reduce} "
        f"use_distributed_optimizer={cfg.use_distributed_optimizer} "
        f"overlap_param_gather={cfg.overlap_param_gather}"
    )
    log(f"global batch {args.global_batch} = {dp_size} ranks x {local} sequences; lr {args.lr}")
    log(f"corpus sample: {corpus_text(24, seed=args.seed)!r}")


def _print_summary(
    args: argparse.Namespace,
    model: nn.Module,
    losses: list[float],
    step_times: list[float],
    seq_len: int,
) -> None:
    # Step 1 pays one-off costs (allocations, thread pools); leave it out of the throughput.
    timed = step_times[1:] or step_times
    tok_s = args.global_batch * seq_len * len(timed) / sum(timed)
    log(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    log(f"throughput {tok_s:,.0f} tok/s, {1e3 * sum(timed) / len(timed):.1f} ms/step")
    stats = getattr(model.engine.collectives, "stats", None)
    if stats is not None:
        calls = dict(stats.calls)
        log(f"rank 0 sent {stats.total_ring_nbytes / 1e6:.1f} MB in collectives {calls}")


def run_check(
    args: argparse.Namespace, trained: nn.Module, losses: list[float], tokens: Tensor, seq: int
) -> bool:
    """Train a fresh copy in this one process on the full global batch (on this rank's device);
    compare with DDP."""
    device = _device(args)
    ref = build_model(args.model, seed=args.seed).to(device)
    opt = make_optimizer(ref.parameters(), args.lr)
    ref_losses = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in lm_batches(tokens, args.global_batch, seq, step))
        opt.zero_grad(set_to_none=True)
        loss = gpt_loss(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    max_abs, norm_rel = _param_diff(trained, ref)
    ok = loss_rel <= CHECK_RTOL and norm_rel <= CHECK_RTOL
    print(
        f"check vs 1 process: max loss diff {loss_rel:.2e} (relative); params: max abs diff "
        f"{max_abs:.2e}, |ddp - ref| / |ref| = {norm_rel:.2e} -> "
        f"{'OK' if ok else f'FAILED (tolerance {CHECK_RTOL:g})'}",
        flush=True,
    )
    return ok


def _param_diff(a: nn.Module, b: nn.Module) -> tuple[float, float]:
    """(max abs element difference, |a - b| / |b| in L2 norm over all params together).

    The pass criterion is the norm ratio, not the max abs difference: Adam's first step moves
    every element by lr * sign(grad), so an element whose true gradient is below float rounding
    (summing the batch in a different order, as data parallelism does) moves by +-lr in either
    run. Those few elements say nothing about correctness but dominate a max-abs comparison.
    """
    pb = dict(b.named_parameters())
    max_abs = diff_sq = ref_sq = 0.0
    for name, p in a.named_parameters():
        diff = p.detach().double() - pb[name].detach().double()
        max_abs = max(max_abs, diff.abs().max().item())
        diff_sq += diff.square().sum().item()
        ref_sq += pb[name].detach().double().square().sum().item()
    return max_abs, (diff_sq / max(ref_sq, 1e-30)) ** 0.5


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_config(args.config)  # fail fast on a bad config, before starting any rank
    results = spawn(train, args.world_size, args)  # under torchrun: just train(args) here
    mine = results[0]
    if mine is None or not args.check:  # ranks other than 0 (torchrun), or nothing to check
        return 0
    return 0 if mine["check_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
