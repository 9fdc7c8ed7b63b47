"""Sharding strategies as objects: one class per `data_parallel_sharding_strategy` (pure).

[Note: sharding strategy objects]
The strategy is resolved once, from the config (`DistributedDataParallelConfig.sharding`), and
everything whose behaviour depends on it asks that object; no other module reads
`data_parallel_sharding_strategy`, `use_distributed_optimizer` or `reshard_after_forward`.
What a strategy answers:

                            no_shard    optim         optim_grads    optim_grads_params
    `reduction`             all-reduce  reduce-scatter into this rank's 1/dp shard of a bucket
    `shards_optimizer`      no          main params and optimizer state: this rank's shard
    `shards_grads`          no          no            grad shards    grad shards
    `param_home`            module      param_data    param_data     bucket params + shards
    `gathers_after_step`    no          yes           yes            no: units gather in forward
    `exposes_grads` (.grad) yes         no            no             no
    `reshards_after_forward`                                         yes (no: the variant below)

and the memory formula's per-category rules ([Note: memory formula] in sharding/formula.py):
what is divided by dp (`param_nbytes`, `grad_nbytes`, `textbook`), whether gloo's reduce-scatter
landing zone persists (`keeps_scratch`), the bounds of the transient full grad buckets and
gathered params (`grad_buckets_bound`, `unsharded_params_bound`); and which config options it
reads (`options`) or refuses (`refuses`). Each strategy of the linear chain shards everything
the one before it does, plus one more thing, so they are subclasses in that order; a strategy
off the chain is a subclass that overrides what differs (`OptimGradsParamsNoReshard`). A new
strategy is a new class with its answers and its builders ([Note: strategies build their
parts]), registered in `STRATEGIES` (or, as a variant a knob selects, resolved by
`sharding_strategy`).

[Note: strategies build their parts]
What differs between strategies is built by the strategy, not branched on at each site. The
strategy module is pure and sits below the engine (the config resolves it), so it cannot import
the parts it chooses; instead each builder method receives a small kit, supplied by whoever
assembles the part, that knows HOW to construct each candidate, while the strategy decides
WHICH one (and how they compose):

    builder                     kit (protocol here; implemented by)     what the strategy picks
    `grad_storage(kit)`         `GradStorageKit` (assembly.py, per      `FullGrads` or
                                bucket group)                           `ShardedGrads` (ZeRO-2/3)
    `first_reduction(kit)`      `ReductionKit` (reductions.py, per      all-reduce or
                                bucket group; hybrid wraps it)          reduce-scatter
    `param_storage(kit)`        `ParamStorageKit` (assembly.py, per     None, or the group's
                                bucket group)                           `ShardedParams` (ZeRO-3)
    `param_side(kit)`           `ParamSideKit` (sharding/parts.py)      `GatheredParams` or
                                                                        `UnitParams`, resharding
                                                                        after forward or not
    `exposed_grads(kit)`        `ExposedGradsKit` (sharding/parts.py)   `.grad` handed out, or
                                                                        none and foreign
                                                                        optimizers refused
    `unit_plan(kit)`            `UnitPlanKit` (model_plan.py)           none, or the shard units
    `optimizer(kit)`            `OptimizerKit` (optimizer/builder.py)   the distributed or a
                                                                        replicated optimizer
    `agreement_mode(...)`       none: a pure answer                     whether (and why) ranks
                                                                        agree on micro-batches

The kits are generic in what they return, so the strategy never names an engine type and a
test can hand it a fake kit that records which builder was asked (tests/test_sharding_strategy.py).
A new variant of a part is one more kit method, and the strategy that needs it overrides that
builder; a new part is one more kit and one more builder here.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Protocol, TypeVar

import torch

Reduction = Literal["all_reduce", "reduce_scatter"]
ParamHome = Literal["module", "param_data", "bucket_params"]
Part = TypeVar("Part", covariant=True)


class ParamStorageKit(Protocol[Part]):
    """Builds one bucket group's param storage ([Note: strategies build their parts])."""

    def sharded_params(self) -> Part:
        """The group's full params and persistent shards (`ShardedParams`)."""
        ...


