"""Pure schedule math: the order in which one pipeline rank runs its forward and backward steps,
and the point-to-point steps that carry their tensors.

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
Both orders are Megatron-LM's. `p2p_steps` cuts an order into the steps whose point-to-point
traffic goes out as one batched group each, and `simulate_pipeline` runs every rank's steps the
way NCCL would ([Note: pipeline point-to-point] in p2p.py): an order it completes matches its
messages without tags and cannot deadlock.
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


@dataclass(frozen=True)
class Transfer:
    """One message of a step's batched group, seen from this rank: the send of what `phase` of
    (`chunk`, `microbatch`) produced (forward: its output activation, to the next rank; backward:
    its input grad, to the previous rank), or the receive of what it consumes (forward: its input
    activation, from the previous rank; backward: its output grad, from the next rank)."""

    send: bool
    phase: str
    chunk: int
    microbatch: int

    @property
    def peer_offset(self) -> int:
        """+1: the next pipeline rank, -1: the previous one (modulo pp_size)."""
        return 1 if (self.phase == FORWARD) == self.send else -1

    def __str__(self) -> str:
        return f"{'send' if self.send else 'recv'} {self.phase}{self.chunk}.{self.microbatch}"


@dataclass(frozen=True)
class P2PStep:
    """Issue `transfers` as one batched group and wait for it, then run `compute`."""

    transfers: tuple[Transfer, ...]
    compute: tuple[Action, ...]


def _slots(order: Sequence[Action], paired: bool) -> list[tuple[Action, ...]]:
    """The runs of compute between two groups: one action, or with `paired` a forward and the
    backward right after it (the steady state of the interleaved schedule)."""
    slots: list[tuple[Action, ...]] = []
    for act in order:
        prev = slots[-1] if slots else ()
        if paired and len(prev) == 1 and prev[0].phase == FORWARD and act.phase == BACKWARD:
            slots[-1] = (prev[0], act)
        else:
            slots.append((act,))
    return slots


def _transfers(
    slot: tuple[Action, ...], send: bool, pp_size: int, pp_rank: int, num_chunks: int
) -> list[Transfer]:
    """The sends of `slot`'s results (or receives of its inputs) that cross a stage boundary."""
    out = []
    last = pp_size * num_chunks - 1
    for act in slot:
        v = act.chunk * pp_size + pp_rank
        # a forward talks to v - 1 (recv) and v + 1 (send); a backward the other way round
        toward_next = (act.phase == FORWARD) == send
        if (toward_next and v < last) or (not toward_next and v > 0):
            out.append(Transfer(send, act.phase, act.chunk, act.microbatch))
    return out


def _canonical(transfers: list[Transfer]) -> tuple[Transfer, ...]:
    """[Note: pipeline point-to-point]: activations before grads, so that when one pair of
    ranks carries both (pp_size 2, interleaved) sender and receiver list them alike."""
    return tuple(sorted(transfers, key=lambda t: (t.phase != FORWARD, not t.send)))


def p2p_steps(
    order: Sequence[Action], pp_size: int, pp_rank: int, num_chunks: int, *, paired: bool
) -> list[P2PStep]:
    """This rank's steps: before each slot of compute one group with the sends of the previous
    slot's results and the receives of this slot's inputs; a last group sends the last results.
    See [Note: pipeline point-to-point] in p2p.py."""
    steps = []
    sends: list[Transfer] = []
    # every forward before every backward (num_microbatches == pp_size): no steady state to pair;
    # pairing the last forward with the first backward deadlocks (simulate_pipeline shows it)
    phases = [a.phase for a in order]
    all_warmup = BACKWARD not in phases or FORWARD not in phases[phases.index(BACKWARD) :]
    for slot in _slots(order, paired and not all_warmup):
        recvs = _transfers(slot, False, pp_size, pp_rank, num_chunks)
        steps.append(P2PStep(_canonical(sends + recvs), slot))
        sends = _transfers(slot, True, pp_size, pp_rank, num_chunks)
    steps.append(P2PStep(_canonical(sends), ()))
    return steps


