"""The bucket layout's fingerprint, compared across replica groups at every step's first
Manager all-reduce.

[Note: layout fingerprint]
Replica group rank i all-reduces its reduced shards with rank i of every other group, bucket
by bucket, so every group must cut its buffers alike: same strategy, group size, dtypes, param
order and bucket boundaries (bucket_size="auto" re-plans inside each group, from each group's
own measurements). A mismatch would sum unrelated grads silently. So the layout is hashed into
three 20-bit integers h, and the first Manager all-reduce of every step (issued before any
grad crosses, so it pairs with the other groups' first one whatever their bucket counts) sums
[1, h, h^2] over the participants: n, sum h and sum h^2. All participants hold the same h
exactly when sum h = n h_own and sum h^2 = n h_own^2 for every chunk (values below 2^52: exact in
float64). A group that is healing contributes zeros (the Manager zeroes a non-participant's
tensor) and still checks its own h against the participants'. On a mismatch every group raises
`LayoutMismatchError` before `should_commit`, so nothing is stepped on scrambled grads.
The same sum's n is the number of groups whose grads the step's all-reduces hold: the grads are
divided by it (`contributors`). It is `manager.num_participants()` except at step 0, where
torchft's init_sync heals every group but one and still counts them as participants while
the Manager zeroes their contributions. (The all-reduces of one step complete in issue order, so
it has landed when a grad all-reduce is waited for.)
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch.distributed import ReduceOp

CHUNK_BITS = 20
CHUNKS = 3


class LayoutMismatchError(RuntimeError):
    """Replica groups laid their buckets out differently ([Note: layout fingerprint])."""


def layout_fingerprint(model: Any) -> int:
    """A 60-bit hash of what pairs rank i of one group with rank i of another: the strategy,
    the group size and, per buffer, dtypes, params (names, shapes) and bucket boundaries."""
    engine = model.engine
    parts: list[str] = [engine.config.sharding.name, str(engine.topology.dp_size)]
    for buffer in engine.buffers:
        parts.append(f"buffer {buffer.param_dtype} {buffer.grad_dtype} {buffer.numel}")
        for bucket in buffer.buckets:
            names = [f"{engine.param_to_name[p]}{tuple(p.shape)}" for p in bucket.params_list]
            parts.append(f"bucket {bucket.offset} {bucket.numel_unpadded} {','.join(names)}")
    digest = hashlib.sha256("\n".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - CHUNK_BITS * CHUNKS)


def _chunks(value: int) -> list[int]:
    mask = (1 << CHUNK_BITS) - 1
    return [(value >> (CHUNK_BITS * i)) & mask for i in range(CHUNKS)]


class LayoutCheck:
    """One step's fingerprint all-reduce: `expect` at the step's start, `issue_once` at its
    first Manager all-reduce, `check` before `should_commit`."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.fingerprint: int | None = None
        self._work: Any = None
        self._tensor: torch.Tensor | None = None
        self._device: torch.device | None = None

    def expect(self, fingerprint: int, device: torch.device) -> None:
        """This step's fingerprint, carried on `device` (the params', as the grads it joins)."""
        self.fingerprint, self._work, self._tensor = fingerprint, None, None
        self._device = device

    def issue_once(self) -> None:
        if self.fingerprint is None or self._tensor is not None:
            return
        h = [float(c) for c in _chunks(self.fingerprint)]
        values = [1.0, *h, *[c * c for c in h]]
        self._tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
        self._work = self.manager.allreduce(self._tensor, reduce_op=ReduceOp.SUM)

    def _landed(self) -> torch.Tensor | None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._tensor

    def contributors(self) -> int:
        """How many groups contributed to this step's all-reduces (at least 1)."""
        tensor = self._landed()
        if tensor is None or self.manager.errored() is not None:
            return max(1, int(self.manager.num_participants()))  # voted down anyway
        return max(1, round(tensor[0].item()))

    def check(self, *, rank: int) -> None:
        """Raise `LayoutMismatchError` if a participant's layout differs from this group's;
        nothing to check when no grad crossed this step or the Manager recorded an error."""
        tensor = self._landed()
        if tensor is None or self.fingerprint is None:
            return
        if self.manager.errored() is not None:
            return  # the sums may be partial; the step is voted down anyway
        n = tensor[0].item()
        own = _chunks(self.fingerprint)
        sums, squares = tensor[1 : 1 + CHUNKS].tolist(), tensor[1 + CHUNKS :].tolist()
        if all(s == n * h and q == n * h * h for s, q, h in zip(sums, squares, own, strict=True)):
            return
        raise LayoutMismatchError(
            f"megabuf: replica groups laid their buckets out differently (rank {rank}, layout "
            f"fingerprint {self.fingerprint:#x}, {int(n)} participating groups): rank i of each "
            "group all-reduces its shards with rank i of the others bucket by bucket, so every "
            "group needs the same strategy, group size, dtypes, params and bucket boundaries. "
            "Give every group the same config and an explicit bucket_size (not 'auto', which "
            "each group measures for itself). [Note: layout fingerprint]"
        )
