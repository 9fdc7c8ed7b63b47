"""`StorageStash`: release device storages in place and bring them back, bytes intact.

[Note: release in place]
A storage is released with `untyped_storage().resize_(0)` and restored with `resize_(nbytes)`
plus a copy from its host copy: the storage *object* never changes, so every tensor viewing it
(`param.data`, `param.main_grad`, a bucket's `grad_data`, the optimizer's references, tensors
autograd saved in a forward) sees the restored bytes, and no tensor's version counter moves
(the copy goes storage to storage), so the optimizer does not mistake a restore for an edit of
the params ([Note: main params follow the model params] in optimizer/param_versions.py).
Storages are collected once per distinct storage (a tied weight, an fp32 main param that *is*
the `param_data` view), in the order the categories are added: the first category a storage is
seen under is the one its bytes are counted in. A storage already at 0 bytes (a released ZeRO
full bucket) is left alone. Storages not kept (dropped grads, scratch) come back zero-filled.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class _Entry:
    storage: torch.UntypedStorage
    nbytes: int
    category: str
    keep: bool
    host: Tensor | None = None  # 1-D uint8 host copy (pinned with CUDA) while released


@dataclass
class StorageStash:
    """The distinct storages of one offload, on `device`, grouped by category."""

    device: torch.device
    entries: list[_Entry] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set)  # data_ptr of every collected storage

    def add(self, category: str, tensors: Iterable[Tensor | None], *, keep: bool) -> None:
        """Collect the storages of `tensors` on this device not collected yet (0-byte ones
        and tensors elsewhere, e.g. cpu_offload's host main params, are skipped)."""
        for tensor in tensors:
            if tensor is None or tensor.device != self.device:
                continue
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if nbytes == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            self.entries.append(_Entry(storage, nbytes, category, keep))

    def nbytes(self) -> dict[str, int]:
        """Bytes per category (every category added, even with 0 bytes)."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.category] = out.get(e.category, 0) + e.nbytes
        return out

    @property
    def host_nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.keep)

    def release(self) -> None:
        """Copy the kept storages to the host, then resize every storage to 0 bytes."""
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for e in self.entries:
                if e.keep:
                    e.host = torch.empty(e.nbytes, dtype=torch.uint8, device="cpu", pin_memory=pin)
                    e.host.untyped_storage().copy_(e.storage)
            if pin:
                torch.cuda.synchronize(self.device)
            for e in self.entries:
                e.storage.resize_(0)

    def restore(self) -> None:
        """Resize every storage back and refill it: kept ones bitwise, the others with zeros."""
        with torch.no_grad():
            for e in self.entries:
                e.storage.resize_(e.nbytes)
                if e.host is not None:
                    e.storage.copy_(e.host.untyped_storage())
                    e.host = None
                else:
                    e.storage.fill_(0)  # type: ignore[attr-defined]
