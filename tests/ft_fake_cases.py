"""megabuf.ft on one replica group of gloo ranks (tests/dist_pool.py) with a fake Manager that
stands for the other groups: the gate, the cross-replica level's arithmetic, the collectives
audit, the layout fingerprint and healing state, without torchft's processes.

`FakeManager(counts)` answers the Manager calls megabuf makes: its all-reduce of a sum is n
identical contributions (this group's tensor times n, which equals n - 1 additions of it
bitwise: 2x is exact, so 2x + x and 3x round alike), n the step's entry in `counts`;
`commit` decides `should_commit`; `other_fingerprint` makes the other groups' layout differ.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megabuf import DistributedDataParallelConfig, OptimizerConfig, build_optimizer, ft
from megabuf.ft.fingerprint import CHUNKS, _chunks
from megabuf.transport.collectives import Collectives

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


class _Done:
    def wait(self) -> bool:
        return True


class FakeManager:
    """The other replica groups, as the Manager megabuf talks to."""

    def __init__(self, counts: list[int], *, other_fingerprint: int | None = None) -> None:
        self.counts = counts
        self.step = 0
        self.commit = True
        self.other_fingerprint = other_fingerprint
        self._pg = object()  # the Manager's own group: megabuf's Collectives never see it
        self.fns: dict[str, Any] = {}

    def num_participants(self) -> int:
        return self.counts[min(self.step, len(self.counts) - 1)]

    def start_quorum(self) -> None:
        return None

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> _Done:
        n = self.num_participants()
        if tensor.dtype == torch.float64 and self.other_fingerprint is not None:
            h = [float(c) for c in _chunks(self.other_fingerprint)]
            other = torch.tensor([1.0, *h, *[c * c for c in h]], dtype=torch.float64)
            tensor.add_(other * (n - 1))
        else:
            tensor.mul_(n)
        return _Done()

    def errored(self) -> None:
        return None

    def should_commit(self) -> bool:
        if self.commit:
            self.step += 1
        return self.commit

    def current_step(self) -> int:
        return self.step

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.fns[key] = (load, save)


class RecordingCollectives(Collectives):
    """Collectives that record the group of every call ([Note: fault-tolerant replicas]: the
    audit that nothing but the Manager crosses replica groups)."""

    METHODS = (
        "all_reduce", "reduce_scatter", "all_gather", "all_reduce_many", "reduce_scatter_many",
        "all_gather_many", "broadcast", "all_to_all", "send", "recv", "batch_p2p",
        "all_reduce_sparse", "all_reduce_max", "barrier", "all_gather_object", "broadcast_object",
    )  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.groups: list[Any] = []
        for name in self.METHODS:
            setattr(self, name, self._recording(getattr(self, name)))

    def _recording(self, method: Any) -> Any:
        signature = inspect.signature(method)

        def record(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            self.groups.append(bound.arguments.get("group"))
            return method(*args, **kwargs)

        return record


def _module(half: bool) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.Tanh(), nn.Linear(10, 3))
    return m.half() if half else m


def _batch(step: int, rank: int, half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    return (x.half(), y.half()) if half else (x, y)


def _build(strategy: str, manager: FakeManager, *, half: bool = False,
           collectives: Collectives | None = None) -> tuple[Any, Any, Any]:  # fmt: skip
    config = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, bucket_size=40, overlap_grad_reduce=True
    )
    kwargs = {"collectives": collectives} if collectives is not None else {}
    model = ft.wrap(_module(half), config, manager, **kwargs)
    opt_config = OptimizerConfig(
        optimizer="sgd", lr=0.05, sgd_momentum=0.9, fp16=half, initial_loss_scale=2.0**8
    )
    opt = build_optimizer(model, opt_config)
    return model, opt, ft.FaultTolerantOptimizer(model, opt, manager)


def _train_step(model: Any, gate: Any, step: int, half: bool = False) -> Any:
    gate.zero_grad()
    x, y = _batch(step, dist.get_rank(), half)
    loss = nn.functional.mse_loss(model(x).float(), y.float())
    if half:
        loss = gate.optimizer.scale_loss(loss)
    loss.backward()
    return gate.step()


def _snapshot(model: Any, opt: Any) -> dict[str, Any]:
    scaler = opt.grad_scaler
    return {
        "state": ft.replica_state(model, opt),
        "scaler": None if scaler is None else {k: v.clone() if isinstance(v, torch.Tensor)
                                               else v for k, v in scaler.state_dict().items()},
    }  # fmt: skip


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def case_voted_down(strategy: str, half: bool) -> dict[str, bool]:
    """A committed step, then a voted-down one: nothing changes (params, main params, optimizer
    state, hyperparameters, loss scaler); then a committed step changes them."""
    manager = FakeManager([3])
    model, opt, gate = _build(strategy, manager, half=half)
    _train_step(model, gate, 0, half)
    before = _snapshot(model, opt)
    manager.commit = False
    voted = _train_step(model, gate, 1, half)
    after = _snapshot(model, opt)
    manager.commit = True
    _train_step(model, gate, 1, half)
    moved = _snapshot(model, opt)
    return {
        "voted_none": voted is None,
        "unchanged": _equal(before, after),
        "then_moves": not _equal(before["state"]["model"], moved["state"]["model"]),
    }


def reference(counts: list[int], size: int, batches: list[int]) -> list[torch.Tensor]:
    """[Note: ft test reference] in tests/ft_cases.py, for a group of `size` ranks: committed
    step i used batch `batches[i]` and had `counts[i]` participants."""
    module = _module(False)
    params = list(module.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for i, step in enumerate(batches):
        grads = [torch.zeros_like(p) for p in params]
        for rank in range(size):
            module.zero_grad()
            x, y = _batch(step, rank)
            nn.functional.mse_loss(module(x), y).backward()
            for g, p in zip(grads, params, strict=True):
                g.add_(p.grad * (1.0 / size))
        n = counts[i]
        for g, p in zip(grads, params, strict=True):
            p.grad = (g * n) / n if n > 1 else g
        opt.step()
    return [p.detach().clone() for p in params]


def case_reference(strategy: str, counts: list[int], steps: int) -> bool:
    """Steps with these participant counts equal the reference bitwise."""
    manager = FakeManager(counts)
    model, _, gate = _build(strategy, manager)
    for step in range(steps):
        _train_step(model, gate, step)
    got = [v for _, v in sorted(model.state_dict().items(), key=lambda kv: _order(model, kv[0]))]
    seen = [counts[min(i, len(counts) - 1)] for i in range(steps)]
    want = reference(seen, dist.get_world_size(), list(range(steps)))
    return len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _order(model: Any, key: str) -> int:
    names = [n for n, _ in model.module.named_parameters()]
    return names.index(key.removeprefix("module."))


def case_audit(strategy: str) -> dict[str, Any]:
    """Every collective megabuf issues (construction, steps, a voted-down step, state_dict)
    names one of the model's own groups, never the Manager's."""
    recording = RecordingCollectives()
    manager = FakeManager([2, 3])
    model, _opt, gate = _build(strategy, manager, collectives=recording)
    for step in range(2):
        _train_step(model, gate, step)
    manager.commit = False
    _train_step(model, gate, 2)
    model.state_dict()
    own = [g for g in model.process_groups.named().values() if g is not None]
    foreign = [g for g in recording.groups if g is not None and not any(g is o for o in own)]
    return {"calls": len(recording.groups), "foreign": len(foreign),
            "manager_pg": any(g is manager._pg for g in recording.groups)}  # fmt: skip


def case_fingerprint(strategy: str) -> dict[str, Any]:
    """Same layout: no error; another group's differs: LayoutMismatchError before any step."""
    manager = FakeManager([3])
    model, opt, gate = _build(strategy, manager)
    _train_step(model, gate, 0)
    own = ft.layout_fingerprint(model)
    manager.other_fingerprint = own
    _train_step(model, gate, 1)
    manager.other_fingerprint = own ^ (1 << (CHUNKS * 20 - 1))
    before = ft.replica_state(model, opt)
    try:
        _train_step(model, gate, 2)
        raised = ""
    except ft.LayoutMismatchError as e:
        raised = str(e)
    return {"raised": raised, "unchanged": _equal(before, ft.replica_state(model, opt))}


def case_heal(strategy: str) -> bool:
    """A fresh group loading a trained group's state (same rank) steps to the same bits."""
    trained_manager, fresh_manager = FakeManager([2]), FakeManager([2])
    trained, t_opt, t_gate = _build(strategy, trained_manager)
    for step in range(2):
        _train_step(trained, t_gate, step)
    fresh, f_opt, f_gate = _build(strategy, fresh_manager)
    state = trained_manager.fns["megabuf"][1]()
    fresh_manager.fns["megabuf"][0](state)
    _train_step(trained, t_gate, 2)
    _train_step(fresh, f_gate, 2)
    return _equal(ft.replica_state(trained, t_opt), ft.replica_state(fresh, f_opt))


def all_cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {}
    for s in STRATEGIES:
        cases[f"voted_down_{s}"] = (case_voted_down, s, False)
        cases[f"reference_{s}"] = (case_reference, s, [3, 2, 3, 1], 4)
        cases[f"audit_{s}"] = (case_audit, s)
        cases[f"fingerprint_{s}"] = (case_fingerprint, s)
        cases[f"heal_{s}"] = (case_heal, s)
    cases["voted_down_fp16_scaler"] = (case_voted_down, "optim", True)
    return cases
