"""Rank side of tests/test_worker_refs.py: which thread frees a tensor made for one collective."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist

from megabuf.transport.collectives import Collectives
from megabuf.transport.worker_refs import HELD

CALLS = 50


def freed_on_the_main_thread(through_megabuf: bool) -> dict[str, Any]:
    """All-reduce `CALLS` fresh tensors (async, waited for, then dropped, as megabuf's flags and
    norms are) and count how many were freed on this (the main) thread; the rest were freed by
    gloo's worker thread ([Note: a backend thread's last reference])."""
    main, on_main = threading.get_ident(), []

    def freed(_ref: Any) -> None:
        on_main.append(threading.get_ident() == main)

    collectives, refs = Collectives(), []
    for i in range(CALLS):
        tensor = torch.full((10_000,), float(i))
        refs.append(weakref.ref(tensor, freed))
        if through_megabuf:
            collectives.all_reduce(tensor, None, async_op=True).wait()
        else:
            dist.all_reduce(tensor, async_op=True).wait()
        del tensor
    HELD.release_at_exit(wait_s=1.0)  # what exit does: wait for the threads, drop what they left
    HELD.held = []  # (released above; a kept one would only be leaked)
    return {"on_main": sum(on_main), "freed": len(on_main)}
