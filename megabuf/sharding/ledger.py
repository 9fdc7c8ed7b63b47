"""`MemoryLedger`: exact bytes the engine holds, per category, with high-water marks.

Persistent categories (e.g. "param_shard", "grad_shard") are recorded once at construction;
transient ones (e.g. "unsharded_params", "grad_buckets") go up when a released storage is
refilled and down when it is released again. The ledger only counts what the engine tells it;
`memory_report()` checks it against an independent walk over unique storages.
"""

from __future__ import annotations

from collections.abc import Mapping


class MemoryLedger:
    """Bytes held now and at most, per category (one per engine; not thread-safe)."""

    def __init__(self) -> None:
        self._now: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._total_peak = 0

    def alloc(self, category: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"megabuf: ledger alloc of {nbytes} bytes in {category!r}")
        now = self._now.get(category, 0) + nbytes
        self._now[category] = now
        self._peak[category] = max(self._peak.get(category, 0), now)
        self._total_peak = max(self._total_peak, sum(self._now.values()))

    def free(self, category: str, nbytes: int) -> None:
        now = self._now.get(category, 0) - nbytes
        if nbytes < 0 or now < 0:
            raise RuntimeError(
                f"megabuf: ledger frees {nbytes} bytes of {category!r} holding "
                f"{self._now.get(category, 0)}; an allocation was released twice"
            )
        self._now[category] = now

    def now(self, category: str) -> int:
        return self._now.get(category, 0)

    def peak(self, category: str) -> int:
        return self._peak.get(category, 0)

    @property
    def total_peak(self) -> int:
        """The largest sum over all categories at any one time."""
        return self._total_peak

    def current(self) -> Mapping[str, int]:
        return dict(self._now)

    def reset_peaks(self) -> None:
        """Forget high-water marks (e.g. after the first, warm-up step)."""
        self._peak = dict(self._now)
        self._total_peak = sum(self._now.values())
