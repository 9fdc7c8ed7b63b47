"""`spawn`: run a function on `world_size` local CPU processes the way torchrun would.

Examples and benchmarks call `spawn(main, world_size, ...)`. Without torchrun it starts one
process per rank (spawn context), gives each the environment torchrun would (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and its share of the cores, runs
`fn(*args)` in each, and re-raises any rank's failure in the parent with that rank's traceback.
Under torchrun (RANK and WORLD_SIZE already set) it just calls `fn(*args)`.

[Note: rank results by value]
A rank's return value travels to the parent serialized by value (`torch.save` into bytes, read
back with `map_location="cpu"`), never through the pipe's own pickler: torch's multiprocessing
pickler sends a tensor as a handle to shared memory (a file descriptor handed over by a
`resource_sharer` thread in the child, or a CUDA IPC handle), which the parent can only open
while the child is alive. A child that returns and exits before the parent reads (the usual
case: nothing keeps it) made `conn.recv()` fail with FileNotFoundError in `resource_sharer`
(seen on the first GPU run, 2026-11-26). So results that hold tensors arrive as CPU tensors with
their own storage, whatever the child does next; CUDA tensors come back on the CPU.

The launcher does not create a process group: `fn` calls `megabuf.init_distributed()`, which
reads the variables above.

[Note: a port taken before rank 0 binds it]
The parent picks MASTER_PORT as a port free a moment ago; another process on the machine can
bind it before rank 0's TCPStore does (seen with several test runs on one machine: the whole
bench lost to EADDRINUSE). A run whose rank reports EADDRINUSE is started again on a new port,
up to `PORT_ATTEMPTS` times in all; `fn` is run from the start, so whatever it does before
`init_distributed()` must be repeatable (examples and the bench do nothing before it).
"""

from __future__ import annotations

import io
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import connection as mp_connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["SpawnError", "free_port", "spawn", "under_torchrun"]

# glibc serves allocations above M_MMAP_THRESHOLD with a fresh mmap and unmaps them on free, and
# returns heap memory above M_TRIM_THRESHOLD to the kernel. A torch optimizer step allocates and
# frees temporaries of tens of MB every step, so by default each step page-faults all of them
# back in (measured here: ~30k faults and ~1.4x slower for an AdamW step over 2 x 64 MiB params;
# worse with more threads faulting concurrently). 1 GiB keeps such buffers in the heap, reused
# step to step, at the cost of holding on to freed memory. glibc reads these variables only at
# process start, so they must be in the environment the children inherit.
_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}
_REAP_TIMEOUT_S = 10.0
# A rank that already reported success is only tearing down (gloo, interpreter exit): give it
# longer, or a loaded machine turns a good run into a failure.
_EXIT_TIMEOUT_S = 60.0


