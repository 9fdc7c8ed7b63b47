"""`DistributedOptimizer`: ZeRO-1 over megabuf's contiguous buffers.

Each rank steps only its shard of every bucket (see [Note: main params]) and then publishes the
updated shard to the other dp ranks with the bucket groups' param all-gather.

[Note: publishing params]
After the inner step, this rank's slice of `param_data` holds new values and the rest is stale.
Every bucket group is marked stale and `start_param_sync()` either gathers now (no overlap) or,
with `overlap_param_gather`, dispatches every group's gather asynchronously, in the order the
next forward reads them, and returns: the forward pre-hooks wait for each group just before its
first reader runs, so the gathers overlap forward compute. Dispatching all of them at the step,
which every rank runs, rather than lazily from forward, is what lets one rank read params alone
(rank-0 evaluation, `state_dict()`, `publish_params()`): it only waits for work every rank
already issued, and never starts a collective the others would not join. Before writing into
`param_data` the step finishes any gather still in flight (`publish_params()`), so a gather
never races the copy. Anything that reads params outside forward (evaluation, checkpoints) must
call `model.publish_params()` first; `model.state_dict()` and `megabuf.save_checkpoint` do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

from megabuf.ddp import DistributedDataParallel
from megabuf.fp8.agree import agree_and_cast_by_kind
from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.main_params import MainParam, sharded_main_params
from megabuf.optimizer.model_space import (
    common_state,
    exchanged_state,
    load_model_space_state,
    own_pieces_on_host,
)
from megabuf.optimizer.muon import check_owners_agree
from megabuf.optimizer.offload import CPUOffload
from megabuf.optimizer.param_groups import grad_buffers
from megabuf.optimizer.param_versions import ModelParamVersions
from megabuf.optimizer.records import DomainKind


class DistributedOptimizer(MegabufOptimizer):
    """Shards fp32 main params and optimizer state over the data-parallel group.

    `optimizer_cls` is any pointwise torch optimizer (Adam, AdamW, SGD, ...), built with
    `optimizer_kwargs` and `param_groups` (torch-style; per-group hyperparameters survive
    sharding). Dense and expert params get separate inner optimizers under one grad norm.
    """

    sharded = True
    _offload: CPUOffload | None = None  # cpu_offload on CUDA params, see [Note: cpu offload]
    _offload_checked = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for chunk in self.model_chunks:  # [Note: sharded auto bucket re-plan]
            chunk.engine.replan_listeners.add(self._around_replan)

    def _around_replan(self, rebuild: Callable[[], None]) -> None:
        """A model chunk re-plans its buckets: carry this optimizer's state across ([Note:
        sharded auto bucket re-plan] in megabuf/replan/sharded_replan.py). Collective over dp."""
        if self._offload is not None:
            raise RuntimeError(
                'megabuf: bucket_size="auto" cannot re-plan the buckets of a model whose '
                "optimizer has cpu_offload (its host copies follow the old shards); give an int "
                "bucket_size"
            )
        mine, common = own_pieces_on_host(self.parts()), common_state(self.parts())
        rebuild()
        self.domains = self._build_domains()
        self.defaults = dict(self.domains[0].optimizer.defaults) if self.domains else {}
        dp = self.process_groups.dp
        state = exchanged_state(self.parts(), mine, common, self.collectives, dp)
        load_model_space_state(self.parts(), state)
        self._versions = ModelParamVersions(self.main_params)
        self._versions.record()

    def _check_chunks(self, chunks: Sequence[DistributedDataParallel]) -> None:
        for i, chunk in enumerate(chunks):
            if not chunk.ddp_config.sharding.shards_optimizer:
                raise ValueError(
                    f"megabuf: DistributedOptimizer got model chunk {i} built without "
                    "DistributedDataParallelConfig(use_distributed_optimizer=True); rebuild it "
                    "with that flag, or use MixedPrecisionOptimizer / FP32Optimizer"
                )
        if any(chunk.ddp_config.whole_param_owners for chunk in chunks):
            check_owners_agree(chunks, chunks[0].engine.collectives)  # [Note: whole-param owners]

    def _whole_params(self) -> bool:
        return all(chunk.ddp_config.whole_param_owners for chunk in self.model_chunks)

    def _build_main_params(self, kind: DomainKind) -> list[MainParam] | None:
        buffers = [
            buf for chunk in self.model_chunks for buf in grad_buffers(chunk, kind == "expert")
        ]
        if not buffers:
            return None
        mains = [mp for buf in buffers for mp in sharded_main_params(buf, self.keys)]
        offload = self._cpu_offload()
        return offload.offload(mains) if offload is not None else mains

    def _cpu_offload(self) -> CPUOffload | None:
        """cpu_offload's host copies, made once (before the first domain's main params)."""
        if not self._offload_checked:
            self._offload = CPUOffload.for_chunks(self.model_chunks, self.grad_scaler)
            self._offload_checked = True
        return self._offload

    def _before_step(self) -> None:
        if self._offload is not None:  # [Note: cpu offload]
            self._offload.fetch_grads()

    def _norm_groups(self, kind: DomainKind) -> tuple[ProcessGroup, ...]:
        pgs = self.process_groups  # see [Note: global grad norm]
        # a shard group holds every shard once; its replicas hold the same shards again
        # ([Note: two-level reduction]), so the sum of squares runs over the shard group
        if kind == "dense":
            return (pgs.shard_group(False), pgs.pp)
        return (pgs.shard_group(True), pgs.ep, pgs.pp)

    def _before_update(self) -> None:
        for chunk in self.model_chunks:
            chunk.engine.param_side.before_step()

    def _after_update(self) -> None:
        """See [Note: publishing params]; FP8 params are cast first ([Note: FP8 params])."""
        chunks = self.model_chunks
        parts = [b.fp8 for c in chunks for b in c.engine.buffers if b.fp8 is not None]
        pgs = self.process_groups  # each kind over its shard group ([Note: FP8 params])
        agree_and_cast_by_kind(parts, self.collectives, pgs.shard_group)
        with torch.profiler.record_function("megabuf::publish_params"):
            for chunk in self.model_chunks:
                chunk.engine.param_side.stepped()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero grad buffers; with overlap_param_gather, dispatch the first param gather."""
        super().zero_grad(set_to_none)
        for chunk in self.model_chunks:
            cfg = chunk.ddp_config
            if cfg.overlap_param_gather and not cfg.align_param_gather:
                chunk.start_param_sync(force_dispatch=True)
