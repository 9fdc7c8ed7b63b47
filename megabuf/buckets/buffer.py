"""`_ParamAndGradBuffer`: one contiguous grad (and, sharded, param) buffer per dtype pair.

The layout comes from the planner (`megabuf.planning.plan`, see [Note: buffer layout]); this module
only allocates tensors and points params at views of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megabuf.config import DistributedDataParallelConfig
from megabuf.fp8 import Fp8BufferPart, Fp8Params
from megabuf.pure.layout import BufferLayout, ParamSlot
from megabuf.sharding.grads import allocate_bucket_grads


class _ParamAndGradBucket:
    """A contiguous slice of a buffer whose grads are reduced in one collective."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        param_data: Tensor | None,
        grad_data: Tensor,
        offset: int,
        numel_unpadded: int,
        gradient_scaling_factor: float,
        bucket_id: int,
    ) -> None:
        self.params_list = list(params)  # buffer order
        self.params = set(self.params_list)
        self.param_data = param_data  # 1-D view, param_dtype, padded bucket numel (or None)
        # optim_grads_params: this rank's param shard, 1-D, param_dtype, numel / dp (persistent);
        # `param_data` then has a storage of its own, released between uses ([Note: sharded
        # param lifecycle] in megabuf/sharding/params.py)
        self.param_shard: Tensor | None = None
        self.grad_data = grad_data  # 1-D view, grad_dtype, padded bucket numel
        # optim_grads*: this rank's reduced grad, 1-D, grad_dtype, numel / dp (persistent); the
        # full `grad_data` then has a storage of its own, released between reductions
        # ([Note: sharded grad lifecycle] in megabuf/sharding/grads.py)
        self.grad_shard: Tensor | None = None
        self.offset = offset  # start of this bucket inside the buffer, in elements
        self.numel_unpadded = numel_unpadded  # sum of param numels in the bucket
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        # all-to-all landing zone for reduce-scatter on gloo; allocated on first use
        self.scratch: Tensor | None = None

    @property
    def numel(self) -> int:
        return self.grad_data.numel()