class GradStorageKit(Protocol[Part]):
    """Builds one bucket group's grad storage ([Note: grad storage] in sharding/grads.py)."""

    def full_grads(self) -> Part:
        """The whole buckets, kept across steps (`FullGrads`)."""
        ...

    def sharded_grads(self) -> Part:
        """Full buckets only while they accumulate and reduce; this rank's reduced shard kept
        (`ShardedGrads`, [Note: sharded grad lifecycle])."""
        ...


class ReductionKit(Protocol[Part]):
    """Builds the first level of one bucket group's reduction ([Note: reductions] in
    reductions.py; the hybrid second level wraps whatever is chosen here)."""

    def all_reduce(self) -> Part:
        """Every rank gets the whole reduced bucket (`AllReduce`)."""
        ...

    def reduce_scatter(self) -> Part:
        """Each rank gets its 1/dp shard of the reduced bucket (`ReduceScatter`)."""
        ...


class ParamSideKit(Protocol[Part]):
    """Builds the engine's param side ([Note: strategies build their parts])."""

    def gathered(self) -> Part:
        """Params whole between forwards, gathered after a step (`GatheredParams`)."""
        ...

    def units(self, *, reshard_after_forward: bool) -> Part:
        """Shards between forwards, gathered unit by unit (`UnitParams`): fills the shards from
        the whole params, releases these and installs the unit hooks."""
        ...


class ExposedGradsKit(Protocol[Part]):
    """Builds what the grad sync hands out as `.grad` ([Note: grad contract] in grads.py)."""

    def exposed(self) -> Part:
        """Every param's reduced grad as its `.grad`."""
        ...

    def refused(self) -> Part:
        """Nothing exposed; an optimizer that reads `.grad` is refused (it would see none)."""
        ...


class UnitPlanKit(Protocol[Part]):
    """Plans the shard units of a model ([Note: shard units] in sharding/units.py)."""

    def plan_units(self) -> Part: ...


class OptimizerKit(Protocol[Part]):
    """The optimizer classes `build_optimizer` may choose (optimizer/builder.py)."""

    def distributed(self) -> Part:
        """Steps this rank's shard of the main params (`DistributedOptimizer`)."""
        ...

    def replicated(self) -> Part:
        """Steps every param on every rank (`FP32Optimizer` / `MixedPrecisionOptimizer`)."""
        ...