class SpawnError(RuntimeError):
    """A spawned rank failed; `rank` is the first rank that reported a failure."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(
            f"megabuf.testing.spawn: rank {rank} failed (remaining ranks were terminated):\n"
            f"{detail}"
        )
        self.rank = rank
        self.detail = detail


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or an equivalent launcher)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):  # respects taskset / cgroup cpusets, unlike cpu_count
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


PORT_ATTEMPTS = 3  # [Note: a port taken before rank 0 binds it]


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float | None = None
) -> list[Any]:
    """Run `fn(*args)` on every rank; return the ranks' return values in rank order.

    Under torchrun: call `fn(*args)` here and return `[its value]`. Otherwise `fn`, `args` and
    the return values must be picklable (`fn` defined at module level); tensors in the return
    values come back as CPU tensors with their own storage ([Note: rank results by value]).
    Raises `SpawnError` if any rank raises or exits non-zero, and `TimeoutError` after
    `timeout_s` seconds (None: no limit); in both cases every other rank is terminated first.
    A run that lost its port to another process is started again ([Note: a port taken before
    rank 0 binds it]).
    """
    if under_torchrun():
        return [fn(*args)]
    if world_size < 1:
        raise ValueError(f"megabuf.testing.spawn: world_size must be >= 1, got {world_size}")
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return _spawn_once(fn, world_size, args, timeout_s)
        except SpawnError as err:
            if "EADDRINUSE" not in err.detail or attempt == PORT_ATTEMPTS:
                raise
    return []  # not reached: the last attempt returns or raises


def _spawn_once(
    fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout_s: float | None
) -> list[Any]:
    ctx = mp.get_context("spawn")
    threads = max(1, _cpu_count() // world_size)
    common = {
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        # Chosen once by the parent so all ranks agree; rank 0's TCPStore binds it.
        "MASTER_PORT": str(free_port()),
    }
    procs: list[BaseProcess] = []
    conns: list[mp_connection.Connection] = []
    try:
        with _malloc_env():
            for rank in range(world_size):
                env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_child_main,
                    args=(fn, args, env, threads, send),
                    name=f"megabuf-rank{rank}",
                )
                proc.start()
                send.close()  # only the child may hold the write end, so its death reads as EOF
                procs.append(proc)
                conns.append(recv)
        results = _collect(procs, conns, timeout_s)
        _check_exit_codes(procs)
        return results
    finally:
        _reap(procs)
        for conn in conns:
            conn.close()


@contextmanager
def _malloc_env() -> Iterator[None]:
    """Set the malloc variables (unless the user set them) while children start, then restore."""
    added = [k for k in _MALLOC_ENV if k not in os.environ]
    for key in added:
        os.environ[key] = _MALLOC_ENV[key]
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _child_main(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    threads: int,
    conn: mp_connection.Connection,
) -> None:
    os.environ.update(env)
    # Ranks share the machine's cores; oversubscribed intra-op threads only fight each other.
    torch.set_num_threads(threads)
    try:
        message: tuple[str, Any] = ("ok", fn(*args))
    except SystemExit as exc:  # sys.exit(0) inside fn is a normal end
        ok = exc.code in (None, 0)
        message = ("ok", None) if ok else ("error", f"SystemExit({exc.code!r})")
    except BaseException:  # report everything, KeyboardInterrupt included, then exit non-zero
        message = ("error", traceback.format_exc())
    if message[0] == "ok" and dist.is_initialized():
        # Wait for every rank before tearing gloo down: destroying the group while a peer still
        # works (e.g. rank 0's --check pass) aborts the process from gloo's threads.
        dist.barrier()
        dist.destroy_process_group()  # a clean shutdown; avoids torch's "not destroyed" warning
    try:
        payload = encode_result(message)
    except Exception:  # e.g. an unpicklable return value
        message = ("error", f"could not send rank result to parent:\n{traceback.format_exc()}")
        payload = encode_result(message)
    conn.send_bytes(payload)
    conn.close()
    if message[0] != "ok":
        os._exit(1)  # skip atexit/finalizers that could block on a dead peer


def _collect(
    procs: list[BaseProcess], conns: list[mp_connection.Connection], timeout_s: float | None
) -> list[Any]:
    """Wait for every rank's report; raise on the first failure or at the deadline."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = set(range(len(conns)))
    results: dict[int, Any] = {}
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = mp_connection.wait([conns[r] for r in pending], timeout=remaining)
        if not ready:
            raise TimeoutError(
                f"megabuf.testing.spawn: ranks {sorted(pending)} did not finish within "
                f"{timeout_s} s (a rank stuck in a collective its peers never entered?)"
            )
        for rank in sorted(r for r in pending if conns[r] in ready):
            pending.discard(rank)
            status, payload = _receive(conns[rank], procs[rank])
            if status != "ok":
                raise SpawnError(rank, payload)
            results[rank] = payload
    return [results[rank] for rank in range(len(procs))]


def encode_result(message: Any) -> bytes:
    """A rank's report as bytes that hold every tensor by value ([Note: rank results by value])."""
    buf = io.BytesIO()
    torch.save(message, buf)
    return buf.getvalue()


def decode_result(data: bytes) -> Any:
    """Inverse of `encode_result`; tensors land on the CPU. The bytes come from our own child
    process, so full unpickling (`weights_only=False`) is what is wanted."""
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _receive(conn: mp_connection.Connection, proc: BaseProcess) -> tuple[str, Any]:
    try:
        status, payload = decode_result(conn.recv_bytes())
        return str(status), payload
    except EOFError:  # died without reporting: a signal, os._exit, or the OOM killer
        proc.join(_REAP_TIMEOUT_S)
        return "error", f"process exited with {_describe_exit(proc.exitcode)} without reporting"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "no exit code (still running)"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _check_exit_codes(procs: list[BaseProcess]) -> None:
    for rank, proc in enumerate(procs):
        proc.join(_EXIT_TIMEOUT_S)
        if proc.exitcode != 0:
            raise SpawnError(
                rank, f"reported success but ended with {_describe_exit(proc.exitcode)}"
            )


def _reap(procs: list[BaseProcess]) -> None:
    """Terminate and join ranks still running (after a failure, peers are often stuck)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(_REAP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
