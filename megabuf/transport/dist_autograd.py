"""Training under `torch.distributed.autograd` is refused by name ([Note: distributed autograd]).

[Note: distributed autograd]
With RPC, `dist_autograd.backward(context_id, [loss])` accumulates each param's grad in the
dist-autograd context (read with `dist_autograd.get_gradients(context_id)`), not in `.grad`.
torch DDP's reducer reduces the grads there; megabuf's grads live in its buffers and its sync
never sees the context's, so each rank would keep its own local grad with no error. megabuf
refuses instead: a training forward (grad enabled) that runs inside an active dist-autograd
context raises `DistAutogradError`, before anything is queued (the ranks agree: each runs the
same forward in a context). The check costs one C call per training forward while RPC is not
initialised (no context can exist then), and a lookup of the thread's context while it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed.rpc as rpc


class DistAutogradError(RuntimeError):
    """A training forward inside a `torch.distributed.autograd` context."""


def _never() -> bool:
    return False


def _agent_set() -> Callable[[], bool]:
    if not rpc.is_available():  # a build without RPC: no context can exist
        return _never
    from torch.distributed.rpc.api import _is_current_rpc_agent_set

    return _is_current_rpc_agent_set  # type: ignore[no-any-return]


_rpc_initialised = _agent_set()


def refuse_dist_autograd(rank: int) -> None:
    """Raise `DistAutogradError` if this thread is inside a dist-autograd context; see
    [Note: distributed autograd]."""
    if not _rpc_initialised():
        return
    from torch.distributed import autograd as dist_autograd

    try:
        context_id = dist_autograd._current_context()._context_id()
    except RuntimeError:  # this thread has no context: plain autograd
        return
    raise DistAutogradError(
        f"megabuf: a training forward ran inside torch.distributed.autograd context {context_id} "
        f"(rank {rank}): dist_autograd.backward() would put the grads into that context, not "
        "into megabuf's grad buffers, so they would never be reduced and each rank would keep "
        "its local grads. Train with plain loss.backward() outside the context (megabuf reduces "
        "the grads), or use torch.nn.parallel.DistributedDataParallel for RPC training; a "
        "forward under torch.no_grad() inside a context is fine"
    )
