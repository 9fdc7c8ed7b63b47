"""Tensors handed to a collective stay referenced from Python until the backend's thread lets go.

[Note: a backend thread's last reference]
gloo runs a collective on a worker thread of its process group, and that thread holds the work's
tensors until just after it marks the work complete: `wait()` (or a synchronous call) returns
first, and only then does the thread drop them. Measured here (torch 2.13, gloo, 2 ranks, a
1M-element view handed to `all_gather_into_tensor`): after `wait()` the thread still held it in
58-60 of 100 gathers, for up to 2.7 ms. A tensor made for one call (a shard view, a flag, a norm)
and then dropped is therefore often freed *by that thread*, which must take the GIL to free its
Python object. While the interpreter tears down, CPython ends a thread that asks for the GIL
with `pthread_exit`, and that forced unwind through a C++ worker loop is `std::terminate`:
"terminate called without an active exception", exit status -6 after training finished, as
issue 48 reported (intermittent: here once in 71 loaded torchrun jobs before this, a rank-0
eval with torch.profiler on and synchronous checkpoints). So every tensor
handed to a native collective is held here, from just before the call until its use count is
back to what it was (the thread let go); the main thread then drops it like any Python object
(tests/test_worker_refs.py: of 50 fresh tensors all-reduced, at least 47 are freed on the main
thread, all 50 in most runs; 9 to 41 without this). At exit (`atexit`, the interpreter whole,
after the handlers registered later waited for what was in flight) `release_at_exit` waits for
the threads, bounded, and keeps whatever is still held referenced for the rest of the process.
Process-wide by nature (it is about the process's exit), so one module-level holder; what the
threads let go of is dropped at the next collective or garbage collection. CPU tensors only
(gloo): NCCL's watchdog frees its works on its own schedule and is not covered (no GPU here).
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import time

from torch import Tensor

EXIT_WAIT_S = 2.0  # how long release_at_exit waits for backend threads to let go
LIMIT = 4096  # entries kept at most: past it the oldest go (their collectives ended long ago)


def use_count(tensor: Tensor) -> int:
    """Owners of `tensor`'s TensorImpl: its Python object counts once, each C++ holder once."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


class HeldTensors:
    """(tensor, its use count before the call) for every tensor handed to a collective whose
    backend thread may still hold it; see [Note: a backend thread's last reference]."""

    def __init__(self) -> None:
        self.held: list[tuple[Tensor, int]] = []

    def hold(self, *tensors: Tensor | None) -> None:
        """Call just before handing `tensors` to torch.distributed (CPU tensors: gloo's)."""
        self.prune()
        self.held.extend((t, use_count(t)) for t in tensors if t is not None and t.is_cpu)
        if len(self.held) > LIMIT:
            del self.held[: len(self.held) - LIMIT]

    def prune(self) -> None:
        """Drop the tensors every other holder has let go of (back to their count before)."""
        self.held = [(t, n) for t, n in self.held if use_count(t) > n]

    def release_at_exit(self, wait_s: float = EXIT_WAIT_S) -> int:
        """Wait, at most `wait_s`, for the backend threads to let go; keep what they still
        hold alive for good (returns how many). Run by `atexit`."""
        deadline = time.monotonic() + wait_s
        self.prune()
        while self.held and time.monotonic() < deadline:
            time.sleep(0.001)
            self.prune()
        if self.held:  # a collective still running at exit: its thread must never free these
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.held))
        return len(self.held)


HELD = HeldTensors()
atexit.register(HELD.release_at_exit)
# what the threads let go of is dropped at the next collective or the next garbage collection,
# so a dropped model's tensors do not outlive it for long (t_bench_repeat's leftover check)
gc.callbacks.append(lambda phase, _info: HELD.prune() if phase == "stop" else None)
