"""Non-distributed optimizers over DDP chunks with the same `step()` contract as the
distributed one: every rank steps whole params, reading the averaged grads from `main_grad`.

`MixedPrecisionOptimizer` keeps fp32 main params for bf16/fp16 params (and steps fp32 params
directly); `FP32Optimizer` is the same for models whose params are all fp32.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from megabuf.optimizer.base import MegabufOptimizer
from megabuf.optimizer.main_params import MainParam, whole_main_params
from megabuf.optimizer.records import DomainKind
from megabuf.planning.replicas import is_expert_parallel


class MixedPrecisionOptimizer(MegabufOptimizer):
    """fp32 main params for half-precision params; all of a param's state on every dp rank."""

    def _build_main_params(self, kind: DomainKind) -> list[MainParam] | None:
        for i, chunk in enumerate(self.model_chunks):
            if chunk.ddp_config.sharding.shards_optimizer:
                raise ValueError(
                    f"megabuf: model chunk {i} uses use_distributed_optimizer=True, so only a "
                    "shard of each grad is reduced; use DistributedOptimizer (or "
                    "megabuf.build_optimizer) for it"
                )
        params = [p for p in self.model_params() if is_expert_parallel(p) == (kind == "expert")]
        if not params:
            return None
        pgs = self.process_groups
        # Replicas hold identical state: only the first (dp or expt_dp rank 0) writes it into
        # checkpoints.
        owner = pgs.topology.data_parallel(kind == "expert")[0] == 0
        return whole_main_params(params, self.keys, owner)

    def _norm_groups(self, kind: DomainKind) -> tuple[ProcessGroup, ...]:
        pgs = self.process_groups  # grads are replicated over dp / expt_dp: see clip.py
        return (pgs.pp,) if kind == "dense" else (pgs.ep, pgs.pp)


class FP32Optimizer(MixedPrecisionOptimizer):
    """All params fp32: the inner optimizer steps the model params themselves."""

    def _build_main_params(self, kind: DomainKind) -> list[MainParam] | None:
        bad = [
            name
            for chunk in self.model_chunks
            for p, name in chunk.engine.param_to_name.items()
            if p.dtype != torch.float32
        ]
        if bad:
            raise ValueError(
                f"megabuf: FP32Optimizer needs fp32 params; {bad[:5]} are not. Use "
                "MixedPrecisionOptimizer for bf16/fp16 models"
            )
        return super()._build_main_params(kind)
