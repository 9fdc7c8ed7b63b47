"""What the inner torch optimizer steps: `MainParam`s, one per (model param, owned range).

[Note: main params]
A `MainParam` is one fp32 leaf tensor the inner optimizer steps, standing for elements
[param_start, param_end) of a flattened model param:
- distributed optimizer: one per `ShardPiece` of this rank's shards (1-D; param-shaped whole
  params under [Note: whole-param owners] in megabuf/pure/owners.py). For fp32 params the main
  param *is* the `param_data` view and its grad *is* the `grad_data` view, so the inner
  optimizer updates the buffer in place; for bf16/fp16 params it is an fp32 copy, written back
  into `param_data` (rounded) after each step.
- non-distributed optimizers: one per whole param (param-shaped). fp32 params are stepped
  directly (their `.grad` is already `main_grad`); bf16/fp16 params get an fp32 copy.
Pointwise optimizers give the same result on a piece as on the whole param, which is why
sharding is invisible in the maths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.pure.layout import shard_pieces


@dataclass
class MainParam:
    """One tensor the inner optimizer steps; see [Note: main params]."""

    model_param: nn.Parameter
    key: str  # model-space name of the param (checkpoint key)
    param_start: int  # range of the flattened model param this stands for
    param_end: int
    main: Tensor  # fp32 leaf: 1-D piece, or param-shaped when whole
    model_grad: Tensor  # the reduced grad of this range (view of grad_data / main_grad)
    model_data: Tensor | None  # where updated values are copied; None if `main` is that memory
    owner: bool  # this rank writes the range into checkpoints

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start

    @property
    def is_copy(self) -> bool:
        return self.model_data is not None

    def attach_grad(self) -> bool:
        """Point `main.grad` at the reduced grad (fp32 copy if needed); True if it copied."""
        grad = self.model_grad
        if grad.shape != self.main.shape:
            grad = grad.view(self.main.shape)
        if grad.dtype == torch.float32:
            if self.main.grad is not self.model_grad:
                self.main.grad = grad
            return False
        self.main.grad = grad.to(torch.float32)
        return True

    def reload(self) -> None:
        """Re-read the model's current values (after the model param was edited)."""
        if self.model_data is not None:
            self.main.copy_(self.model_data.view(self.main.shape))


def write_back_all(main_params: Sequence[MainParam]) -> None:
    """Copy the updated values of every main param that is a copy into the model's memory
    (rounded to its dtype): one `_foreach_copy_` per (device, model dtype, main's device).
    Host main params (cpu offload) are copied without blocking the host, ordered on the
    device's current stream ([Note: cpu offload] in offload.py)."""
    Key = tuple[torch.device, torch.dtype, torch.device]
    lists: dict[Key, tuple[list[Tensor], list[Tensor]]] = {}
    for mp in main_params:
        if mp.model_data is not None:
            key = (mp.model_data.device, mp.model_data.dtype, mp.main.device)
            dst, src = lists.setdefault(key, ([], []))
            dst.append(mp.model_data)
            src.append(mp.main.view(mp.model_data.shape))
    for (device, _, src_device), (dst, src) in lists.items():
        if src_device == device:
            torch._foreach_copy_(dst, src)
            continue
        for d, s in zip(dst, src, strict=True):  # pinned host -> device: asynchronous
            d.copy_(s, non_blocking=True)


def sharded_main_params(
    buffer: _ParamAndGradBuffer, keys: dict[nn.Parameter, str]
) -> list[MainParam]:
    """Main params for this rank's shards of every bucket of `buffer` (distributed optimizer)."""
    if buffer.param_data is None and buffer.bucket_params is None:
        raise ValueError(
            "megabuf: DistributedOptimizer needs a model built with "
            "DistributedDataParallelConfig(use_distributed_optimizer=True); this buffer has no "
            "param_data"
        )
    result = []
    for piece in shard_pieces(buffer.layout, buffer.dp_rank, buffer.dp_size):
        param = buffer.params[piece.param_id]
        lo, hi = piece.buffer_start, piece.buffer_start + piece.numel
        param_view = buffer.param_shard_view(lo, hi)  # 1-D, param_dtype (ZeRO-3: the shard)
        grad_view = buffer.reduced_grad(lo, hi)  # 1-D, grad_dtype (the grad shard: optim_grads*)
        if buffer.fp8 is not None:  # the fp32 master is the buffer's ([Note: FP8 params])
            main, model_data = buffer.fp8.master_view(lo, hi), None
        elif param_view.dtype == torch.float32:
            main, model_data = param_view, None
        else:
            main, model_data = param_view.to(torch.float32, copy=True), param_view
        if buffer.layout.owner_of is not None:  # whole params: param-shaped for Muon
            if piece.numel != param.numel():
                raise RuntimeError(
                    f"megabuf: {keys[param]} is split across dp shards (rank {buffer.dp_rank} "
                    f"holds {piece.numel} of {param.numel()} elements) under whole_param_owners; "
                    "a matrix optimizer would orthogonalise part of it (a layout bug)"
                )
            main = main.view(param.shape)
        result.append(
            MainParam(
                param,
                keys[param],
                piece.param_start,
                piece.param_end,
                main,
                grad_view,
                model_data,
                owner=True,
            )
        )
    return result


def whole_main_params(
    params: list[nn.Parameter], keys: dict[nn.Parameter, str], owner: bool
) -> list[MainParam]:
    """Param-shaped main params (non-distributed optimizers)."""
    result = []
    for param in params:
        main_grad = param.main_grad  # type: ignore[attr-defined]
        main: Tensor = param
        model_data: Tensor | None = None
        if param.dtype != torch.float32:
            main = param.detach().to(torch.float32, copy=True)
            model_data = param.data
        result.append(
            MainParam(param, keys[param], 0, param.numel(), main, main_grad, model_data, owner)
        )
    return result
