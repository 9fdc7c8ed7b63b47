"""CPU bench of megabuf.ft: per-step overhead against the same hybrid run without torchft, and
heal time against state size.

    python examples/ft_bench.py --widths 256,1024 --steps 20

Per width w (an MLP of 4 Linear(w, w), SGD with momentum, strategy "optim", one thread per
process):
- hybrid: one gloo world of 2 ranks split as 2 replicas x 1-way shard
  (num_distributed_optimizer_instances=2): the replicate all-reduce of each reduced shard;
- ft: 2 replica groups of 1 rank (each its own world), the same all-reduce through torchft's
  Manager (use_async_quorum=True), plus the quorum, the layout fingerprint and should_commit;
then a third ft group joins late and heals from a healthy one: its healing step's wall time
and the state it received. Median step times over `--steps` steps after 3 warm-up steps.
Prints one markdown row per width.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
WARMUP = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _module(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def _batch(step: int, width: int) -> torch.Tensor:
    return torch.randn(16, width, generator=torch.Generator().manual_seed(step))


def hybrid_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from megabuf import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        OptimizerConfig,
        build_optimizer,
    )  # fmt: skip

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=spec["rank"], world_size=2)  # fmt: skip
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim", num_distributed_optimizer_instances=2
    )
    model = DistributedDataParallel(_module(spec["width"]), config)
    opt = build_optimizer(model, OptimizerConfig(optimizer="sgd", lr=1e-3))
    times = []
    for step in range(spec["steps"] + WARMUP):
        t = time.perf_counter()
        model.zero_grad_buffer()
        model(_batch(step, spec["width"])).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return {"step_s": statistics.median(times[WARMUP:])}


def ft_worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from megabuf import DistributedDataParallelConfig, OptimizerConfig, build_optimizer, ft

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0,
                            world_size=1)  # fmt: skip
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = timedelta(seconds=60)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=t), load_state_dict=None, state_dict=None,
        min_replica_size=1, replica_id=f"bench_{spec['group']}", store_addr="127.0.0.1",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=spec["lighthouse"],
        timeout=t, quorum_timeout=t, use_async_quorum=True,
    )  # fmt: skip
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim")
    model = ft.wrap(_module(spec["width"]), config, manager)
    opt = build_optimizer(model, OptimizerConfig(optimizer="sgd", lr=1e-3))
    gate = ft.FaultTolerantOptimizer(model, opt, manager)
    state_nbytes = sum(v.numel() * v.element_size() for v in _tensors(ft.replica_state(model, opt)))
    times: list[float] = []
    out: dict[str, Any] = {"state_mb": state_nbytes / 2**20}
    late, total = spec["group"] == 2, spec["steps"] + WARMUP
    while True:  # the healthy groups stop once the late group has healed in and stepped
        t0 = time.perf_counter()
        gate.zero_grad()
        model(_batch(manager.current_step(), spec["width"])).square().mean().backward()
        committed = gate.step() is not None
        times.append(time.perf_counter() - t0)
        if manager.current_step() == total and not late:
            Path(spec["done"]).touch()  # let the late group start
        if manager.current_step() > total and manager.num_participants() == 3 and committed:
            break
    out["heal_step_s"] = times[0] if late else None
    out["step_s"] = statistics.median(times[WARMUP:total]) if not late else None
    manager.shutdown(wait=False)
    return out


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def _run(specs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="megabuf-ft-bench-"))
    procs = []
    for i, spec in enumerate(specs):
        spec["out"] = str(tmp / f"{i}.json")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(spec)],
                                      env=env))  # fmt: skip
    for p in procs:
        p.wait(timeout=timeout_s)
    return [json.loads(Path(s["out"]).read_text()) for s in specs]


def bench_width(width: int, steps: int, timeout_s: float) -> dict[str, Any]:
    from torchft.coordination import LighthouseServer

    port = _port()
    hybrid = _run([{"mode": "hybrid", "rank": r, "port": port, "width": width, "steps": steps}
                   for r in range(2)], timeout_s)  # fmt: skip
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=500)
    done = tempfile.mktemp(prefix="megabuf-ft-bench-done-")
    base = {"mode": "ft", "width": width, "steps": steps, "lighthouse": lighthouse.address(),
            "done": done}  # fmt: skip
    groups = [dict(base, group=g) for g in range(3)]
    groups[2]["wait_for"] = done
    ft_out = _run(groups, timeout_s)
    lighthouse.shutdown()
    h, f = max(r["step_s"] for r in hybrid), max(r["step_s"] for r in ft_out[:2])
    return {
        "width": width, "params_m": 4 * (width * width + width) / 1e6,
        "state_mb": ft_out[2]["state_mb"], "hybrid_step_ms": 1e3 * h, "ft_step_ms": 1e3 * f,
        "overhead_ms": 1e3 * (f - h), "heal_step_ms": 1e3 * ft_out[2]["heal_step_s"],
    }  # fmt: skip


def worker_main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    if spec.get("wait_for"):
        while not Path(spec["wait_for"]).exists():
            time.sleep(0.01)
    out = hybrid_worker(spec) if spec["mode"] == "hybrid" else ft_worker(spec)
    Path(spec["out"]).write_text(json.dumps(out))
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", default="256,1024")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker_main(json.loads(args.worker))
        return
    print("| width | params | state / rank | hybrid step | ft step | overhead | heal step |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for width in (int(w) for w in args.widths.split(",")):
        r = bench_width(width, args.steps, args.timeout_s)
        print(f"| {width} | {r['params_m']:.2f}M | {r['state_mb']:.1f} MB | "
              f"{r['hybrid_step_ms']:.1f} ms | {r['ft_step_ms']:.1f} ms | "
              f"{r['overhead_ms']:+.1f} ms | {r['heal_step_ms']:.0f} ms |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
