"""Rank side of tests/test_torch_conformance_api.py: torch DDP's API where torch's own DDP tests
found megabuf differing (issue 40): torch's comm-hook call form and its registration checks, an
untrainable module, and training under torch.distributed.autograd.

No `from __future__ import annotations` here: torch DDP compares a hook's annotations as objects
(a string annotation is refused there), and the same hooks go to torch DDP."""

import copy
from typing import Any

import torch
import torch.distributed as dist
from comm_hook_cases import _raises
from grad_cases import Net, local_slice, loss_fn, make_data
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh

import megabuf
from megabuf.comm_hooks import from_torch

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


# ---- torch hooks as torch's tests write them (annotations resolved from strings) --------------
def annotated_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Annotated as torch documents: divide, all-reduce, hand back the bucket."""
    group = state if state is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def bad_bucket_hook(state: object, bucket: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called: refused at registration")


def bad_return_hook(state: object, bucket: dist.GradBucket) -> torch.Tensor:
    raise AssertionError("never called: refused at registration")


def one_arg_hook(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    raise AssertionError("never called: refused at registration")


def string_annotated_hook(
    state: "object", bucket: "dist.GradBucket"
) -> "torch.futures.Future[torch.Tensor]":
    """As written under `from __future__ import annotations`: megabuf resolves the strings."""
    raise AssertionError("never called")


def _wrap(strategy: str) -> megabuf.DistributedDataParallel:
    cfg = megabuf.DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy)
    return megabuf.DistributedDataParallel(copy.deepcopy(Net()), cfg)


def _grads_after_steps(model: nn.Module, module: nn.Module, steps: int = 3) -> list[Any]:
    """SGD steps with `model`; the grads of every step (module's `.grad`, as torch DDP's)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = make_data(step)
        loss_fn(model(local_slice(x)), local_slice(y)).backward()
        out.append({n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None})
        opt.step()
    return out


def torch_form_trains_like_torch_ddp(form: str) -> dict[str, Any]:
    """The same torch call `register_comm_hook(None, hook)` (positional or keyword) on torch DDP
    and on megabuf: grads of every step, and a second registration."""
    hook = dh.allreduce_hook if form == "builtin" else annotated_hook
    net = Net()
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), bucket_cap_mb=100)
    model = megabuf.DistributedDataParallel(copy.deepcopy(net))
    for ddp in (ref, model):
        if form == "keywords":
            ddp.register_comm_hook(state=None, hook=hook)
        else:
            ddp.register_comm_hook(None, hook)
    registered = model.comm_hooks()
    twice = _raises(lambda: model.register_comm_hook(None, hook))
    twice_ref = _raises(lambda: ref.register_comm_hook(None, hook))
    want, got = _grads_after_steps(ref, ref.module), _grads_after_steps(model, model.module)
    same = [w.keys() == g.keys() and all(torch.equal(w[n], g[n]) for n in g)
            for w, g in zip(want, got, strict=True)]  # fmt: skip
    return {
        "same": same,
        "hook_names": {k: getattr(h, "name", "") for k, h in registered.items()},
        "twice": twice,
        "twice_ref": twice_ref,
    }


def registration_checks(strategy: str) -> dict[str, Any]:
    """torch's registration checks under `strategy`: each wrong call raises (class, message), and
    nothing was attached, so a right call registers afterwards; megabuf's form still works."""
    model = _wrap(strategy)
    out: dict[str, Any] = {
        "not_callable": _raises(lambda: model.register_comm_hook({}, {})),
        "bad_bucket": _raises(lambda: model.register_comm_hook(None, bad_bucket_hook)),
        "bad_return": _raises(lambda: model.register_comm_hook(None, bad_return_hook)),
        "one_arg": _raises(lambda: model.register_comm_hook(None, one_arg_hook)),
        "three_args": _raises(lambda: model.register_comm_hook(None, annotated_hook, 3)),
        "from_torch_bad_bucket": _raises(lambda: from_torch(bad_bucket_hook)),
        "string_annotations": _raises(lambda: from_torch(string_annotated_hook)),
        "torch_hook_in_megabuf_form": _raises(lambda: model.register_comm_hook(annotated_hook)),
    }
    out["right"] = _raises(lambda: model.register_comm_hook(None, annotated_hook))
    out["hooks_after"] = sorted(model.comm_hooks())
    megabuf_form = _wrap(strategy)
    out["megabuf_form"] = _raises(
        lambda: megabuf_form.register_comm_hook(hook=megabuf.comm_hooks.Reduce(), buffers="all")
    )
    out["megabuf_form_hooks"] = sorted(megabuf_form.comm_hooks())
    return out