class ShardingStrategy:
    """The base class is "no_shard" (torch DDP): everything whole on every rank."""

    name: ClassVar[str] = "no_shard"
    shards_optimizer: ClassVar[bool] = False  # the distributed optimizer (ZeRO-1)
    shards_grads: ClassVar[bool] = False  # ZeRO-2: only this rank's reduced grad shard is kept
    shards_params: ClassVar[bool] = False  # ZeRO-3: only a param shard between forwards
    reshards_after_forward: ClassVar[bool] = False  # ZeRO-3: units released after forward
    # config fields that only some strategies read: set under another, the config refuses them
    options: ClassVar[frozenset[str]] = frozenset()
    # config fields this strategy refuses even though others read them, and why
    refuses: ClassVar[tuple[tuple[str, ...], str]] = ((), "")

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
        forward instead, and unsharded params need nothing): what `param_side(kit)` builds
        does it (`stepped()`)."""
        return self.shards_optimizer and not self.shards_params

    def prescales(self, grad_dtype: torch.dtype) -> bool:
        """Grads are scaled before the collective (as torch DDP: all-reduce results match it
        bit for bit; fp16 always, a sum of dp fp16 values can overflow where their mean cannot);
        a reduce-scatter otherwise scales after it, 1/dp of the elements."""
        return not self.shards_optimizer or grad_dtype == torch.float16

    # ---- builders ([Note: strategies build their parts]) --------------------------------------
    def grad_storage(self, kit: GradStorageKit[Part]) -> Part:
        """A bucket group's grad storage: the whole buckets."""
        return kit.full_grads()

    def first_reduction(self, kit: ReductionKit[Part]) -> Part:
        """A bucket group's reduction inside its own collective group: an all-reduce."""
        return kit.all_reduce()

    def param_storage(self, kit: ParamStorageKit[Part]) -> Part | None:
        """A bucket group's param storage beyond its buffers' `param_data`: none."""
        return None

    def param_side(self, kit: ParamSideKit[Part]) -> Part:
        """The engine's param side, built after the initial broadcast."""
        return kit.gathered()

    def exposed_grads(self, kit: ExposedGradsKit[Part]) -> Part:
        """What the grad sync hands out as `.grad`."""
        return kit.exposed()

    def unit_plan(self, kit: UnitPlanKit[Part]) -> Part | None:
        """The shard units params are gathered and released by: none."""
        return None

    def optimizer(self, kit: OptimizerKit[Part]) -> Part:
        """What steps the params: every rank steps every param."""
        return kit.replicated()

    def agreement_mode(self, accumulation: str) -> str | None:
        """Why the ranks agree on every micro-batch ([Note: micro-batch agreement] in
        microbatches.py): the mode that communicates each micro-batch, for the error messages;
        None where nothing is communicated before the last micro-batch. `accumulation`:
        `sharded_grad_accumulation`."""
        return None

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

    def grad_buckets_bound(self, total_nbytes: int) -> int | None:
        """The high-water mark of full grad buckets, `total_nbytes` for all of them: none (the
        grad buffer is persistent)."""
        return None

    def unsharded_params_bound(
        self, root_nbytes: int, other_nbytes: list[int], prefetch_units: int
    ) -> int | None:
        """The high-water mark of gathered full params: none (params are never released).
        `root_nbytes`: the root unit's groups; `other_nbytes`: every other group's."""
        return None


class NoShard(ShardingStrategy):
    """torch DDP: full params and grads on every rank, grads all-reduced."""


class Optim(ShardingStrategy):
    """ZeRO-1, the distributed optimizer: grads reduce-scattered, each rank steps its shard of
    the fp32 main params and optimizer state, params all-gathered after the step."""

    name = "optim"
    shards_optimizer = True
    options = frozenset({
        "cpu_offload", "whole_param_owners", "whole_param_max_nbytes",
        "num_distributed_optimizer_instances",
    })  # fmt: skip

    def first_reduction(self, kit: ReductionKit[Part]) -> Part:
        """A reduce-scatter: each rank steps only its shard."""
        return kit.reduce_scatter()

    def exposed_grads(self, kit: ExposedGradsKit[Part]) -> Part:
        """None: each rank holds only its shard of the reduced grads."""
        return kit.refused()

    def optimizer(self, kit: OptimizerKit[Part]) -> Part:
        return kit.distributed()


class OptimGrads(Optim):
    """ZeRO-2: as "optim", and a bucket's full grad exists only while it accumulates and
    reduces; the reduced grad shard persists ([Note: sharded grad lifecycle])."""

    name = "optim_grads"
    shards_grads = True
    options = Optim.options | {"sharded_grad_accumulation"}

    def grad_storage(self, kit: GradStorageKit[Part]) -> Part:
        return kit.sharded_grads()

    def grad_buckets_bound(self, total_nbytes: int) -> int | None:
        """Every group's full grad bucket may be alive at once (no overlap: all accumulate
        until the end of backward)."""
        return total_nbytes

    def agreement_mode(self, accumulation: str) -> str | None:
        if accumulation == "reduce_each_microbatch":  # a reduce-scatter per micro-batch
            return "sharded_grad_accumulation='reduce_each_microbatch'"
        return None


