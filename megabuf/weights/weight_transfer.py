"""`WeightTransferReceiver`: megabuf's consumer side behind the four-phase weight-transfer
protocol inference engines speak (vLLM's: `init_weight_transfer_engine`, `start_weight_update`,
`update_weights`, `finish_weight_update`), so such an engine consumes `Publisher.publish`
without glue code.

[Note: four-phase receiver]
The phases map onto one `WeightReceiver`:
1. `init_weight_transfer_engine(init_info)`: builds the receiver on the publish group (the
   channel; every rank made the group with `publish_group`). Once.
2. `start_weight_update(update_info)`: the engine is ready to take weights; `update_info` may
   name the `"version"` it expects (the trainers' publish of another version then raises on
   every rank, [Note: publish protocol]).
3. `update_weights(update_info)`: joins one publish (collective over the publish group, in step
   with the trainers' `publish()`) and hands every weight, under its consumer name, to the
   engine's `load_weights(iterable of (name, tensor))`, the loader vLLM models have. Deltas and
   changed-only publishes arrive through the receiver's own flat copies, so what is loaded is
   always the whole, current weights ([Note: element deltas]). Once per update here (megabuf
   sends one version per publish).
4. `finish_weight_update()`: back to idle; returns the version loaded.
A call out of this order raises naming both phases.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor

from megabuf.weights.export import NameMap
from megabuf.weights.publish import PublishGroup, WeightReceiver

LoadWeights = Callable[[Iterable[tuple[str, Tensor]]], Any]


class Phase(enum.Enum):
    NEW = "before init_weight_transfer_engine"
    IDLE = "between updates"
    STARTED = "after start_weight_update"
    UPDATED = "after update_weights"


class WeightTransferReceiver:
    """See [Note: four-phase receiver]. `load_weights` is the engine's loader; `name_map` the
    receiver's (trainer name, tensor) -> consumer pairs."""

    def __init__(
        self, group: PublishGroup, load_weights: LoadWeights, *, name_map: NameMap | None = None
    ) -> None:
        self.group = group
        self.load_weights = load_weights
        self.name_map = name_map
        self.phase = Phase.NEW
        self.receiver: WeightReceiver | None = None
        self._expect: int | None = None

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any] | None = None) -> None:
        self._enter(Phase.NEW, Phase.IDLE, "init_weight_transfer_engine")
        self.receiver = WeightReceiver(self.group, name_map=self.name_map)

    def start_weight_update(self, update_info: Mapping[str, Any] | None = None) -> None:
        self._enter(Phase.IDLE, Phase.STARTED, "start_weight_update")
        version = (update_info or {}).get("version")
        self._expect = int(version) if version is not None else None

    def update_weights(self, update_info: Mapping[str, Any] | None = None) -> list[str]:
        """Receives one publish and loads it; returns the names loaded."""
        self._enter(Phase.STARTED, Phase.UPDATED, "update_weights")
        if self.receiver is None:
            raise RuntimeError("megabuf: update_weights before init_weight_transfer_engine")
        weights = self.receiver.receive(expect_version=self._expect)
        self.load_weights(iter(weights.items()))
        return list(weights)

    def finish_weight_update(self) -> int | None:
        self._enter(Phase.UPDATED, Phase.IDLE, "finish_weight_update")
        return self.receiver.version if self.receiver is not None else None

    def _enter(self, expected: Phase, then: Phase, call: str) -> None:
        if self.phase is not expected:
            raise RuntimeError(
                f"megabuf: {call}() called {self.phase.value}; it belongs {expected.value} "
                "([Note: four-phase receiver]: init once, then start, update, finish per version)"
            )
        self.phase = then
