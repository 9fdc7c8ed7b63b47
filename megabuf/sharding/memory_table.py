"""Persistent memory per sharding strategy for one model and dp size (`megabuf inspect`).

Pure: it plans the model's `ParamSpec`s under each strategy (the same `build_plan` the engine
allocates from, keeping the config's layout fields) and applies the formula ([Note: memory
formula]) on every dp rank; a row gives the busiest rank's bytes per trainable param next to
the unpadded textbook figure of the design notes (§2.6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megabuf.config import SHARDING_STRATEGIES, DistributedDataParallelConfig
from megabuf.planning.plan import ParamSpec, build_plan
from megabuf.sharding.formula import (
    ADAM,
    OptimizerStateSpec,
    itemsize,
    persistent_bytes,
    textbook,
)

LAYOUT_FIELDS = (
    "bucket_size", "overlap_grad_reduce", "grad_reduce_in_fp32", "pad_buckets_for_high_nccl_busbw",
)  # fmt: skip
"""The config fields that shape a plan; the others may not apply to every strategy."""


@dataclass(frozen=True)
class StrategyMemory:
    """One strategy's persistent bytes on the busiest dp rank."""

    strategy: str
    dp_rank: int  # the busiest rank
    nbytes: dict[str, int]  # per category ([Note: memory formula])
    numel: int  # trainable params
    textbook_bytes_per_param: float | None  # None: params of several dtypes

    @property
    def bytes_per_param(self) -> float:
        return sum(self.nbytes.values()) / max(1, self.numel)


def _layout_config(
    config: DistributedDataParallelConfig, strategy: str
) -> DistributedDataParallelConfig:
    kept = {name: getattr(config, name) for name in LAYOUT_FIELDS}
    if kept["bucket_size"] == "auto":  # its default start plan; a no_shard re-plan moves no byte
        kept["bucket_size"] = None
    return DistributedDataParallelConfig(data_parallel_sharding_strategy=strategy, **kept)


def _textbook(specs: Sequence[ParamSpec], config: DistributedDataParallelConfig, strategy: str,
              dp_size: int, optimizer: OptimizerStateSpec) -> float | None:  # fmt: skip
    dtypes = {s.dtype for s in specs}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    grad = torch.float32 if config.grad_reduce_in_fp32 else dtype
    return textbook(
        strategy, dp_size if strategy != "no_shard" else 1, param_nbytes=itemsize(dtype),
        grad_nbytes=itemsize(grad), states=optimizer.elementwise,
        main_copy=dtype != torch.float32,
    )  # fmt: skip


def memory_per_strategy(
    specs: Sequence[ParamSpec],
    config: DistributedDataParallelConfig,
    *,
    dp_size: int,
    expt_dp_size: int,
    expert_shares_dp_group: bool,
    disable_bucketing: bool = False,
    optimizer: OptimizerStateSpec = ADAM,
    unit_of_param: Sequence[int] | None = None,
) -> tuple[StrategyMemory, ...]:
    """One row per strategy, least to most sharded (see the module docstring). Expert buffers
    use expt_dp rank `dp_rank % expt_dp_size`. `unit_of_param` (the shard unit of each spec)
    lays out the optim_grads_params row unit by unit, as the engine does."""
    numel = sum(s.numel for s in specs)
    rows = []
    for strategy in SHARDING_STRATEGIES:
        plan = build_plan(
            specs, _layout_config(config, strategy), dp_size=dp_size, expt_dp_size=expt_dp_size,
            expert_shares_dp_group=expert_shares_dp_group, disable_bucketing=disable_bucketing,
            unit_of_param=unit_of_param if strategy == "optim_grads_params" else None,
        )  # fmt: skip
        per_rank = [
            persistent_bytes(plan, strategy, optimizer, dp_rank=r, expt_dp_rank=r % expt_dp_size)
            for r in range(dp_size)
        ]
        rank = max(range(dp_size), key=lambda r: sum(per_rank[r].values()))
        book = _textbook(specs, config, strategy, dp_size, optimizer)
        rows.append(StrategyMemory(strategy, rank, per_rank[rank], numel, book))
    return tuple(rows)


def format_memory_table(rows: Sequence[StrategyMemory], dp_size: int, optimizer: str) -> list[str]:
    """Text lines: bytes per param per strategy, and the largest categories in MiB."""
    lines = [
        f"persistent memory per strategy at dp_size={dp_size} ({optimizer}, busiest rank, "
        "padding included; no reduce-scatter scratch, as on NCCL; activations and transient "
        "buffers excluded):"
    ]
    for row in rows:
        book = (
            "-" if row.textbook_bytes_per_param is None else f"{row.textbook_bytes_per_param:.2f}"
        )
        mib = {k: v / (1 << 20) for k, v in row.nbytes.items() if v}
        parts = ", ".join(f"{k} {v:.2f}" for k, v in mib.items())
        lines.append(
            f"  {row.strategy:<19} {row.bytes_per_param:6.2f} B/param (textbook {book}); "
            f"MiB: {parts}"
        )
    return lines
