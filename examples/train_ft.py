"""Fault-tolerant data parallelism with megabuf.ft: three replica groups, one killed and restarted.

    python examples/train_ft.py --steps 6 --kill

Each replica group is one process here (one gloo world of its own); torchft's lighthouse runs in
this launcher. With `--kill`, group 1 ends itself hard (os._exit) in the middle of a backward;
the launcher restarts it, it heals from a healthy group through the Manager and rejoins, and
at the end the launcher prints whether every group holds the same params, bit for bit.
Needs the `ft` extra (`pip install 'megabuf[ft]'`).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
GROUPS = 3
KILLED = 17


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from megabuf import DistributedDataParallelConfig, OptimizerConfig, build_optimizer, ft

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)  # fmt: skip
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=10)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t), load_state_dict=None, state_dict=None,
        min_replica_size=1, replica_id=f"example_{args.group}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
        timeout=t, quorum_timeout=timedelta(seconds=60),
    )  # fmt: skip
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim", bucket_size=200)
    model = ft.wrap(module, config, manager)
    opt = ft.FaultTolerantOptimizer(
        model, build_optimizer(model, OptimizerConfig(lr=1e-2)), manager
    )
    last = (0, 0, False)
    while manager.current_step() < args.steps or not (last[2] and last[1] == GROUPS):
        if manager.current_step() >= args.steps:
            time.sleep(0.05)  # waiting for a restarted group to heal in: leave it the CPU
        opt.zero_grad()
        step = manager.current_step()
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if args.kill and step >= args.steps // 2:  # its first step at or past the middle
            module[0].weight.register_hook(lambda grad: os._exit(KILLED))
        loss.backward()
        committed = opt.step() is not None
        last = (step, manager.num_participants(), committed)
        print(f"group {args.group} step {step}: {last[1]} groups, committed {committed}, "
              f"loss {loss.item():.4f}", flush=True)  # fmt: skip
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    manager.shutdown(wait=False)
    os._exit(0)


def launch(args: argparse.Namespace) -> None:
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=2000)  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="megabuf-train-ft-"))

    def start(group: int, kill: bool) -> subprocess.Popen[bytes]:
        argv = [sys.executable, __file__, "--worker", "--group", str(group), "--steps",
                str(args.steps), "--lighthouse", lighthouse.address(),
                "--out", str(tmp / f"g{group}.pt")] + (["--kill"] if kill else [])  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        return subprocess.Popen(argv, env=env)

    procs = {g: start(g, args.kill and g == 1) for g in range(GROUPS)}
    end = time.monotonic() + args.timeout_s
    while any(p.poll() is None for p in procs.values()):
        if time.monotonic() > end:
            for p in procs.values():
                p.kill()
            raise SystemExit(f"timed out after {args.timeout_s} s")
        for g, p in procs.items():
            if p.poll() == KILLED:
                print(f"group {g} was killed: restarting it", flush=True)
                procs[g] = start(g, kill=False)
        time.sleep(0.1)
    lighthouse.shutdown()
    states = [torch.load(tmp / f"g{g}.pt") for g in range(GROUPS)]
    agree = all(torch.equal(s[k], states[0][k]) for s in states for k in s)
    print(f"replicas agree (params bitwise equal in all {GROUPS} groups): {agree}")
    raise SystemExit(0 if agree else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill", action="store_true", help="kill group 1 mid-backward")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    main()
