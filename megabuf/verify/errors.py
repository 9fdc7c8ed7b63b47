"""The verify mode's error ([Note: verify mode])."""

from __future__ import annotations


class VerifyError(RuntimeError):
    """A verify check found ranks that differ; raised on every rank of the checked group."""