Message = tuple[str, int, int]  # (phase, sending virtual stage, micro-batch)
Channel = tuple[int, int]  # (sending pp rank, receiving pp rank)


def _message(rank: int, t: Transfer, pp_size: int) -> Message:
    v = t.chunk * pp_size + rank
    if t.send:
        return (t.phase, v, t.microbatch)
    return (t.phase, v - 1 if t.phase == FORWARD else v + 1, t.microbatch)


def _match(plans: Sequence[Sequence[P2PStep]]) -> list[list[list[tuple[int, int]]]]:
    """Pair the n-th send of every channel with its n-th receive (issue order: what NCCL does,
    and gloo too when every tag is the same). Returns, per rank and group, the (peer, peer's
    group) of each of its messages; raises if a receive would get another message than it
    expects."""
    pp_size = len(plans)
    sent: dict[Channel, list[tuple[Message, int]]] = {}
    received: dict[Channel, list[tuple[Message, int]]] = {}
    for rank, plan in enumerate(plans):
        for g, step in enumerate(plan):
            for t in step.transfers:
                peer = (rank + t.peer_offset) % pp_size
                side, channel = (sent, (rank, peer)) if t.send else (received, (peer, rank))
                side.setdefault(channel, []).append((_message(rank, t, pp_size), g))
    partners: list[list[list[tuple[int, int]]]] = [[[] for _ in plan] for plan in plans]
    for (src, dst), sends in sent.items():
        recvs = received.get((src, dst), [])
        for n in range(max(len(sends), len(recvs))):
            s = sends[n][0] if n < len(sends) else None
            r = recvs[n][0] if n < len(recvs) else None
            if s != r:
                raise RuntimeError(
                    f"megabuf: pipeline messages from rank {src} to rank {dst} do not match in "
                    f"issue order: message {n} is sent as {s} but received as {r} "
                    "((phase, sending virtual stage, micro-batch)); the schedule's steps disagree"
                )
            partners[src][sends[n][1]].append((dst, recvs[n][1]))
            partners[dst][recvs[n][1]].append((src, sends[n][1]))
    for channel in received.keys() - sent.keys():
        raise RuntimeError(f"megabuf: pipeline rank {channel[1]} waits for messages from rank "
                           f"{channel[0]}, which sends none")  # fmt: skip
    return partners


def simulate_pipeline(
    orders: Sequence[Sequence[Action]], num_chunks: int, *, paired: bool | None = None
) -> list[str]:
    """Run every rank's steps (`p2p_steps`; `paired` as the schedules do: the interleaved one
    pairs, 1F1B does not; None: pair when num_chunks > 1) the way NCCL would: messages of a
    pair of ranks match in issue order, and a group completes only once every peer has issued
    the group holding the other end of each of its messages (no send is buffered). Returns the
    global completion order of the compute steps; raises if messages mismatch or on deadlock."""
    pp_size = len(orders)
    pair = num_chunks > 1 if paired is None else paired
    plans = [p2p_steps(o, pp_size, r, num_chunks, paired=pair) for r, o in enumerate(orders)]
    partners = _match(plans)
    cursor = [0] * pp_size
    trace: list[str] = []
    while any(c < len(p) for c, p in zip(cursor, plans, strict=True)):
        progressed = False
        for rank, plan in enumerate(plans):
            g = cursor[rank]
            if g < len(plan) and all(cursor[p] >= h for p, h in partners[rank][g]):
                trace += [f"r{rank}:{act}" for act in plan[g].compute]
                cursor[rank] += 1
                progressed = True
        if not progressed:
            stuck = {
                r: ", ".join(map(str, p[cursor[r]].transfers))
                for r, p in enumerate(plans)
                if cursor[r] < len(p)
            }
            raise RuntimeError(f"megabuf: pipeline order deadlocks; ranks wait in groups {stuck}")
    return trace
