"""One rank of one replica group under megabuf.ft, run as its own process by tests/ft_cases.py.

    python tests/ft_worker.py '<json spec>'

The group is its own gloo world (its own store on `port`); across groups only torchft's Manager
(lighthouse at `lighthouse`). Runs each strategy of `strategies` in turn until `steps` steps are
committed, each with a fresh model, Manager and world prefix, and writes, per strategy, the
final params, the optimizer's main params and state and the record of every step (committed
step, live participants, committed or voted down) to `out` (torch.save). `kill` = {"group",
"strategy", "step", "phase"} ends this process with os._exit(17) in that phase: "backward" (a
grad hook), "step" (inside should_commit), "heal" (while loading a healthy group's state).
Test models are seeded alike in every group, and each rank's batch depends only on the committed
step and its group rank, so every live group contributes the same grads ([Note: ft test
reference] in tests/ft_cases.py).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # after PYTHONPATH: the megabuf under test comes first

from torchft import Manager, ProcessGroupGloo  # noqa: E402  (imported before a standby waits)

from megabuf import (  # noqa: E402
    DistributedDataParallelConfig,
    OptimizerConfig,
    build_optimizer,
    ft,
)

KILLED = 17


def make_module() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def config(strategy: str, bucket_size: int | str) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, bucket_size=bucket_size,
        overlap_grad_reduce=True,
    )  # fmt: skip


def _die(spec: dict[str, Any], strategy: str, step: int, phase: str) -> None:
    for kill in spec.get("kills", ()):
        if (
            kill["group"] == spec["group"] and kill["strategy"] == strategy
            and kill["phase"] == phase and step >= kill["step"]
            and kill.get("restarts", 0) == spec.get("restarts", 0)
            and kill.get("rank", 0) == spec["rank"]
        ):  # fmt: skip
            os._exit(KILLED)


def _stall(spec: dict[str, Any], strategy: str, step: int) -> None:
    """Quorum churn: a group slower than the Manager's timeout for one step (first run only)."""
    for stall in spec.get("stalls", ()):
        here = (stall["group"], stall["strategy"], stall["step"]) == (spec["group"], strategy, step)
        if here and spec.get("restarts", 0) == 0 and not stall.get("done"):
            stall["done"] = True
            time.sleep(stall["seconds"])


def _barrier(spec: dict[str, Any]) -> None:
    """The first start waits (bounded) until every group's ranks are up, so that no group
    trains alone while the others import torch; a restarted group does not wait."""
    if spec.get("restarts", 0) or not spec.get("barrier"):
        return
    root = Path(spec["barrier"])
    (root / f"g{spec['group']}_r{spec['rank']}").touch()
    deadline = time.monotonic() + spec["run_s"]
    while len(list(root.iterdir())) < spec["groups"] * spec["size"]:
        if time.monotonic() > deadline:
            raise TimeoutError("megabuf.ft test: the other groups never started")
        time.sleep(0.05)


def store_port(spec: dict[str, Any]) -> tuple[Any, int]:
    """A fresh store for this strategy's Manager (its keys are fixed names), made by group
    rank 0 and its port shared inside the group."""
    store = None
    if spec["rank"] == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    return store, int(port[0])


def manager_for(spec: dict[str, Any], strategy: str, port: int) -> Any:
    t = timedelta(seconds=spec["timeout_s"])
    return Manager(
        pg=ProcessGroupGloo(timeout=t), load_state_dict=None, state_dict=None,
        min_replica_size=1, replica_id=f"ft_{strategy}_{spec['group']}",
        store_addr="127.0.0.1", store_port=port, rank=spec["rank"],
        world_size=spec["size"], lighthouse_addr=spec["lighthouses"][strategy], timeout=t,
        quorum_timeout=timedelta(seconds=spec["quorum_timeout_s"]), connect_timeout=t,
        use_async_quorum=True,
    )  # fmt: skip


def _done(spec: dict[str, Any], last: tuple[int, int, bool], step: int) -> bool:
    """Every group stops at the same step: `steps` committed and the last step committed with
    every group participating (a restarted group has healed into the quorum)."""
    return step >= spec["steps"] and last[2] and last[1] == spec["groups"]


def run_strategy(spec: dict[str, Any], strategy: str) -> dict[str, Any]:
    store, port = store_port(spec)
    manager = manager_for(spec, strategy, port)
    model = ft.wrap(make_module(), config(strategy, spec.get("bucket_size", 40)), manager)
    opt = build_optimizer(model, OptimizerConfig(optimizer="sgd", lr=0.05, sgd_momentum=0.9))
    gate = ft.FaultTolerantOptimizer(model, opt, manager)
    load = gate._load_replica_state

    def heal(state: dict[str, Any]) -> None:
        _die(spec, strategy, manager.current_step(), "heal")
        load(state)

    manager._load_state_dict_fns["megabuf"] = heal  # a kill point, then the gate's own load
    should_commit = manager.should_commit

    def commit(*a: Any, **k: Any) -> bool:
        _die(spec, strategy, manager.current_step(), "step")
        return bool(should_commit(*a, **k))

    manager.should_commit = commit  # type: ignore[method-assign]
    record = []
    deadline = time.monotonic() + spec["run_s"]
    while not record or not _done(spec, record[-1], manager.current_step()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {spec['group']} rank {spec['rank']}: {strategy} too slow")
        if manager.current_step() >= spec["steps"]:
            time.sleep(0.05)  # waiting for a restarted group: leave it the CPU
        gate.zero_grad()
        step = manager.current_step()
        x, y = batch(step, spec["rank"])
        loss = nn.functional.mse_loss(model(x), y)
        _stall(spec, strategy, step)
        if spec.get("kills"):
            first = next(iter(model.module.parameters()))  # its grad comes last in backward
            first.register_hook(lambda g, s=step: (_die(spec, strategy, s, "backward"), g)[1])
        loss.backward()
        result = gate.step()
        # the step committed (a healing group trained on stale params from an older `step`,
        # its grads zeroed: it committed the others' step) and the groups whose grads it
        # averaged ([Note: layout fingerprint])
        done = manager.current_step() - 1 if result is not None else step
        record.append((done, gate.layout.contributors(), result is not None))
        with open(spec["record"], "a") as f:  # kept by a run that is killed later
            f.write(json.dumps([strategy, *record[-1]]) + "\n")
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mains = [mp.main.detach().clone() for mp in opt.main_params]
    dist.barrier()  # rank 0 serves the group's Manager: it shuts down last
    manager.shutdown(wait=False)
    del store
    return {"record": record, "params": params, "mains": mains}


def _wait_for_go(spec: dict[str, Any]) -> None:
    """A standby restart ([Note: ft test reference]): start when the harness says so."""
    if not spec.get("go"):
        return
    go = Path(spec["go"])
    deadline = time.monotonic() + 600.0
    while not go.exists():
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.02)


def main() -> None:
    spec = json.loads(sys.argv[1])
    _wait_for_go(spec)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"],
        world_size=spec["size"], timeout=timedelta(seconds=spec["run_s"]),
    )  # fmt: skip
    _barrier(spec)
    for strategy in spec["strategies"]:  # one file each: a later kill keeps what finished
        torch.save(run_strategy(spec, strategy), f"{spec['out']}.{strategy}")
    os._exit(0)  # no teardown of torchft's threads: the harness only needs the file


if __name__ == "__main__":
    main()
