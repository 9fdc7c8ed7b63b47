"""The verify mode's levels and the spike guards' settings, checked where the config is built
([Note: verify mode] in megabuf/verify/__init__.py)."""

from __future__ import annotations

import math
from typing import Any

VERIFY_LEVELS: dict[str, frozenset[str]] = {
    "off": frozenset(),
    "collectives": frozenset({"collectives"}),
    "replicas": frozenset({"replicas"}),
    "norms": frozenset({"norms"}),
    "all": frozenset({"collectives", "replicas", "norms"}),
}
"""`DistributedDataParallelConfig.verify` values -> the checks they run."""

LARGE_GRAD_ACTIONS = {False: "off", True: "raise", "off": "off", "raise": "raise", "skip": "skip"}
"""`check_for_large_grads` values -> what a large grad norm does."""


def verify_checks(level: str) -> frozenset[str]:
    """The checks `level` runs (a subset of {"collectives", "replicas", "norms"})."""
    return VERIFY_LEVELS[level]


def large_grad_action(value: bool | str) -> str:
    """ "off", "raise" or "skip" for a `check_for_large_grads` value."""
    return LARGE_GRAD_ACTIONS[value]


def check_verify_fields(config: Any) -> None:
    """Reject a `verify`, `check_for_large_grads` or `grad_norm_skip_threshold` value, naming
    the field and its valid values."""
    field = "megabuf: DistributedDataParallelConfig"
    if not isinstance(config.verify, str) or config.verify not in VERIFY_LEVELS:
        raise ValueError(f"{field}.verify={config.verify!r} is not one of {list(VERIFY_LEVELS)}")
    large = config.check_for_large_grads
    if not isinstance(large, (bool, str)) or large not in LARGE_GRAD_ACTIONS:
        raise ValueError(
            f"{field}.check_for_large_grads={large!r} must be False, True (= 'raise'), 'off', "
            "'raise' or 'skip'"
        )
    threshold = config.grad_norm_skip_threshold
    if threshold is None:
        return
    number = isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
    if not number or math.isnan(threshold) or threshold <= 0:
        raise ValueError(
            f"{field}.grad_norm_skip_threshold={threshold!r} must be a positive number (skip "
            "the step when the global grad norm exceeds it) or None (off)"
        )