class _ParamAndGradBuffer:
    """Contiguous buffers for params that share (param dtype, grad dtype, expert-parallel?)."""

    def __init__(
        self,
        ddp_config: DistributedDataParallelConfig,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        params: Sequence[torch.nn.Parameter],
        data_parallel_group: ProcessGroup,
        layout: BufferLayout,
        param_to_name: dict[torch.nn.Parameter, str],
        gradient_scaling_factor: float,
        *,
        dp_size: int,
        dp_rank: int,
        fp8: Fp8Params | None = None,
    ) -> None:
        """`layout` is the planned layout of `params` (registration order): `layout.params[i]` is
        the slot of `params[i]`. `fp8`: the engine's FP8 params, needed by a uint8 buffer
        ([Note: FP8 params] in megabuf/fp8/__init__.py)."""
        _check_layout(params, layout, param_to_name)
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = list(params)  # registration order
        self.data_parallel_group = data_parallel_group
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_name = param_to_name
        self.is_expert_parallel = any(getattr(p, "allreduce", True) is False for p in params)
        self.layout = layout
        self.numel = layout.numel
        self.numel_unpadded = layout.numel_unpadded
        self.param_index_map: dict[torch.nn.Parameter, ParamSlot] = dict(
            zip(self.params, layout.params, strict=True)
        )
        self._fp8_params = fp8
        self._allocate()

    def _allocate(self) -> None:
        device = self.params[0].device
        strategy = self.ddp_config.sharding
        self.shards_grads = strategy.shards_grads
        # 1-D, grad_dtype, padded numel; None when each bucket has its own storage (optim_grads*)
        self._grad_data: Tensor | None = None
        bucket_grads: list[Tensor] = []  # optim_grads*: 1-D per bucket, own storage, released
        if self.shards_grads:
            bucket_grads = allocate_bucket_grads(self.layout, self.grad_dtype, device, self.params)
        else:
            self._grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)
        self.param_data: Tensor | None = None  # 1-D, param_dtype, padded numel (sharded only)
        # optim_grads_params: one full param tensor per bucket, each with its own storage
        self.bucket_params: list[Tensor] | None = None
        if strategy.param_home == "bucket_params":
            self.bucket_params = [
                torch.zeros(b.numel, dtype=self.param_dtype, device=device)
                for b in self.layout.buckets
            ]
        elif strategy.param_home == "param_data":
            self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        # the FP8 side of a uint8 buffer ([Note: FP8 params]); None for every other buffer
        self.fp8: Fp8BufferPart | None = self._fp8_part(device)
        for index, (param, slot) in enumerate(self.param_index_map.items()):
            start, end = slot.start, slot.end
            home = self._param_home(slot)
            if home is not None and self.fp8 is not None:
                self.fp8.place(index, home)  # the cast bytes; the param views them
            elif home is not None:
                view = home.view(param.shape)
                view.copy_(param.data)  # values preserved; then the param lives in the buffer
                param.data = view
            if self._grad_data is not None:
                param.main_grad = self._grad_data[start:end].view(param.shape)  # type: ignore[attr-defined]
        self.buckets = [
            self._make_bucket(slot.bucket_id, bucket_grads) for slot in self.layout.buckets
        ]
        if self.fp8 is not None:
            self.fp8.seed_masters()

    def _fp8_part(self, device: torch.device) -> Fp8BufferPart | None:
        if self.param_dtype != torch.uint8:
            return None
        if self._fp8_params is None:
            raise ValueError(
                f"megabuf: a uint8 buffer of {len(self.params)} params was built without the "
                "engine's FP8 params ([Note: FP8 params]); only the engine builds FP8 buffers"
            )
        return Fp8BufferPart(
            self._fp8_params, self.params, self.layout, self.param_shard_view,
            dp_rank=self.dp_rank, dp_size=self.dp_size, device=device,
        )  # fmt: skip

    def _param_home(self, slot: ParamSlot) -> Tensor | None:
        """The 1-D view a param lives in: of `param_data`, of its bucket's full params
        (optim_grads_params), or None (params stay where they are)."""
        if self.param_data is not None:
            return self.param_data[slot.start : slot.end]
        if self.bucket_params is not None:
            base = self.layout.buckets[slot.bucket_id].start
            return self.bucket_params[slot.bucket_id][slot.start - base : slot.end - base]
        return None

    def _make_bucket(self, bucket_id: int, bucket_grads: Sequence[Tensor]) -> _ParamAndGradBucket:
        slot = self.layout.buckets[bucket_id]
        param_data = None
        if self.param_data is not None:
            param_data = self.param_data[slot.start : slot.end]
        elif self.bucket_params is not None:
            param_data = self.bucket_params[bucket_id]
        if self._grad_data is not None:
            grad_data = self._grad_data[slot.start : slot.end]
        else:
            grad_data = bucket_grads[bucket_id]
        bucket = _ParamAndGradBucket(
            [self.params[i] for i in slot.param_ids],
            param_data,
            grad_data,
            slot.start,
            slot.numel_unpadded,
            self.gradient_scaling_factor,
            bucket_id,
        )
        if self.shards_grads:
            numel = slot.numel // self.dp_size
            bucket.grad_shard = torch.zeros(numel, dtype=self.grad_dtype, device=grad_data.device)
        if self.bucket_params is not None:  # optim_grads_params: the persistent param shard
            numel = slot.numel // self.dp_size
            bucket.param_shard = torch.zeros(numel, dtype=self.param_dtype, device=self.device)
        return bucket

    def rebucket(self, layout: BufferLayout) -> None:
        """New bucket boundaries over the same grad storage, zeroed ([Note: auto bucket
        re-plan] in megabuf/replan/autobucket.py): only an unsharded buffer whose params keep their
        slots, so every `param.main_grad` and `param.data` stays valid."""
        if self._grad_data is None or self.param_data is not None or layout.sharded:
            raise RuntimeError(
                f"megabuf: {self.describe()} cannot change its buckets in place under "
                f"{self.ddp_config.sharding.name!r} (params would move); rank {self.dp_rank}"
            )

        def offsets(lay: BufferLayout) -> list[tuple[int, int]]:
            return [(slot.start, slot.end) for slot in lay.params]

        if offsets(layout) != offsets(self.layout) or layout.numel != self.layout.numel:
            raise ValueError(
                f"megabuf: new layout of {self.describe()} moves params; a re-plan may only "
                "change bucket boundaries"
            )
        self.layout = layout
        self.param_index_map = dict(zip(self.params, layout.params, strict=True))
        self._grad_data.zero_()
        self.buckets = [self._make_bucket(slot.bucket_id, []) for slot in layout.buckets]

    @property
    def grad_storage(self) -> Tensor | None:
        """The whole buffer's grads where such a tensor exists (not under optim_grads*)."""
        return self._grad_data

    @property
    def grad_data(self) -> Tensor:
        """The whole buffer's grads (1-D, grad_dtype, padded numel). Under optim_grads* there
        is no such tensor: raises, naming what to read instead."""
        if self._grad_data is None:
            strategy = self.ddp_config.sharding.name
            raise RuntimeError(
                f"megabuf: {self.describe()} has no contiguous grad_data under "
                f"data_parallel_sharding_strategy={strategy!r} (rank {self.dp_rank} of its dp "
                "group): each bucket's full grad is released after its reduction ([Note: "
                "sharded grad lifecycle]); read this rank's reduced grads with "
                "buffer.reduced_grad(start, end) or bucket.grad_shard"
            )
        return self._grad_data

    def reduced_grad(self, start: int, end: int) -> Tensor:
        """After the grad sync: the reduced grads of buffer range [start, end), which must lie
        in this rank's shard of one bucket (any range without sharded grads). A view."""
        if self._grad_data is not None:
            return self._grad_data[start:end]
        for slot, bucket in zip(self.layout.buckets, self.buckets, strict=True):
            lo, hi = slot.shard_range(self.dp_rank, self.dp_size)
            if lo <= start <= end <= hi and bucket.grad_shard is not None:
                return bucket.grad_shard[start - lo : end - lo]
        raise ValueError(
            f"megabuf: buffer range [{start}, {end}) is not inside this rank's (dp rank "
            f"{self.dp_rank}) shard of one bucket of {self.describe()}; under "
            f"{self.ddp_config.sharding.name!r} only that shard is kept"
        )

    @property
    def grad_nbytes(self) -> int:
        """Persistent grad bytes: the whole buffer, or under optim_grads* the grad shards."""
        if self._grad_data is not None:
            return self._grad_data.numel() * self._grad_data.element_size()
        shards = [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        return sum(s.numel() * s.element_size() for s in shards)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def param_shard_view(self, start: int, end: int) -> Tensor:
        """This rank's persistent param memory for buffer range [start, end): a view of
        `param_data`, or under optim_grads_params of the bucket's `param_shard` (the range must
        then lie inside this rank's shard of one bucket)."""
        if self.param_data is not None:
            return self.param_data[start:end]
        for slot, bucket in zip(self.layout.buckets, self.buckets, strict=True):
            lo, hi = slot.shard_range(self.dp_rank, self.dp_size)
            if lo <= start <= end <= hi and bucket.param_shard is not None:
                return bucket.param_shard[start - lo : end - lo]
        raise ValueError(
            f"megabuf: buffer range [{start}, {end}) is not inside this rank's (dp rank "
            f"{self.dp_rank}) param shard of one bucket of {self.describe()}"
        )

    def scale_gradients(self, factor: float) -> None:
        """Multiply every grad held by `factor` (under optim_grads*: the reduced shards and
        any full bucket currently holding grads)."""
        if self._grad_data is not None:
            self._grad_data.mul_(factor)
            return
        for bucket in self.buckets:
            if bucket.grad_shard is not None:
                bucket.grad_shard.mul_(factor)
            if bucket.grad_data.untyped_storage().nbytes() > 0:
                bucket.grad_data.mul_(factor)

    def shard_range(self, bucket_id: int) -> tuple[int, int]:
        """Buffer range [start, end) of this rank's shard of bucket `bucket_id`."""
        return self.layout.buckets[bucket_id].shard_range(self.dp_rank, self.dp_size)

    @property
    def padding_fraction(self) -> float:
        return (self.numel - self.numel_unpadded) / max(1, self.numel)

    def describe(self) -> str:
        kind = "expert " if self.is_expert_parallel else ""
        return (
            f"{kind}buffer param={self.param_dtype} grad={self.grad_dtype}: "
            f"{len(self.params)} params, {len(self.buckets)} buckets, {self.numel} elements "
            f"({self.numel - self.numel_unpadded} padding, {100 * self.padding_fraction:.2f}%)"
        )


def _check_layout(
    params: Sequence[torch.nn.Parameter],
    layout: BufferLayout,
    param_to_name: dict[torch.nn.Parameter, str],
) -> None:
    """The planned layout must be of these very params: one slot each, of the param's numel."""
    if len(layout.params) != len(params):
        raise ValueError(
            f"megabuf: buffer layout has {len(layout.params)} param slots for {len(params)} "
            "params; plan the buffer from the same params"
        )
    bad = [
        f"{param_to_name.get(p, '<unnamed>')} ({p.numel()} elements, slot {slot.numel})"
        for p, slot in zip(params, layout.params)
        if slot.numel != p.numel()
    ]
    if bad:
        raise ValueError(f"megabuf: buffer layout slots do not match the params: {bad}")
