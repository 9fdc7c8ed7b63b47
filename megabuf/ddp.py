"""`DistributedDataParallel`: wraps any nn.Module with contiguous grad buffers and bucket groups."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megabuf.bucket_group import (
    BucketGroup,
    DispatchChain,
    Timeline,
    partition_buckets,
    raise_missing_grads,
)
from megabuf.buffer import _ParamAndGradBuffer
from megabuf.collectives import Collectives
from megabuf.config import DistributedDataParallelConfig
from megabuf.hooks import ParamGatherHooks, register_grad_hooks
from megabuf.layout import default_bucket_size
from megabuf.process_groups import ProcessGroups
from megabuf.replicas import check_devices, check_replicas_match, is_expert_parallel

logger = logging.getLogger(__name__)

BACKWARD_END_GROUP_ID = -1  # group id of the timeline's "backward_end" marker


class DistributedDataParallel(nn.Module):
    """Megatron-style data parallelism for any module; see README for the lifecycle per step."""

    def __init__(
        self,
        module: nn.Module,
        ddp_config: DistributedDataParallelConfig | None = None,
        *,
        process_groups: ProcessGroups | None = None,
        disable_bucketing: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.ddp_config = ddp_config or DistributedDataParallelConfig()
        self.process_groups = process_groups or ProcessGroups.default()
        self.disable_bucketing = disable_bucketing
        self.collectives = Collectives()
        self._exposed_grad_copies: list[nn.Parameter] = []
        self._build()

    # ---- construction -------------------------------------------------------------------------
    def _build(self) -> None:
        pgs = self.process_groups
        named = _unique_named_parameters(self.module)
        check_devices(named)
        check_replicas_match(named, pgs.dp, self.collectives)
        trainable = [(n, p) for n, p in named if p.requires_grad]
        self.param_to_name = {p: n for n, p in trainable}
        self._registration_index = {p: i for i, (_, p) in enumerate(trainable)}
        dense = [p for _, p in trainable if not is_expert_parallel(p)]
        expert = [p for _, p in trainable if is_expert_parallel(p)]
        bucket_size = self._resolve_bucket_size(dense, expert)
        dense_scale, expert_scale = self._scaling_factors()
        # Megatron's attribute name. It would shadow nn.Module.buffers(), so the list is also
        # callable: `model.buffers` is the grad buffers, `model.buffers()` the module buffers.
        self.buffers = _BufferList(  # type: ignore[method-assign,assignment]
            self._make_buffers(dense, pgs.dp, bucket_size, dense_scale), self
        )
        self.expert_parallel_buffers = self._make_buffers(
            expert, pgs.expt_dp, bucket_size, expert_scale
        )
        self._all_buffers: list[_ParamAndGradBuffer] = [
            *self.buffers,  # type: ignore[misc]
            *self.expert_parallel_buffers,
        ]
        single = self.disable_bucketing
        self.bucket_groups = partition_buckets(
            self.buffers,
            single,
            collectives=self.collectives,  # type: ignore[arg-type]
        )
        self.expert_parallel_bucket_groups = partition_buckets(
            self.expert_parallel_buffers, single, collectives=self.collectives
        )
        self._wire_groups()
        self._linked_params = [
            p
            for _, p in trainable
            if p.main_grad.dtype == p.dtype  # type: ignore[attr-defined]
        ]
        self._mismatched_params = [
            p
            for _, p in trainable
            if p.main_grad.dtype != p.dtype  # type: ignore[attr-defined]
        ]
        self._grad_hook_handles = register_grad_hooks(
            [p for _, p in trainable], self.param_to_bucket_group
        )
        self.param_gather_hooks = ParamGatherHooks(self.module, self.param_to_bucket_group)
        if self.ddp_config.overlap_param_gather:
            self.param_gather_hooks.enable()
        self.broadcast_params()
        for buf in self._all_buffers:
            logger.debug("megabuf: %s", buf.describe())

    def _resolve_bucket_size(
        self, dense: list[nn.Parameter], expert: list[nn.Parameter]
    ) -> int | None:
        cfg = self.ddp_config
        if self.disable_bucketing:
            return None
        if cfg.bucket_size is not None:
            return cfg.bucket_size
        if not cfg.overlap_grad_reduce:
            return None
        largest = 0
        for params in (dense, expert):
            for key in {_dtype_key(p, cfg) for p in params}:
                largest = max(largest, sum(p.numel() for p in params if _dtype_key(p, cfg) == key))
        return default_bucket_size(self.process_groups.dp_size, largest)

    def _scaling_factors(self) -> tuple[float, float]:
        """Every grad ends up averaged over the dense dp group: expert grads already hold the
        contributions of the ep ranks (token all-to-all), so they too are scaled by 1/dp_size
        and summed over expt_dp (dp_size = ep_size * expt_dp_size)."""
        dp_size = self.process_groups.dp_size
        if self.ddp_config.average_in_collective:
            return 1.0, dist.get_world_size(self.process_groups.expt_dp) / dp_size
        return 1.0 / dp_size, 1.0 / dp_size

    def _make_buffers(
        self, params: list[nn.Parameter], group: Any, bucket_size: int | None, scale: float
    ) -> list[_ParamAndGradBuffer]:
        by_key: dict[tuple[torch.dtype, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            by_key.setdefault(_dtype_key(p, self.ddp_config), []).append(p)
        return [
            _ParamAndGradBuffer(
                self.ddp_config,
                param_dtype,
                grad_dtype,
                ps,
                group,
                bucket_size,
                self.param_to_name,
                scale,
                dp_size=dist.get_world_size(group),
                dp_rank=dist.get_rank(group),
            )  # fmt: skip
            for (param_dtype, grad_dtype), ps in by_key.items()
        ]

    def _wire_groups(self) -> None:
        self.timeline: Timeline | None = None
        self.param_to_bucket_group: dict[nn.Parameter, BucketGroup] = {}
        groups = self.bucket_groups + self.expert_parallel_bucket_groups
        for i, group in enumerate(groups):
            group.group_id = i  # unique across dense and expert groups (p2p tags)
            group.param_to_name = self.param_to_name
            for param in group.params_list:
                self.param_to_bucket_group[param] = group

        # Expected backward order: groups holding the last-registered params come first.
        def backward_rank(g: BucketGroup) -> int:
            return -max(self._registration_index[p] for p in g.params_list)

        self._chains = [
            DispatchChain(sorted(gs, key=backward_rank))
            for gs in (self.bucket_groups, self.expert_parallel_bucket_groups)
            if gs
        ]

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._exposed_grad_copies:  # see finish_grad_sync: copies must not be accumulated into
            for param in self._exposed_grad_copies:
                param.grad = None
            self._exposed_grad_copies = []
        return self.module(*args, **kwargs)

    # ---- grad sync ----------------------------------------------------------------------------
    @property
    def all_bucket_groups(self) -> list[BucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without reducing (all micro-batches but the last)."""
        for group in self.all_bucket_groups:
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self.all_bucket_groups:
                group.is_last_microbatch = True

    def start_grad_sync(self) -> None:
        """Dispatch every reduction not yet dispatched (e.g. from a pipeline's grad_sync_func)."""
        for chain in self._chains:
            for group in chain.groups[chain.next_index :]:
                group.start_grad_sync()
            chain.next_index = len(chain.groups)

    def finish_grad_sync(self) -> None:
        """Wait for (or, without overlap, run) every reduction; then `param.grad` holds the
        averaged grad (the main_grad view itself when dtypes match)."""
        if self.timeline is not None:
            self.timeline.record(BACKWARD_END_GROUP_ID, "backward_end")
        if self.ddp_config.overlap_grad_reduce:
            raise_missing_grads(self.all_bucket_groups)
        for chain in self._chains:
            for group in chain.groups:
                group.finish_grad_sync()
            chain.next_index = len(chain.groups)
        if not self.ddp_config.use_distributed_optimizer:
            self._expose_mismatched_grads()

    def enable_timeline(self) -> Timeline:
        """Record when every bucket group became ready, was dispatched and finished, and a
        "backward_end" marker (group id -1) at the start of each finish_grad_sync(), into one
        shared `Timeline` (also `self.timeline`); `megabuf.overlap` turns it into a report."""
        timeline = Timeline()
        self.timeline = timeline
        for group in self.all_bucket_groups:
            group.timeline = timeline
        return timeline

    def _expose_mismatched_grads(self) -> None:
        """bf16/fp16 params with fp32 main_grad: torch optimizers need a grad of the param's
        dtype, so hand them a copy (dropped again at the next forward or zero_grad_buffer)."""
        for param in self._mismatched_params:
            param.grad = param.main_grad.to(param.dtype)  # type: ignore[attr-defined]
        self._exposed_grad_copies = list(self._mismatched_params)

    def zero_grad_buffer(self) -> None:
        """Start a new iteration's grads: lazily, see [Note: grad accumulation into main_grad]
        (no pass over the buffer; each param's first grad overwrites its main_grad)."""
        for group in self.all_bucket_groups:
            group.reset()
        for param in self._linked_params:
            param.grad = None
        for chain in self._chains:
            chain.reset()
        for param in self._exposed_grad_copies:
            param.grad = None
        self._exposed_grad_copies = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as zero_grad_buffer(): grads live in the buffers, see [Note: grad accumulation
        into main_grad]."""
        del set_to_none
        self.zero_grad_buffer()

    def scale_gradients(self, scaling_factor: float) -> None:
        for buf in self._all_buffers:
            buf.scale_gradients(scaling_factor)

    # ---- params -------------------------------------------------------------------------------
    def broadcast_params(self) -> None:
        """Copy dp-rank-0's params (expert params: expt_dp-rank-0's) and buffers to all ranks."""
        pgs = self.process_groups
        with torch.no_grad():
            for _, param in _unique_named_parameters(self.module):
                group = pgs.expt_dp if is_expert_parallel(param) else pgs.dp
                self.collectives.broadcast(param.data, 0, group)
            for tensor in self.module.buffers():
                self.collectives.broadcast(tensor, 0, pgs.dp)

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """After an optimizer step: gather params now (no overlap, or force_sync), or dispatch
        the first group's gather (force_dispatch), or leave it to the forward pre-hooks."""
        del unused
        groups = self.all_bucket_groups
        if force_sync or not self.ddp_config.overlap_param_gather:
            for group in groups:
                group.start_param_sync(force_sync=True)
            return
        if force_dispatch:
            first = self.param_gather_hooks.first_group() or (groups[0] if groups else None)
            if first is not None:
                first.start_param_sync()

    def publish_params(self) -> None:
        """Finish every pending param gather: call before reading params outside forward
        (evaluation code that bypasses forward, checkpoint saving). state_dict() calls it."""
        for group in self.all_bucket_groups:
            group.finish_param_sync(skip_next_bucket_dispatch=True)

    def enable_forward_pre_hook(self) -> None:
        self.param_gather_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        self.param_gather_hooks.disable()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.publish_params()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ValueError(
                "megabuf: load_state_dict(assign=True) would detach params from the buffers; "
                "use assign=False (values are copied into the existing params)"
            )
        self.publish_params()
        return self.module.load_state_dict(state_dict, strict=strict)


def as_model_chunks(
    model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel], user: str
) -> list[DistributedDataParallel]:
    """One chunk or a list of chunks, each a megabuf DistributedDataParallel; `user` names the
    caller in the error."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError(f"megabuf: {user} got no model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError(
                f"megabuf: {user}: model chunk {i} is a {type(chunk).__name__}, not a "
                "megabuf.DistributedDataParallel; wrap every chunk before training"
            )
    return chunks


class _BufferList(list):  # type: ignore[type-arg]
    """A list of `_ParamAndGradBuffer` that, called, behaves like `nn.Module.buffers()`."""

    def __init__(self, items: list[_ParamAndGradBuffer], owner: nn.Module) -> None:
        super().__init__(items)
        self._owner = owner

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return nn.Module.buffers(self._owner, recurse)


def _dtype_key(
    p: nn.Parameter, cfg: DistributedDataParallelConfig
) -> tuple[torch.dtype, torch.dtype]:
    return p.dtype, torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype


def _unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """named_parameters() already drops shared params after their first name."""
    return list(module.named_parameters())
