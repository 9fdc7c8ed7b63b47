"""Who hears of each collective `Collectives` issues, before it is issued.

[Note: collective observers]
`Collectives.observers` is the one place a check that follows every collective hooks in (the
verify mode's collective fingerprint: [Note: verify mode] in megabuf/verify/__init__.py). Each
wrapper's byte accounting (`Collectives._record`, which every wrapper calls before its
torch.distributed call) tells every observer `on_issue(group, op, nbytes)`; a caller whose order of
collectives is fixed by construction (a bucket group's dispatch) wraps its calls in
`issuing(describe)`, which lets each observer check the descriptor against the
other ranks *before* anything is issued (`before_issue`) and labels what is issued inside. With
no observer (the default) `on_issue` costs a loop over an empty list and `issuing` one test
(the descriptor is not even built).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Protocol

import torch
from torch.distributed import ProcessGroup

Group = ProcessGroup | None
Issue = tuple[str, Group, tuple[int, ...]]  # (label, group, descriptor) of what is issued


def dtype_code(dtype: torch.dtype) -> int:
    """A rank-independent number for `dtype` (descriptors are int64 tensors)."""
    return zlib.crc32(str(dtype).encode())


def issue_descriptor(group_id: int, dtype: torch.dtype, numel: int) -> tuple[int, ...]:
    """A bucket group's reduction as `issuing` checks it: (group id, grad dtype, numel)."""
    return group_id, dtype_code(dtype), numel


class CollectiveObserver(Protocol):
    """What an observer of `Collectives` implements ([Note: collective observers])."""

    def on_issue(self, group: Group, op: str, nbytes: Mapping[str, int], label: str) -> None: ...

    def before_issue(self, label: str, group: Group, descriptor: tuple[int, ...]) -> None: ...


class CollectiveObservers:
    """The observers of one `Collectives`, and the label of the calls being issued."""

    def __init__(self) -> None:
        self._observers: list[CollectiveObserver] = []
        self.label = ""  # what the calls issued now are for ("" outside `issuing`)

    def add(self, observer: CollectiveObserver) -> None:
        """From now on `observer` hears of every collective (once, however often added)."""
        if all(o is not observer for o in self._observers):
            self._observers.append(observer)

    def issued(self, group: Group, op: str, nbytes: Mapping[str, int]) -> None:
        for observer in self._observers:
            observer.on_issue(group, op, nbytes, self.label)

    @contextmanager
    def issuing(self, describe: Callable[[], Issue]) -> Iterator[None]:
        """Check the descriptor `describe()` gives (equal on every rank of its group when
        nothing is wrong) before the calls inside are issued, and label them with its label.
        Without observers nothing is described: the dispatch path pays one test."""
        if not self._observers:
            yield
            return
        label, group, descriptor = describe()
        for observer in self._observers:
            observer.before_issue(label, group, descriptor)
        outer, self.label = self.label, label
        try:
            yield
        finally:
            self.label = outer
