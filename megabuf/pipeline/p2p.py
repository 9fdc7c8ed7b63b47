"""`PipelineP2P`: activations forward and their grads backward between (virtual) pipeline stages.

[Note: pipeline point-to-point]
Sends are asynchronous and are only waited for at the end of the schedule (`finish`); a step
blocks only on the receive of the tensor it needs. So ranks never wait on each other's sends,
and an order that passes `simulate_pipeline` cannot deadlock (gloo's transport threads move the
bytes whenever the receiver posts its receive). Every message gets a tag unique within one
schedule run, derived from (direction, receiving virtual stage, micro-batch), so a receive can
only match the message meant for it: with pp_size 2 and interleaving, activations and grads of
several chunks flow over the same pair of ranks, in orders that differ between sender and
receiver.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megabuf.collectives import Collectives, PendingCollective
from megabuf.process_groups import ProcessGroups

_FORWARD, _BACKWARD = 0, 1
_MAX_TAG = 2**31 - 1


class PipelineP2P:
    """Point-to-point traffic of one rank for one schedule run (`tensor_shape`/`dtype` of the
    activations every stage boundary carries)."""

    def __init__(
        self,
        process_groups: ProcessGroups,
        collectives: Collectives,
        *,
        num_chunks: int,
        num_microbatches: int,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> None:
        self.group = process_groups.pp
        self.pp_size = process_groups.pp_size
        self.pp_rank = process_groups.pp_rank
        self.collectives = collectives
        self.num_chunks = num_chunks
        self.num_stages = self.pp_size * num_chunks  # virtual stages
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self._sends: list[PendingCollective] = []
        if 2 * num_microbatches * self.num_stages > _MAX_TAG:
            raise ValueError(
                f"megabuf: {num_microbatches} micro-batches x {self.num_stages} virtual stages "
                "exceed the point-to-point tag space; use fewer micro-batches per step"
            )

    # ---- virtual stages -----------------------------------------------------------------------
    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.num_stages - 1

    def _tag(self, direction: int, receiving_stage: int, microbatch: int) -> int:
        return (microbatch * self.num_stages + receiving_stage) * 2 + direction

    def _next_rank(self) -> int:
        return (self.pp_rank + 1) % self.pp_size

    def _prev_rank(self) -> int:
        return (self.pp_rank - 1) % self.pp_size

    # ---- traffic ------------------------------------------------------------------------------
    def send_forward(self, output: Tensor, chunk: int, microbatch: int) -> None:
        """Send `chunk`'s output activation to the next virtual stage."""
        self._check_shape(output, "output activation", chunk, microbatch)
        tag = self._tag(_FORWARD, self.virtual_stage(chunk) + 1, microbatch)
        data = output.detach().contiguous()
        self._sends.append(self.collectives.send(data, self._next_rank(), self.group, tag=tag))

    def recv_forward(self, chunk: int, microbatch: int) -> Tensor:
        """Block until the previous virtual stage's activation for `chunk` arrives (a leaf that
        requires grad, so backward leaves the grad to send back in `.grad`)."""
        tag = self._tag(_FORWARD, self.virtual_stage(chunk), microbatch)
        buf = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        with torch.profiler.record_function("megabuf::pipeline_recv_forward"):
            self.collectives.recv(buf, self._prev_rank(), self.group, tag=tag).wait()
        return buf.requires_grad_()

    def send_backward(self, input_grad: Tensor, chunk: int, microbatch: int) -> None:
        """Send the grad of `chunk`'s input activation to the previous virtual stage."""
        self._check_shape(input_grad, "input grad", chunk, microbatch)
        tag = self._tag(_BACKWARD, self.virtual_stage(chunk) - 1, microbatch)
        data = input_grad.detach().contiguous()
        self._sends.append(self.collectives.send(data, self._prev_rank(), self.group, tag=tag))

    def recv_backward(self, chunk: int, microbatch: int) -> Tensor:
        """Block until the next virtual stage's grad of `chunk`'s output arrives."""
        tag = self._tag(_BACKWARD, self.virtual_stage(chunk), microbatch)
        buf = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
        with torch.profiler.record_function("megabuf::pipeline_recv_backward"):
            self.collectives.recv(buf, self._next_rank(), self.group, tag=tag).wait()
        return buf

    def finish(self) -> None:
        """Wait for every send of this run (their tensors are released afterwards)."""
        with torch.profiler.record_function("megabuf::pipeline_wait_sends"):
            for pending in self._sends:
                pending.wait()
        self._sends = []

    def _check_shape(self, t: Tensor, what: str, chunk: int, microbatch: int) -> None:
        if tuple(t.shape) != self.tensor_shape or t.dtype != self.dtype:
            raise ValueError(
                f"megabuf: pipeline stage {self.pp_rank} chunk {chunk} micro-batch {microbatch}: "
                f"{what} has shape {tuple(t.shape)} {t.dtype}, but the schedule was given "
                f"tensor_shape={self.tensor_shape} dtype={self.dtype} (rank {dist.get_rank()})"
            )