class OptimGradsParams(OptimGrads):
    """ZeRO-3 / FSDP: as "optim_grads", and only a param shard persists; a unit's full params
    exist around its forward and backward ([Note: who gathers when]), released after its
    forward and gathered again for its backward."""

    name = "optim_grads_params"
    shards_params = True
    reshards_after_forward = True
    options = OptimGrads.options | {
        "shard_units", "reshard_after_forward", "prefetch_units", "verify_param_access"
    }  # fmt: skip
    refuses = (
        ("overlap_param_gather", "align_param_gather"),
        "params are gathered unit by unit in forward, overlapped by prefetch_units",
    )

    def param_storage(self, kit: ParamStorageKit[Part]) -> Part | None:
        return kit.sharded_params()

    def unit_plan(self, kit: UnitPlanKit[Part]) -> Part | None:
        return kit.plan_units()

    def param_side(self, kit: ParamSideKit[Part]) -> Part:
        return kit.units(reshard_after_forward=self.reshards_after_forward)

    def agreement_mode(self, accumulation: str) -> str | None:
        # units gather in every micro-batch's forward
        each = super().agreement_mode(accumulation)
        return each or f"data_parallel_sharding_strategy={self.name!r}"

    def unsharded_params_bound(
        self, root_nbytes: int, other_nbytes: list[int], prefetch_units: int
    ) -> int | None:
        """The root unit, plus the unit computing and those prefetched (at most all others)."""
        largest = max(other_nbytes, default=0)
        return root_nbytes + min(sum(other_nbytes), (1 + prefetch_units) * largest)


class OptimGradsParamsNoReshard(OptimGradsParams):
    """ZeRO-3 whose units stay gathered from forward to backward (FSDP2's
    `reshard_after_forward=False`): 6 instead of 8 wire bytes per param (no second gather in
    backward), every unit's full params alive at the end of forward. Off the linear chain: it
    shards what "optim_grads_params" shards and differs only in when units release. Selected by
    `data_parallel_sharding_strategy="optim_grads_params"` with `reshard_after_forward=False`
    (`name` stays the config's value)."""

    reshards_after_forward = False

    def __repr__(self) -> str:
        return f"<sharding strategy {self.name!r}, reshard_after_forward=False>"

    def unsharded_params_bound(
        self, root_nbytes: int, other_nbytes: list[int], prefetch_units: int
    ) -> int | None:
        """Every group: all units may be gathered at the end of forward."""
        return root_nbytes + sum(other_nbytes)


STRATEGIES: dict[str, ShardingStrategy] = {
    cls.name: cls() for cls in (NoShard, Optim, OptimGrads, OptimGradsParams)
}
SHARDING_STRATEGIES = tuple(STRATEGIES)
"""`data_parallel_sharding_strategy` values, least to most sharded (Megatron's names)."""
NO_RESHARD: dict[str, ShardingStrategy] = {
    OptimGradsParamsNoReshard.name: OptimGradsParamsNoReshard()
}
"""The strategies `reshard_after_forward=False` selects, by `data_parallel_sharding_strategy`."""


def sharding_strategy(name: str, *, reshard_after_forward: bool = True) -> ShardingStrategy:
    """The strategy object of `name` (and of `reshard_after_forward`, FSDP2's spelling of
    `OptimGradsParamsNoReshard`); raises naming the choices."""
    strategy = STRATEGIES.get(name)
    if strategy is None:
        raise ValueError(
            f"megabuf: data_parallel_sharding_strategy={name!r} is not one of "
            f"{list(SHARDING_STRATEGIES)}"
        )
    if reshard_after_forward:
        return strategy
    variant = NO_RESHARD.get(name)
    if variant is None:
        raise ValueError(
            f"megabuf: reshard_after_forward=False only applies to "
            f"data_parallel_sharding_strategy {' / '.join(NO_RESHARD)}, not {name!r}"
        )
    return variant
