"""`PipelineP2P`: activations forward and their grads backward between (virtual) pipeline stages.

[Note: pipeline point-to-point]
NCCL ignores tags: the messages between a pair of ranks match in the order they were issued. A
send larger than NCCL's eager size completes only once the peer has posted the matching receive,
and the point-to-point operations of one communicator run one after another. So nothing here
depends on tags (every message has tag 0, on gloo too), and traffic is issued in steps:
- `p2p_steps` (order.py) cuts a rank's schedule order into slots of compute. Before each slot the
  rank issues one batched group (`Collectives.batch_p2p`, i.e. `batch_isend_irecv`) holding the
  sends of what the previous slot produced and the receives of what this slot consumes, waits
  for the whole group, then computes. A last group sends the last results.
- 1F1B: a slot is one forward or one backward, so a stage sends a forward's output together
  with receiving the grad for its next backward, and a backward's input grad together with
  receiving its next input (Megatron's send_forward_recv_backward / send_backward_recv_forward;
  a neighbour posts the same pair at its matching step).
- Interleaved: in the steady state a slot is a forward and the backward after it, so a rank
  exchanges both results with both neighbours in one group (as Megatron does). Warm-up and
  cool-down slots are one action; with every forward in the warm-up (num_microbatches ==
  pp_size) nothing is paired. One action per slot would deadlock here (a test shows it).
- Inside a group, activations come before grads: when one pair of ranks carries both (pp_size
  2, interleaved) the sender and the receiver list them alike.
`simulate_pipeline` (order.py) checks both halves of the contract for all ranks' steps: the n-th
message a rank sends to a peer is the n-th one the peer receives from it, and no group waits
forever when every send waits for its receive. Steps it completes therefore match and cannot
deadlock, on NCCL or on gloo. tests/test_pipeline_p2p.py runs the schedules on gloo with every tag
equal and every group waited for as soon as it is issued (NCCL's serialisation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megabuf.pipeline.order import BACKWARD, FORWARD, Action, P2PStep, Transfer, p2p_steps
from megabuf.transport.collectives import Collectives, P2PMessage, PendingCollective
from megabuf.transport.process_groups import ProcessGroups

Key = tuple[str, int, int]  # (phase, chunk, micro-batch) of the step that makes / needs a tensor


@dataclass
class P2PExchange:
    """One step's batched group in flight and the tensors it owns until `finish_exchange`."""

    pending: PendingCollective | None  # None: the step has no traffic
    sent: list[Tensor] = field(default_factory=list)
    received: dict[Key, Tensor] = field(default_factory=dict)  # land in the inbox on finish


