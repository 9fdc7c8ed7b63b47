"""Loss scalers for fp16 training: a constant one and a dynamic one, both with `state_dict`.

[Note: dynamic loss scaling]
The loss is multiplied by `scale` before backward so small fp16 grads do not underflow; the
optimizer multiplies grads by `inv_scale` before using them. A step whose grads hold inf/NaN on
any rank is skipped on every rank. Each skipped step spends one unit of `hysteresis`; when none
is left the scale is multiplied by `backoff_factor` (never below `min_scale`). After
`growth_interval` consecutive good steps the scale is multiplied by `growth_factor` and the
hysteresis budget is refilled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class GradScaler:
    """Base: a scale the loss is multiplied by, and its inverse for the grads."""

    def __init__(self, initial_scale: float, device: torch.device | str = "cpu") -> None:
        if initial_scale <= 0:
            raise ValueError(f"megabuf: loss scale must be > 0, got {initial_scale}")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32, device=device)

    @property
    def scale(self) -> Tensor:
        """1-element fp32 tensor."""
        return self._scale

    @property
    def inv_scale(self) -> Tensor:
        """1-element fp32 tensor, 1 / scale."""
        return self._scale.double().reciprocal().float()

    def update(self, found_inf: bool) -> None:
        """Called once per step with the globally reduced inf/NaN flag."""

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self._scale.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))


class ConstantGradScaler(GradScaler):
    """A fixed scale; steps with inf/NaN are still skipped."""


class DynamicGradScaler(GradScaler):
    """Scale that backs off on inf/NaN and grows after a run of good steps; see
    [Note: dynamic loss scaling]."""

    def __init__(
        self,
        initial_scale: float = 2.0**32,
        *,
        min_scale: float = 1.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(initial_scale, device)
        if not 0 < min_scale <= initial_scale:
            raise ValueError(
                f"megabuf: DynamicGradScaler min_scale={min_scale} must be in (0, initial_scale="
                f"{initial_scale}]"
            )
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"megabuf: DynamicGradScaler needs growth_factor > 1 (got {growth_factor}) and "
                f"0 < backoff_factor < 1 (got {backoff_factor})"
            )
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(
                f"megabuf: DynamicGradScaler growth_interval={growth_interval} and hysteresis="
                f"{hysteresis} must be >= 1"
            )
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_tracker = 0  # consecutive good steps
        self.hysteresis_tracker = hysteresis  # inf steps left before backing off

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                new = max(self._scale.item() * self.backoff_factor, self.min_scale)
                self._scale.fill_(new)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self._scale.mul_(self.growth_factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": float(self._scale.item()),
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.growth_tracker = int(state.get("growth_tracker", 0))
        self.hysteresis_tracker = int(state.get("hysteresis_tracker", self.hysteresis))
