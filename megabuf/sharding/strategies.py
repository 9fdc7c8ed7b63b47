"""Sharding strategies as objects: one class per `data_parallel_sharding_strategy` (pure).

[Note: sharding strategy objects]
The strategy is resolved once, from the config (`DistributedDataParallelConfig.sharding`), and
everything whose behaviour depends on it asks that object; no other module reads
`data_parallel_sharding_strategy` or `use_distributed_optimizer`. What a strategy answers:

                            no_shard    optim         optim_grads    optim_grads_params
    `reduction`             all-reduce  reduce-scatter into this rank's 1/dp shard of a bucket
    `shards_optimizer`      no          main params and optimizer state: this rank's shard
    `shards_grads`          no          no            grad shards    grad shards
    `param_home`            module      param_data    param_data     bucket params + shards
    `gathers_after_step`    no          yes           yes            no: units gather in forward
    `exposes_grads` (.grad) yes         no            no             no

and the memory formula's per-category rules ([Note: memory formula] in sharding/formula.py):
what is divided by dp (`param_nbytes`, `grad_nbytes`, `textbook`), whether gloo's reduce-scatter
landing zone persists (`keeps_scratch`). Each
strategy shards everything the one before it does, plus one more thing, so they are subclasses
in that order. A new strategy is a new class with its answers, registered in `STRATEGIES`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch

Reduction = Literal["all_reduce", "reduce_scatter"]
ParamHome = Literal["module", "param_data", "bucket_params"]


class ShardingStrategy:
    """The base class is "no_shard" (torch DDP): everything whole on every rank."""

    name: ClassVar[str] = "no_shard"
    shards_optimizer: ClassVar[bool] = False  # the distributed optimizer (ZeRO-1)
    shards_grads: ClassVar[bool] = False  # ZeRO-2: only this rank's reduced grad shard is kept
    shards_params: ClassVar[bool] = False  # ZeRO-3: only a param shard between forwards

    def __repr__(self) -> str:
        return f"<sharding strategy {self.name!r}>"

    @property
    def reduction(self) -> Reduction:
        """The collective that reduces a bucket's grads."""
        return "reduce_scatter" if self.shards_optimizer else "all_reduce"

    @property
    def exposes_grads(self) -> bool:
        """The grad sync hands out `.grad` ([Note: grad contract] in grads.py): only when every
        rank holds the whole reduced grad."""
        return not self.shards_optimizer

    @property
    def param_home(self) -> ParamHome:
        """Where params live: the module's own tensors, the buffer's `param_data` (each
        rank's shard is stepped in place, the rest gathered), or one full tensor per bucket
        that exists only while its unit is gathered, next to a persistent param shard."""
        if self.shards_params:
            return "bucket_params"
        return "param_data" if self.shards_optimizer else "module"

    @property
    def gathers_after_step(self) -> bool:
        """The step all-gathers every bucket group's params (ZeRO-3 gathers unit by unit in
        forward instead, and unsharded params need nothing)."""
        return self.shards_optimizer and not self.shards_params

    def prescales(self, grad_dtype: torch.dtype) -> bool:
        """Grads are scaled before the collective (as torch DDP: all-reduce results match it
        bit for bit; fp16 always, a sum of dp fp16 values can overflow where their mean cannot);
        a reduce-scatter otherwise scales after it, 1/dp of the elements."""
        return not self.shards_optimizer or grad_dtype == torch.float16

    # ---- memory formula ([Note: memory formula]) ------------------------------------------
    def param_nbytes(self, numel: int, itemsize: int, dp_size: int) -> int:
        full = numel * itemsize
        return full // dp_size if self.shards_params else full

    def grad_nbytes(self, numel: int, itemsize: int, dp_size: int) -> int:
        full = numel * itemsize
        return full // dp_size if self.shards_grads else full

    @property
    def keeps_scratch(self) -> bool:
        """gloo's all-to-all reduce-scatter landing zone is kept for the whole run (released
        with each bucket when grads are sharded)."""
        return self.shards_optimizer and not self.shards_grads

    def textbook(self, param: float, grad: float, optim: float, dp_size: int) -> float:
        """Bytes per param without padding: each part divided by dp where it is sharded."""
        d = dp_size
        return (
            (param / d if self.shards_params else param)
            + (grad / d if self.shards_grads else grad)
            + (optim / d if self.shards_optimizer else optim)
        )


class NoShard(ShardingStrategy):
    """torch DDP: full params and grads on every rank, grads all-reduced."""


class Optim(ShardingStrategy):
    """ZeRO-1, the distributed optimizer: grads reduce-scattered, each rank steps its shard of
    the fp32 main params and optimizer state, params all-gathered after the step."""

    name = "optim"
    shards_optimizer = True


class OptimGrads(Optim):
    """ZeRO-2: as "optim", and a bucket's full grad exists only while it accumulates and
    reduces; the reduced grad shard persists ([Note: sharded grad lifecycle])."""

    name = "optim_grads"
    shards_grads = True


class OptimGradsParams(OptimGrads):
    """ZeRO-3 / FSDP: as "optim_grads", and only a param shard persists; a unit's full params
    exist around its forward and backward ([Note: who gathers when])."""

    name = "optim_grads_params"
    shards_params = True


STRATEGIES: dict[str, ShardingStrategy] = {
    cls.name: cls() for cls in (NoShard, Optim, OptimGrads, OptimGradsParams)
}
SHARDING_STRATEGIES = tuple(STRATEGIES)
"""`data_parallel_sharding_strategy` values, least to most sharded (Megatron's names)."""


def sharding_strategy(name: str) -> ShardingStrategy:
    """The strategy object of `name`; raises naming the choices."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise ValueError(
            f"megabuf: data_parallel_sharding_strategy={name!r} is not one of "
            f"{list(SHARDING_STRATEGIES)}"
        )
    return strategy