class PipelineP2P:
    """Point-to-point traffic of one rank for one schedule run (`tensor_shape`/`dtype` of the
    activations every stage boundary carries, received into buffers on `device`). The compute
    side leaves what it produced with `put_output` / `put_input_grad` and takes its inputs with
    `take_input` / `take_output_grad`; `run(steps)` moves them, one batched group per step
    ([Note: pipeline point-to-point])."""

    def __init__(
        self,
        process_groups: ProcessGroups,
        collectives: Collectives,
        *,
        num_chunks: int,
        num_microbatches: int,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group = process_groups.pp
        self.pp_size = process_groups.pp_size
        self.pp_rank = process_groups.pp_rank
        self.collectives = collectives
        self.num_chunks = num_chunks
        self.num_microbatches = num_microbatches
        self.num_stages = self.pp_size * num_chunks  # virtual stages
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        # receive buffers: the stage's param device ([Note: allocation device])
        self.device = device
        self._outbox: dict[Key, Tensor] = {}  # produced here, sent by the next step's group
        self._inbox: dict[Key, Tensor] = {}  # received, not yet consumed

    # ---- virtual stages -----------------------------------------------------------------------
    def virtual_stage(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.num_stages - 1

    # ---- steps --------------------------------------------------------------------------------
    def steps(self, order: Sequence[Action], *, paired: bool) -> list[P2PStep]:
        """This rank's steps for `order` (see `p2p_steps`)."""
        return p2p_steps(order, self.pp_size, self.pp_rank, self.num_chunks, paired=paired)

    def run(self, steps: Sequence[P2PStep]) -> Iterator[Action]:
        """Yield the compute actions of `steps`, exchanging each step's group (issued and
        waited for) before its actions; the caller runs each action before asking for the next."""
        for step in steps:
            self.finish_exchange(self.start_exchange(step.transfers))
            yield from step.compute

    def start_exchange(self, transfers: Sequence[Transfer]) -> P2PExchange:
        """Issue one step's sends and receives as one batched group, in the step's order."""
        exchange = P2PExchange(None)
        messages = []
        for t in transfers:
            peer = (self.pp_rank + t.peer_offset) % self.pp_size
            key = (t.phase, t.chunk, t.microbatch)
            if t.send:
                tensor = self._take(self._outbox, key, "send")
                exchange.sent.append(tensor)
            else:
                tensor = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                exchange.received[key] = tensor
            messages.append(P2PMessage(t.send, tensor, peer))
        if messages:
            with torch.profiler.record_function("megabuf::pipeline_exchange"):
                exchange.pending = self.collectives.batch_p2p(messages, self.group)
        return exchange

    def finish_exchange(self, exchange: P2PExchange) -> None:
        """Wait for the whole group; its received tensors become available to `take_*`."""
        if exchange.pending is not None:
            with torch.profiler.record_function("megabuf::pipeline_wait_exchange"):
                exchange.pending.wait()
        self._inbox.update(exchange.received)
        exchange.sent, exchange.received = [], {}

    # ---- the compute side ---------------------------------------------------------------------
    def take_input(self, chunk: int, microbatch: int) -> Tensor:
        """The previous virtual stage's activation for `chunk`: a leaf that requires grad, so
        backward leaves the grad to send back in `.grad`."""
        return self._take(self._inbox, (FORWARD, chunk, microbatch), "input").requires_grad_()

    def take_output_grad(self, chunk: int, microbatch: int) -> Tensor:
        """The next virtual stage's grad of `chunk`'s output."""
        return self._take(self._inbox, (BACKWARD, chunk, microbatch), "output grad")

    def put_output(self, output: Tensor, chunk: int, microbatch: int) -> None:
        """`chunk`'s output activation, for the next virtual stage."""
        self._check_shape(output, "output activation", chunk, microbatch)
        self._outbox[(FORWARD, chunk, microbatch)] = output.detach().contiguous()

    def put_input_grad(self, input_grad: Tensor, chunk: int, microbatch: int) -> None:
        """The grad of `chunk`'s input activation, for the previous virtual stage."""
        self._check_shape(input_grad, "input grad", chunk, microbatch)
        self._outbox[(BACKWARD, chunk, microbatch)] = input_grad.detach().contiguous()

    def finish(self) -> None:
        """End of the run: every tensor produced was sent and every one received was used."""
        if self._outbox or self._inbox:
            raise RuntimeError(
                f"megabuf: pipeline stage {self.pp_rank} ended its schedule with unsent "
                f"{sorted(self._outbox)} and unused received {sorted(self._inbox)} "
                f"((phase, chunk, micro-batch); rank {self.collectives.rank()}); the steps and the "
                "compute disagree, a megabuf bug"
            )

    def _take(self, box: dict[Key, Tensor], key: Key, what: str) -> Tensor:
        if key not in box:
            raise RuntimeError(
                f"megabuf: pipeline stage {self.pp_rank} has no {what} for (phase, chunk, "
                f"micro-batch) {key} (rank {self.collectives.rank()}); the steps and the compute "
                "disagree, a megabuf bug"
            )
        return box.pop(key)

    def _check_shape(self, t: Tensor, what: str, chunk: int, microbatch: int) -> None:
        if tuple(t.shape) != self.tensor_shape or t.dtype != self.dtype:
            raise ValueError(
                f"megabuf: pipeline stage {self.pp_rank} chunk {chunk} micro-batch {microbatch}: "
                f"{what} has shape {tuple(t.shape)} {t.dtype}, but the schedule was given "
                f"tensor_shape={self.tensor_shape} dtype={self.dtype} "
                f"(rank {self.collectives.rank()})"
            )
