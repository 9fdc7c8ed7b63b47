"""The collective-sequence fingerprint ([Note: verify mode], collectives).

`CollectiveLog` observes one `Collectives` ([Note: collective observers]): per process group a
running CRC of every entry since the last check, the count, and the first LOG_LIMIT entries
(the short log a mismatch is named from). `before_issue` agrees a bucket group's descriptor over
its group before the bucket's collectives are issued; `check` compares the fingerprints.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from megabuf.transport.collectives import Collectives, Group
from megabuf.transport.devices import comm_device
from megabuf.transport.observers import dtype_code
from megabuf.verify.errors import VerifyError

LOG_LIMIT = 256  # entries kept per group between checks (the hash covers all of them)
SIZE_FREE_OPS = frozenset(
    {"all_to_all", "send", "recv", "batch_p2p", "all_gather_object", "broadcast_object",
     "all_reduce_sparse"}
)  # fmt: skip
"""Ops whose byte counts legitimately differ between ranks: fingerprinted by op only."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2)  # fmt: skip


def _dtype_name(code: int) -> str:
    names = {dtype_code(d): str(d).removeprefix("torch.") for d in _DTYPES}
    return names.get(code, f"dtype#{code}")


@dataclass
class GroupLog:
    """One group's entries since its last check."""

    count: int = 0
    crc: int = 0
    entries: list[str] = field(default_factory=list)
    issued_buckets: int = 0  # `before_issue` calls since the last check


class CollectiveLog:
    """Observer of one `Collectives` ([Note: collective observers]); see the module docstring.

    `names`: the process groups by name (messages); `rank`: the global rank (messages)."""

    def __init__(self, collectives: Collectives, names: Mapping[str, Group], rank: int) -> None:
        self.collectives = collectives
        self.rank = rank
        self._names = {id(g): n for n, g in reversed(list(names.items())) if g is not None}
        self._logs: dict[int, GroupLog] = {}
        self._quiet = False  # during this log's own exchanges
        self.checks = 0  # comparisons made (tests read it)
        collectives.observers.add(self)

    def name_of(self, group: Group) -> str:
        return "world" if group is None else self._names.get(id(group), "other")

    def _log(self, group: Group) -> GroupLog:
        return self._logs.setdefault(id(group), GroupLog())

    def on_issue(self, group: Group, op: str, nbytes: Mapping[str, int], label: str) -> None:
        if self._quiet:
            return
        size = -1 if op in SIZE_FREE_OPS else nbytes["input_nbytes"] + nbytes["output_nbytes"]
        entry = f"{op}({size} bytes{', ' + label if label else ''})"
        log = self._log(group)
        log.count += 1
        log.crc = zlib.crc32(entry.encode(), log.crc)
        if len(log.entries) < LOG_LIMIT:
            log.entries.append(entry)

    @contextmanager
    def _exchange(self) -> Iterator[None]:
        """This log's own collectives are not part of the fingerprint."""
        self._quiet = True
        try:
            yield
        finally:
            self._quiet = False

    def _gather(self, values: Sequence[int], group: Group) -> list[tuple[int, ...]]:
        """Every rank's `values` (int64), in group-rank order."""
        size = self.collectives.size(group)
        mine = torch.tensor(list(values), dtype=torch.int64, device=comm_device(group))
        out = torch.empty(size * mine.numel(), dtype=torch.int64, device=mine.device)
        with self._exchange():
            self.collectives.all_gather(out, mine, group, async_op=False)
        return [tuple(row) for row in out.view(size, -1).tolist()]

    def _sides(self, values: Sequence[object], group: Group) -> str:
        """'ranks [0, 2]: a; ranks [1]: b' (global ranks) for per-group-rank `values`."""
        by_value: dict[str, list[int]] = {}
        for group_rank, value in enumerate(values):
            rank = self.collectives.global_rank(group, group_rank)
            by_value.setdefault(str(value), []).append(rank)
        return "; ".join(f"ranks {ranks}: {value}" for value, ranks in by_value.items())

    def before_issue(self, label: str, group: Group, descriptor: tuple[int, ...]) -> None:
        """Agree `(position, *descriptor)` over `group` before `label`'s collectives are issued
        (descriptor: bucket group id, grad dtype code, numel)."""
        if self._quiet or self.collectives.size(group) == 1:
            return
        log = self._log(group)
        rows = self._gather((log.issued_buckets, *descriptor), group)
        log.issued_buckets += 1
        if len(set(rows)) > 1:
            described = [
                f"bucket group {r[1]} ({_dtype_name(r[2])}, {r[3]} elements)" for r in rows
            ]
            raise VerifyError(
                f"megabuf verify (rank {self.rank}): the ranks of group "
                f"{self.name_of(group)} are about to issue different collectives as bucket "
                f"reduction #{log.issued_buckets - 1} since the last grad sync: "
                f"{self._sides(described, group)}. Nothing was issued (it would pair the wrong "
                "buffers or hang); the dispatch order is fixed by construction ([Note: dispatch "
                "order]), so the rank(s) on the smaller side issue out of order"
            )

    def check(self, groups: Sequence[Group]) -> None:
        """Compare each group's fingerprint since its last check over the group (in the given
        order, the same on every rank); raise on every rank naming the first difference."""
        for group in groups:
            log = self._logs.pop(id(group), GroupLog())
            if self.collectives.size(group) == 1:
                continue
            self.checks += 1
            rows = self._gather((log.count, log.crc), group)
            if len(set(rows)) > 1:
                self._raise_first_difference(group, log, rows)

    def _raise_first_difference(
        self, group: Group, log: GroupLog, rows: Sequence[tuple[int, ...]]
    ) -> None:
        with self._exchange():
            logs = self.collectives.all_gather_object(log.entries, group)
        longest = max(len(entries) for entries in logs)
        index = next(
            (i for i in range(longest) if len({e[i] if i < len(e) else None for e in logs}) > 1),
            None,
        )
        counts = self._sides([f"{count} collectives" for count, _ in rows], group)
        if index is None:
            where = f"beyond the first {LOG_LIMIT} kept (counts: {counts})"
        else:
            at = [e[index] if index < len(e) else "nothing" for e in logs]
            where = f"#{index}: {self._sides(at, group)} (counts: {counts})"
        raise VerifyError(
            f"megabuf verify (rank {self.rank}): the collectives issued on group "
            f"{self.name_of(group)} since the last grad sync differ between its ranks; the "
            f"first difference is collective {where}. Every rank of the group raises this"
        )
