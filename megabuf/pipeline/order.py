"""Pure schedule math: the order in which one pipeline rank runs its forward and backward steps.

Sees only counts (micro-batches, stages, chunks, this stage's rank); returns frozen `Action`s, so
an order can be printed, compared and checked for deadlock without processes
(`simulate_pipeline`).

[Note: pipeline orders]
Virtual stage v = chunk * pp_size + pp_rank: chunk c of stage s follows chunk c of stage s - 1 and
chunk c - 1 of the last stage (the interleaved "virtual pipeline"). Micro-batch m's forward
visits v = 0, 1, ...; its backward visits them in reverse.
- 1F1B (one chunk): stage s runs min(pp_size - s - 1, M) warm-up forwards, then alternates one
  forward and one backward, then runs the remaining backwards (cool-down). At most
  pp_size - s micro-batches of activations are alive on stage s.
- Interleaved (V chunks): the k-th forward of a rank runs chunk (k // pp_size) % V on micro-batch
  (k // (pp_size * V)) * pp_size + k % pp_size (groups of pp_size micro-batches per chunk); the
  k-th backward runs the same micro-batch on chunk V - 1 - that chunk. Warm-up is
  (pp_size - s - 1) * 2 + (V - 1) * pp_size forwards (all of them when M == pp_size), then
  1F1B, then cool-down. Needs M to be a multiple of pp_size.
Both orders are Megatron-LM's; the executor (schedules.py) sends asynchronously and blocks only
on the receive a step needs, so any order that `simulate_pipeline` completes cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    """One step of a rank: `phase` F or B of `chunk` on `microbatch`; `index` is the step's
    position among this rank's steps of the same phase (Megatron's virtual micro-batch id)."""

    phase: str
    chunk: int
    microbatch: int
    index: int

    def __str__(self) -> str:
        return f"{self.phase}{self.chunk}.{self.microbatch}"


def _check(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int) -> None:
    if num_microbatches < 1 or pp_size < 1 or num_chunks < 1:
        raise ValueError(
            f"megabuf: pipeline needs num_microbatches, pp_size and num_chunks >= 1; got "
            f"{num_microbatches}, {pp_size}, {num_chunks}"
        )
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"megabuf: pp_rank={pp_rank} outside [0, {pp_size})")


def _interleave(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """Warm-up forwards, then alternate forward/backward, then the remaining backwards."""
    order = forwards[:warmup]
    steady = len(forwards) - warmup
    for i in range(steady):
        order += [forwards[warmup + i], backwards[i]]
    return order + backwards[steady:]


def one_f_one_b_order(num_microbatches: int, pp_size: int, pp_rank: int) -> list[Action]:
    """Non-interleaved 1F1B; see [Note: pipeline orders]."""
    _check(num_microbatches, pp_size, pp_rank, 1)
    forwards = [Action(FORWARD, 0, m, m) for m in range(num_microbatches)]
    backwards = [Action(BACKWARD, 0, m, m) for m in range(num_microbatches)]
    return _interleave(forwards, backwards, min(pp_size - pp_rank - 1, num_microbatches))


def interleaved_chunk(index: int, pp_size: int, num_chunks: int, *, forward: bool) -> int:
    """Model chunk of a rank's `index`-th forward (or backward) step."""
    chunk = (index % (pp_size * num_chunks)) // pp_size
    return chunk if forward else num_chunks - 1 - chunk


def interleaved_microbatch(index: int, pp_size: int, num_chunks: int) -> int:
    """Micro-batch of a rank's `index`-th forward (or backward) step."""
    return (index // (pp_size * num_chunks)) * pp_size + index % pp_size


def interleaved_warmup(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int) -> int:
    total = num_microbatches * num_chunks
    if num_microbatches == pp_size:
        return total
    return min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)


def interleaved_order(
    num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int
) -> list[Action]:
    """Interleaved (virtual pipeline) 1F1B; see [Note: pipeline orders]."""
    _check(num_microbatches, pp_size, pp_rank, num_chunks)
    if num_microbatches % pp_size != 0:
        raise ValueError(
            f"megabuf: the interleaved schedule needs num_microbatches ({num_microbatches}) to "
            f"be a multiple of pp_size ({pp_size})"
        )
    total = num_microbatches * num_chunks

    def step(phase: str, k: int) -> Action:
        chunk = interleaved_chunk(k, pp_size, num_chunks, forward=phase == FORWARD)
        return Action(phase, chunk, interleaved_microbatch(k, pp_size, num_chunks), k)

    forwards = [step(FORWARD, k) for k in range(total)]
    backwards = [step(BACKWARD, k) for k in range(total)]
    warmup = interleaved_warmup(num_microbatches, pp_size, pp_rank, num_chunks)
    return _interleave(forwards, backwards, warmup)


def simulate_pipeline(orders: Sequence[Sequence[Action]], num_chunks: int) -> list[str]:
    """Run every rank's order against the data dependencies (a forward needs the previous
    virtual stage's forward of its micro-batch, a backward the next virtual stage's backward, or
    its own forward on the last one). Returns the global completion order; raises on deadlock."""
    pp_size = len(orders)
    last = pp_size * num_chunks - 1
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * pp_size
    trace: list[str] = []
    while any(c < len(o) for c, o in zip(cursor, orders, strict=True)):
        progressed = False
        for rank, order in enumerate(orders):
            if cursor[rank] == len(order):
                continue
            act = order[cursor[rank]]
            v = act.chunk * pp_size + rank
            if act.phase == FORWARD:
                need = (FORWARD, v - 1, act.microbatch) if v > 0 else None
            else:
                prev = (BACKWARD, v + 1, act.microbatch)
                need = (FORWARD, v, act.microbatch) if v == last else prev
            if need is None or need in done:
                done.add((act.phase, v, act.microbatch))
                trace.append(f"r{rank}:{act}")
                cursor[rank] += 1
                progressed = True
        if not progressed:
            stuck = {r: str(o[cursor[r]]) for r, o in enumerate(orders) if cursor[r] < len(o)}
            raise RuntimeError(f"megabuf: pipeline order deadlocks; ranks wait at {stuck}")
    return trace