# ---- an untrainable module ---------------------------------------------------------------------
def _frozen() -> nn.Module:
    return nn.Linear(4, 4).requires_grad_(False)


def untrainable_refused() -> dict[str, Any]:
    """Wrapping a module with no params, or only frozen ones, raises on every rank, before any
    collective (the ranks then still agree: a wrap and a step work afterwards); torch DDP raises
    the same class."""
    out: dict[str, Any] = {}
    for name, make in (("empty", nn.Module), ("frozen", _frozen)):
        out[name] = _raises(lambda make=make: megabuf.DistributedDataParallel(make()))
        out[f"{name}_torch"] = _raises(
            lambda make=make: torch.nn.parallel.DistributedDataParallel(make())
        )
    model = megabuf.DistributedDataParallel(nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    out["then_trains"] = model.module.weight.grad is not None
    return out


# ---- torch.distributed.autograd (RPC) ----------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_input(rank: int) -> torch.Tensor:
    return torch.full((2, 4), float(rank + 1))


def dist_autograd_case() -> dict[str, Any]:
    """Under real RPC (TensorPipe on 127.0.0.1, bounded timeouts), in fresh processes: torch DDP
    reduces the grads that dist_autograd.backward puts into the context; megabuf refuses the
    training forward inside a context by name, before queueing anything, so the same model then
    trains with plain backward outside it (and a forward with RPC up but no context runs)."""
    import datetime

    import torch.distributed.autograd as dist_autograd
    import torch.distributed.rpc as rpc

    from megabuf.transport.dist_autograd import DistAutogradError

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    port = [_free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port[0]}", rpc_timeout=30, num_worker_threads=4
    )
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    out: dict[str, Any] = {}
    try:
        torch.manual_seed(0)
        ref = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 1, bias=False))
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [ref(_rank_input(rank)).sum()])
            out["torch_grad"] = dist_autograd.get_gradients(context_id)[ref.module.weight].clone()
        torch.manual_seed(0)
        model = megabuf.DistributedDataParallel(nn.Linear(4, 1, bias=False))
        with dist_autograd.context():
            try:
                model(_rank_input(rank))
                out["refused"] = None
            except DistAutogradError as exc:
                out["refused"] = str(exc)
            with torch.no_grad():
                out["no_grad_forward_runs"] = model(_rank_input(rank)).shape == (2, 1)
        model(_rank_input(rank)).sum().backward()  # RPC up, no context: reduced as usual
        out["plain_grad"] = model.module.weight.grad.clone()
    finally:
        rpc.shutdown(graceful=True)
        dist.destroy_process_group()
    return out


# ---- torch DDP's other public names -------------------------------------------------------------
class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1 + dist.get_rank())  # differs per rank unless broadcast
        return self.lin(x)


def torch_names_case() -> dict[str, Any]:
    """broadcast_buffers (read and set) and will_sync_module_buffers on megabuf and torch DDP;
    whether a training forward broadcast the buffer (it then holds rank 0's value)."""
    out: dict[str, Any] = {}
    for side, cls in (("torch", torch.nn.parallel.DistributedDataParallel),
                      ("megabuf", megabuf.DistributedDataParallel)):  # fmt: skip
        model = cls(_WithBuffer())
        got = [model.broadcast_buffers, model.will_sync_module_buffers()]
        with model.no_sync():
            model(torch.ones(1, 4))  # torch's flag follows the last forward: read after one
            got.append(model.will_sync_module_buffers())
        model(torch.ones(1, 4))
        got.append(model.will_sync_module_buffers())
        model.broadcast_buffers = False
        got += [model.broadcast_buffers, model.will_sync_module_buffers()]
        model.module.seen.zero_()
        model(torch.ones(1, 4))  # no broadcast: each rank keeps its own count
        got.append(model.module.seen.item())
        out[side] = got
    out["no_buffers"] = megabuf.DistributedDataParallel(nn.Linear(2, 2)).will_sync_module_buffers()
    return out
