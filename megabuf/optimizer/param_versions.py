"""Keeping fp32 main params in step with edits of the model params.

[Note: main params follow the model params]
An fp32 main param that is a *copy* (of a bf16/fp16 model param, see [Note: main params]) would
silently undo an edit of the model param made after the optimizer was built: the next step
writes main + update back over it. torch bumps `param._version` on every in-place write through
the param itself (`model.load_state_dict(...)`, `with torch.no_grad(): p.mul_(...)`,
`p.copy_(...)`), so the optimizer records every copied param's version after construction, after
each write-back and after its own `load_state_dict`; at the start of `step()` every main param (all
pieces) of a param whose version moved is re-read from the model param.
- The optimizer's own writes do not move `param._version`: the write-back goes through
  `param.data` (an alias with its own version counter) or through views of the `param_data`
  buffer (the buffer's counter), and so do the param all-gathers. Were it otherwise, every step
  would round the fp32 main params to the model's dtype (tests/test_optimizer_contract.py checks
  that sub-ulp updates still add up).
- Writes through `param.data` (`p.data.copy_(...)`) do not move it: call
  `opt.reload_model_params()` after them.
- Load the model before the optimizer (`load_checkpoint` does): the optimizer's `load_state_dict`
  fills the main params from the checkpoint and records the versions, so the model load before it
  triggers no reload. In the other order the main params are re-read from the rounded params.
- Main params that *are* the model's memory (fp32 params) always see edits; they are not tracked.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from megabuf.optimizer.main_params import MainParam

logger = logging.getLogger(__name__)


def _version(param: nn.Parameter) -> int:
    """torch's in-place write counter of `param` (not moved by writes through `param.data`)."""
    return int(param._version)


class ModelParamVersions:
    """The last seen `_version` of every model param that has fp32 main-param copies."""

    def __init__(self, main_params: Iterable[MainParam]) -> None:
        self._copies: dict[nn.Parameter, list[MainParam]] = {}
        for mp in main_params:
            if mp.is_copy:
                self._copies.setdefault(mp.model_param, []).append(mp)
        self._seen: dict[nn.Parameter, int] = {}
        self.record()

    def record(self) -> None:
        """Take the current versions as seen (after the optimizer wrote or loaded the mains)."""
        self._seen = {param: _version(param) for param in self._copies}

    def edited(self) -> list[nn.Parameter]:
        """Params written in place since the last `record()`."""
        return [param for param, seen in self._seen.items() if _version(param) != seen]

    @torch.no_grad()
    def reload(self, params: Iterable[nn.Parameter] | None = None) -> None:
        """Re-read the main params of `params` (default: all copied params), then record."""
        for param in self._copies if params is None else params:
            for mp in self._copies[param]:
                mp.reload()
        self.record()

    def reload_edited(self) -> None:
        """See [Note: main params follow the model params]."""
        edited = self.edited()
        if edited:
            names = [self._copies[p][0].key for p in edited]
            logger.debug("megabuf: reloading main params of %d edited params %s", len(names), names)
            self.reload(edited)
