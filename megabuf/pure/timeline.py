"""`Timeline`: when each bucket group became ready, was dispatched and finished, for the overlap
report (`megabuf.pure.overlap`). A leaf module: it knows clocks, not buckets. Under hybrid sharding
a group also records "replicate_dispatch" when its all-reduce across replicas is issued ([Note:
two-level reduction]): "dispatch" to "replicate_dispatch" is the shard group's level, after it
the replicate group's, up to "finish".

Events are `(group_id, event name, seconds)`. On the CPU the seconds are `time.perf_counter()`
at the call. On CUDA they are device times, see [Note: timeline on CUDA].

[Note: timeline on CUDA]
On NCCL a collective runs on the communicator's own stream and `work.wait()` returns as soon as it
has made the current stream wait for it: host clocks put "finish" at enqueue time and report
about zero exposed communication however slow the network is. So on CUDA every event is a
`torch.cuda.Event(enable_timing=True)` recorded on the *current* stream of the timeline's device
at the call site, which is the stream that matters for each event:
- "ready" (the grad hook) and "backward_end" (start of `finish_grad_sync`): the compute stream,
  so the event fires when backward's kernels up to that point have run;
- "dispatch" (after the collectives were issued): the current stream, which the collective's
  stream waits on at issue, so it marks when the collective could start;
- "finish" (after `work.wait()`): the current stream now waits for the collective's stream, so
  the event fires once the collective's result is usable; this is what "exposed" must see.
Step end, where device events become times, is the read of `Timeline.events` (the report call),
not `finish_grad_sync`: resolving needs a synchronize, and one inside the step would stop the
host from running ahead into the optimizer and change the very overlap being measured. Reading
synchronizes once on the newest pending event, then turns each pending event into seconds with
`elapsed_time` against a reference event recorded when the timeline was created, anchored to
`perf_counter` at that moment (the device was idle then), so CUDA and host times share a frame
(the benchmark's plot mixes them). Events stay pending (one small CUDA event each) until read:
a long run with a timeline should read it now and then. The arithmetic is `resolve_marks`,
pure and tested with made-up elapsed times.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

Event = tuple[int, str, float]  # (group_id, event name, seconds)
PendingMark = tuple[int, str, Any]  # (group_id, event name, device marker not yet resolved)


def resolve_marks(
    anchor_s: float, pending: Sequence[PendingMark], elapsed_ms: Callable[[Any], float]
) -> list[Event]:
    """Pending device marks as events, in record order: `anchor_s` (host seconds of the
    reference mark) plus `elapsed_ms(marker)`, the device milliseconds since the reference."""
    return [
        (group_id, name, anchor_s + 1e-3 * elapsed_ms(mark)) for group_id, name, mark in pending
    ]


class DeviceClock(Protocol):
    """What a `Timeline` needs from a device clock (CUDA events; a fake in tests)."""

    def mark(self) -> Any:
        """A marker of 'now' in the device's stream order."""
        ...

    def resolve(self, pending: Sequence[PendingMark]) -> list[Event]:
        """The pending marks as events in seconds (may wait for the device)."""
        ...


class CudaClock:
    """Timed CUDA events on the current stream of one device; see [Note: timeline on CUDA]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        torch.cuda.synchronize(device)  # idle device: the reference fires at the anchor
        self.reference = self.mark()
        self.reference.synchronize()
        self.anchor_s = time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def resolve(self, pending: Sequence[PendingMark]) -> list[Event]:
        if not pending:
            return []
        for _, _, event in reversed(pending):  # usually the first wait covers the rest
            event.synchronize()
        return resolve_marks(self.anchor_s, pending, self.reference.elapsed_time)


class Timeline:
    """Optional event recorder for the overlap report: `(group_id, event, seconds)`.

    `device` None or a CPU device: `time.perf_counter()` at each `record`. A CUDA device: timed
    CUDA events, resolved when `events` is read ([Note: timeline on CUDA]). `clock` overrides
    the device's clock (tests feed made-up times through it)."""

    def __init__(
        self, device: torch.device | str | None = None, *, clock: DeviceClock | None = None
    ) -> None:
        self._resolved: list[Event] = []
        self._pending: list[PendingMark] = []
        self.clock: DeviceClock | None = clock if clock is not None else _device_clock(device)

    @property
    def on_device(self) -> bool:
        return self.clock is not None

    def record(self, group_id: int, event: str) -> None:
        if self.clock is None:
            self._resolved.append((group_id, event, time.perf_counter()))
        else:
            self._pending.append((group_id, event, self.clock.mark()))

    @property
    def events(self) -> list[Event]:
        """Every event so far, in record order (on CUDA: resolves pending events first, one
        synchronize; this is the timeline's step end)."""
        if self._pending and self.clock is not None:
            self._resolved.extend(self.clock.resolve(self._pending))
            self._pending = []
        return self._resolved


def _device_clock(device: torch.device | str | None) -> DeviceClock | None:
    """CUDA events on a CUDA device; None (host perf_counter) anywhere else."""
    dev = torch.device(device) if device is not None else None
    return CudaClock(dev) if dev is not None and dev.type == "cuda" else None
