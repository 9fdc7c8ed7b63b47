"""The spike guards Megatron users expect: `check_for_large_grads` and
`grad_norm_skip_threshold` ([Note: verify mode]; the fields in megabuf/config.py)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from megabuf.verify.errors import VerifyError

logger = logging.getLogger(__name__)

LARGE_GRAD_FACTOR = 10.0  # a norm this many times the history's largest is "large"
LARGE_GRAD_WINDOW = 100  # finite norms of applied steps kept
LARGE_GRAD_MIN_HISTORY = 5  # no verdict before this many


class SpikeGuard:
    """Decides, from the global grad norm (the same on every rank), whether to skip the step,
    or raises; `agree(flag)` returns the flag's max over every rank that steps, so a rank whose
    history differed still follows the others. `skipped` counts the skips by reason."""

    def __init__(
        self, large: str, threshold: float | None, agree: Callable[[bool], bool], rank: int
    ) -> None:
        self.large, self.threshold, self.agree, self.rank = large, threshold, agree, rank
        self.history: deque[float] = deque(maxlen=LARGE_GRAD_WINDOW)
        self.skipped = {"large_grads": 0, "grad_norm_skip_threshold": 0}
        self.steps = 0

    @property
    def active(self) -> bool:
        return self.large != "off" or self.threshold is not None

    def _is_large(self, grad_norm: float) -> bool:
        if self.large == "off" or len(self.history) < LARGE_GRAD_MIN_HISTORY:
            return False
        return grad_norm > LARGE_GRAD_FACTOR * max(self.history)

    def skip(self, grad_norm: float) -> bool:
        """True: skip this step (on every rank); raises under check_for_large_grads="raise"."""
        self.steps += 1
        if not self.active:
            return False
        over = self.threshold is not None and grad_norm > self.threshold
        large = self.agree(self._is_large(grad_norm))
        over = self.agree(over)
        if large and self.large == "raise":
            raise VerifyError(
                f"megabuf: check_for_large_grads: the global grad norm {grad_norm!r} at step "
                f"{self.steps} is more than {LARGE_GRAD_FACTOR}x the largest of the last "
                f"{len(self.history)} ({max(self.history)!r}) (rank {self.rank}; every rank that "
                "steps raises). Set check_for_large_grads='skip' to skip such steps instead"
            )
        reason = "large_grads" if large else "grad_norm_skip_threshold" if over else None
        if reason is None:
            self.history.append(grad_norm)
            return False
        self.skipped[reason] += 1
        if self.rank == 0:
            logger.warning(
                "megabuf: step %d skipped on every rank by %s: global grad norm %s (threshold "
                "%s, history max %s); %s steps skipped so far", self.steps, reason, grad_norm,
                self.threshold, max(self.history, default=None), self.skipped[reason],
            )  # fmt: skip
        return True
