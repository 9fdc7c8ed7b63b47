"""`megabuf.testing.spawn` hands rank results that hold tensors back whatever the child does next
([Note: rank results by value] in megabuf/testing/launch.py).

The failure it fixes (first GPU run, 2026-11-26): torch's multiprocessing pickler sends a CPU
tensor as a file descriptor that a `resource_sharer` thread in the child hands over on request;
once the child has exited, the parent's unpickling fails with FileNotFoundError. On that machine
the child always won the race. Here the parent waits for the child to exit before reading, which
makes the race deterministic: the raw pipe fails (the control), megabuf's encoding does not."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from multiprocessing import connection as mp_connection
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from megabuf.testing import spawn
from megabuf.testing.launch import decode_result, encode_result

CTX = mp.get_context("spawn")


def _tensors(seed: int) -> dict[str, Any]:
    """Results of the kinds ranks return: plain, shared-memory, bf16, a non-contiguous view, a
    scalar, nested in lists and dicts next to plain Python values."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(6, 5, generator=gen)
    shared = torch.arange(12.0).share_memory_()
    return {
        "plain": base,
        "shared": shared,
        "bf16": base.to(torch.bfloat16),
        "view": base.t()[1:4],
        "scalar": torch.tensor(3.5),
        "nested": [{"a": base[0], "n": seed}, (shared[:3], "text")],
    }


def _check_equal(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device.type == "cpu"
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert not got.is_shared(), "a result must own its storage, not map the child's"
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            _check_equal(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            _check_equal(g, w)
    else:
        assert got == want


def _send_raw_and_exit(conn: mp_connection.Connection) -> None:
    conn.send(_tensors(1))  # torch's pickler: shared-memory handles
    conn.close()


def _send_encoded_and_exit(conn: mp_connection.Connection) -> None:
    conn.send_bytes(encode_result(_tensors(1)))
    conn.close()


def _read_after_exit(target: Any) -> mp_connection.Connection:
    recv, send = CTX.Pipe(duplex=False)
    proc = CTX.Process(target=target, args=(send,))
    proc.start()
    send.close()
    proc.join(120)
    assert proc.exitcode == 0, f"child ended with {proc.exitcode}"
    return recv


def test_raw_pipe_loses_shared_memory_tensors_once_the_child_exited() -> None:
    """The control: the failure mode is real on this torch. If torch ever sends tensors by value
    itself, this fails and says so; [Note: rank results by value] would then be redundant."""
    recv = _read_after_exit(_send_raw_and_exit)
    with pytest.raises(OSError):  # FileNotFoundError / ConnectionRefusedError in resource_sharer
        recv.recv()
    recv.close()


def test_encoded_result_survives_the_child_exiting_first() -> None:
    recv = _read_after_exit(_send_encoded_and_exit)
    _check_equal(decode_result(recv.recv_bytes()), _tensors(1))
    recv.close()


def _rank_returns_tensors() -> dict[str, Any]:
    import os

    return _tensors(int(os.environ["RANK"]))


def test_spawn_returns_tensors_from_ranks_that_exited() -> None:
    results = spawn(_rank_returns_tensors, 2, timeout_s=120)
    for rank, got in enumerate(results):
        _check_equal(got, _tensors(rank))


def _rank_joins_a_group() -> int:
    import torch.distributed as dist

    import megabuf

    megabuf.init_distributed()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


@contextlib.contextmanager
def _first_port_taken(
    monkeypatch: pytest.MonkeyPatch, module: Any, name: str
) -> Iterator[list[int]]:
    """`module.name` (a free-port chooser) hands out, first, a port another socket holds (as
    another process on the machine would), then fresh ones; yields every port handed out."""
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = [int(taken.getsockname()[1])]
    real = getattr(module, name)

    def port_once_taken() -> int:
        ports.append(real())
        return ports[-2] if len(ports) == 2 else ports[-1]

    monkeypatch.setattr(module, name, port_once_taken)
    try:
        yield ports
    finally:
        taken.close()


def test_a_port_taken_before_rank_0_binds_it_is_retried_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """[Note: a port taken before rank 0 binds it]: the first port handed out is held by another
    socket, so rank 0's store fails with EADDRINUSE; spawn starts the run again on the next
    port."""
    from megabuf.testing import launch

    with _first_port_taken(monkeypatch, launch, "free_port") as ports:
        assert spawn(_rank_joins_a_group, 1, timeout_s=120) == [0]
    assert len(ports) == 3, ports  # the taken one, then a second attempt on a fresh port


def _pool_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def test_a_pool_whose_first_port_is_taken_starts_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The test pool (tests/dist_pool.py) has the same race as spawn: its first port is held by
    another socket, rank 0's store fails with EADDRINUSE, and the pool starts again on a fresh
    port instead of timing out its first case."""
    import dist_pool

    with _first_port_taken(monkeypatch, dist_pool, "_free_port") as ports:
        pool = dist_pool.DistPool(2, timeout_s=60)
        try:
            assert pool.run(_pool_rank) == [0, 1]
        finally:
            pool.close()
    assert len(ports) == 3, ports  # the taken one, then a second start on a fresh port
