"""Settings every benchmark module shares, below all of them (no megabuf imports)."""

from __future__ import annotations

# Every system trains with torch AdamW (or its sharded equivalent) with these settings. eps is
# 1e-6 rather than 1e-8 so that the one-step check is not dominated by elements whose grad is at
# rounding level (Adam's first step is lr * g / (|g| + eps), i.e. +-lr for any |g| >> eps).
OPTIMIZER_KWARGS: dict[str, float] = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
