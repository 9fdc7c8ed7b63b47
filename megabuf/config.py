"""`DistributedDataParallelConfig`: every knob of the engine in one keyword-only dataclass.

Loaded from TOML files in `configs/` (`from_toml`) or plain dicts (`from_dict`); contradictions are
rejected at construction with a ValueError naming the fields involved.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from megabuf.pure.config_fields import dataclass_from_dict, dataclass_from_toml, document_fields
from megabuf.pure.verify_levels import check_verify_fields
from megabuf.sharding.strategies import (
    SHARDING_STRATEGIES,
    STRATEGIES,
    ShardingStrategy,
    sharding_strategy,
)

GRAD_ACCUMULATION_MODES = ("accumulate_unsharded", "reduce_each_microbatch")
"""`sharded_grad_accumulation` values."""


@document_fields
@dataclass(frozen=True, kw_only=True)
class DistributedDataParallelConfig:
    """Configuration of megabuf's data-parallel engine (Megatron-LM field names)."""

    grad_reduce_in_fp32: bool = False
    """Accumulate and reduce gradients in fp32 even when params are bf16/fp16 (`main_grad` is
    fp32). Costs 2x grad memory for half-precision params; buys exact-ish accumulation."""

    overlap_grad_reduce: bool = False
    """Dispatch each bucket group's reduction asynchronously as soon as all its grads are ready,
    overlapping communication with the rest of backward. Off: one reduction in
    `finish_grad_sync()`."""

    overlap_param_gather: bool = False
    """With the distributed optimizer: `step()` dispatches every bucket group's param all-gather
    and returns; forward pre-hooks of the next forward wait for each group just before its
    first reader, so the gathers overlap forward compute. Requires `use_distributed_optimizer`."""

    align_param_gather: bool = False
    """Let a pipeline schedule dispatch every model chunk's first param all-gather itself (so the
    gathers of all chunks start together). Requires `use_distributed_optimizer`."""

    use_distributed_optimizer: bool | None = None
    """ZeRO-1 layout: pad params/buckets so every bucket splits into dp_size equal shards, reduce-
    scatter grads instead of all-reducing, keep params in a contiguous `param_data` buffer. The
    alias of `data_parallel_sharding_strategy = "optim"`; None (the default) follows the
    strategy. After construction it is always a bool: True under every sharded strategy."""

    data_parallel_sharding_strategy: str | None = None
    """What is sharded over dp ([Note: sharding strategies] in megabuf/sharding/__init__.py):
    "no_shard" (DDP: all-reduce), "optim" (ZeRO-1: fp32 main params and optimizer state),
    "optim_grads" (ZeRO-2: also the reduced grads), "optim_grads_params" (ZeRO-3 / FSDP: also the
    params, gathered unit by unit around forward and backward). None: "optim" if
    `use_distributed_optimizer` else "no_shard". After construction it is always a string."""

    shard_units: tuple[str, ...] = ()
    """optim_grads_params only: the modules whose params are gathered and released together,
    as class names ("Block") or dotted module paths ("layers.0"); a Python caller may also pass
    classes. Empty: the documented default policy (megabuf/sharding/units.py); a unit set that
    makes the whole model one unit warns (its peak is a full param copy)."""

    reshard_after_forward: bool = True
    """optim_grads_params only: release each unit's gathered params after its forward (gather
    again for backward). False keeps them until the unit's backward (6 instead of 8 wire bytes
    per param, more memory). The root unit never reshards after forward. FSDP2's spelling:
    False selects the strategy `OptimGradsParamsNoReshard` (`config.sharding`,
    megabuf/sharding/strategies.py), which every engine part asks instead of this field."""

    prefetch_units: int = 1
    """optim_grads_params only: how many units ahead (in the recorded runtime order) to start
    gathering in forward and backward. 0: no prefetch; 1: double buffering."""

    sharded_grad_accumulation: str = "accumulate_unsharded"
    """optim_grads / optim_grads_params only: how grads accumulate over micro-batches under
    `no_sync()`. "accumulate_unsharded" (default, as torch DDP's and FSDP's no_sync): the full
    grad buckets stay allocated through the accumulation window and are reduced once (bitwise
    equal to "optim"; ZeRO-1's grad memory during accumulation). "reduce_each_microbatch" (as
    Megatron-FSDP): every backward reduce-scatters into the persistent grad shard, so `no_sync()`
    saves no communication but the full buckets are released after each backward."""

    cpu_offload: bool = False
    """Sharded strategies only: keep the fp32 main params and optimizer state on the host (pinned
    when CUDA is present) and run the optimizer step on the CPU. A no-op with a warning when the
    params already live on the CPU."""

    verify_param_access: bool = False
    """optim_grads_params debug mode: released param storage is kept, filled with NaN, so a read
    of a param outside its unit's forward/backward gives NaN (caught by
    `check_for_nan_in_grad`) instead of an error from an empty storage. Costs the full param
    memory; for debugging only."""

    check_for_nan_in_grad: bool = False
    """Flag NaN/Inf grads of each bucket before its reduction (on the device, no host read in
    backward); `finish_grad_sync()` then agrees over dp (one small MAX all-reduce) and raises on
    every rank naming the bucket(s), their params and the ranks ([Note: NaN check])."""

    sync_grads_at_backward_end: bool = True
    """On (default, as torch DDP): a backward that runs with grad sync on (outside `no_sync()`,
    `require_backward_grad_sync` True) finishes the grad sync before it returns (an autograd
    end-of-backward callback runs `finish_grad_sync()`), so a torch-DDP loop needs no megabuf
    call; an explicit `finish_grad_sync()` afterwards is a no-op. Off: only
    `finish_grad_sync()` finishes it, so the last buckets' reductions overlap whatever runs
    before that call (Megatron's loop). megabuf's pipeline schedules defer it themselves
    (`model.deferred_grad_sync()`), whatever this flag says."""
    error_on_unused_params: bool = False
    """Strict mode. Off (default): a trainable param that gets no gradient in an iteration on
    some or all ranks is zero-filled and reduced like any other, in the fixed dispatch order on
    every rank, so every rank ends with the same grads and nobody waits. On: `finish_grad_sync()`
    also raises on every rank, naming each such param and the ranks that lacked it (one small
    all-reduce per iteration)."""

    bucket_size: int | Literal["auto"] | None = None
    """Bucket size in elements. None: with `overlap_grad_reduce`, Megatron's
    max(40_000_000, 1_000_000 * dp_size) capped at a quarter of the largest buffer (so small
    models overlap too); without overlap, one bucket per buffer. "auto": start with the default,
    measure `auto_bucket_warmup_steps` steps, then re-plan the bucket boundaries once, so the
    predicted communication left after backward is least ([Note: auto bucket plan] in
    megabuf/pure/bucket_planner.py, [Note: auto bucket re-plan] in megabuf/replan/autobucket.py;
    under a sharded strategy the params and the optimizer state move to new buffers: [Note: sharded
    auto bucket re-plan] in megabuf/replan/sharded_replan.py); at dp 1 the default stays. Needs
    `overlap_grad_reduce`, and no `comm_hook`, `deterministic_reduction` or
    `whole_param_owners`."""

    auto_bucket_warmup_steps: int = 3
    """With `bucket_size = "auto"`: the number of steps run on the default buckets before the
    re-plan; the first is not measured (it learns the grad arrival order), the others are, and
    the re-plan happens at the step boundary after the last (`zero_grad_buffer()`). >= 2. With
    3 or more, under "no_shard" and "optim", the last reduces its grads after backward ([Note:
    quiet step] in megabuf/replan/warmup.py)."""

    whole_param_owners: bool = False
    """Under a sharded strategy: each param is owned whole by one dp rank instead of split by
    elements, so matrix optimizers (`torch.optim.Muon`, megabuf's `MuonAdamW`) see whole
    matrices. Owners are balanced by Newton-Schulz cost; each bucket's shards follow params and
    are padded to the largest ([Note: whole-param owners] in megabuf/pure/owners.py)."""

    whole_param_max_nbytes: int | None = None
    """With `whole_param_owners`: the most bytes (numel x param itemsize) one param may bring to
    its owner; a larger param raises at construction naming it, instead of running one rank out
    of memory. None: no limit."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad buckets to a multiple of 2**16 elements as well (NCCL reaches higher bus bandwidth
    for such sizes at large dp). Only meaningful with `use_distributed_optimizer`."""

    average_in_collective: bool = False
    """Average with an AVG collective instead of pre-scaling grads by 1/dp and summing. (gloo has
    no AVG op: megabuf sums and divides after the collective, with the same result.)"""

    num_distributed_optimizer_instances: int = 1
    """Megatron's R: hybrid sharding as R replicas of a dp/R-way sharded strategy ([Note: hybrid
    rank order] in megabuf/pure/hybrid.py): grads reduce-scattered inside each dp/R-rank shard group
    and the shards all-reduced across the R replicas, params gathered inside the shard group,
    optimizer state sharded dp/R ways. Needs a strategy that shards the optimizer ("optim",
    "optim_grads", "optim_grads_params") and R dividing dp. 1 (the default) is flat, unless the
    process groups were built split (`ProcessGroups.build(dp_shard_size=...)`,
    `ProcessGroups.from_device_mesh`), whose split then counts."""

    comm_hook: dict[str, Any] | None = None
    """A built-in communication hook registered at construction instead of the engine's own
    reduction ([Note: comm hook contract]): `{"name": "compress", "dtype": "bfloat16",
    "accumulate": "fp32", "buffers": "all"}` (names: reduce, noop, compress, compress_wrapper
    with `inner = "reduce"` or an inner table, quantize, local_sgd, powersgd, batched_powersgd;
    `buffers`: dense, expert or all). In TOML a `[comm_hook]` table (or `[ddp.comm_hook]`).
    None: no hook."""

    comm_hook_timeout_s: float | None = 300.0
    """How long the engine waits, per wait, for a communication hook's work (each Future, Work or
    collective it returns or yields) before raising `CommHookTimeoutError` naming the hook, the
    bucket and the rank, instead of hanging ([Note: bounded hook wait]). A positive number of
    seconds, or None for no bound. Only hooks are bounded here; the engine's own collectives
    are bounded by the process group's timeout."""

    deterministic_reduction: bool = False
    """Reduce every bucket (dense and expert; all-reduce and reduce-scatter mode) by a fixed-order
    sum: an all-to-all of grad-dtype chunks, a sum in fp32 in rank order (one rounding back for
    bf16 grads), an all-gather in all-reduce mode. Grads are then bitwise identical across
    `bucket_size`, `overlap_grad_reduce` and repeated runs, on gloo and NCCL ([Note:
    deterministic reduction] in megabuf/comm_hooks/fixed_order.py; check a model with
    `megabuf.verify_reproducible`). Costs the wire bytes of a ring all-reduce (reduce-scatter)
    plus a local sum pass after the transfer. The optimizers then sum the grad norm exactly
    ([Note: exact grad norm]), so clipped steps are bitwise too. A `comm_hook` with it must
    declare `deterministic = True` (e.g. Compress with accumulate = "fp32")."""

    verify: str = "off"
    """Run-time self-checks that name the first diverging rank ([Note: verify mode],
    docs/verify.md): "off", "collectives" (each group's collective sequence agreed before each
    bucket's reduction is issued and at every grad sync), "replicas" (params, and no_shard's
    synced grads, equal across dp / expt_dp at every grad sync), "norms" (the optimizer's grad
    norm against an fp64 norm over the exact ownership sets), or "all". Each raises on every
    rank naming the collective, param or set; each costs collectives (see BENCHMARKS.md)."""

    check_for_large_grads: bool | str = False
    """Spike guard (Megatron's name): a global grad norm more than 10x the largest of the last
    100 finite ones (after 5) raises ("raise" or True) or skips the step ("skip") on every rank
    that steps, naming the norm and the history; False / "off": no check."""

    grad_norm_skip_threshold: float | None = None
    """Skip the step on every rank that steps when the global grad norm exceeds this (counted in
    `optimizer.step_checks.skipped`, logged on rank 0). None: off."""

    memory_budget: int | None = None
    """Device bytes per rank for megabuf's own memory (params, grads, optimizer state, scratch,
    transient buckets and gathered units; activations not included): the engine plans at
    construction ([Note: memory planner] in megabuf/planning/budget.py) and replaces the strategy,
    hybrid split, cpu_offload, bucket_size and prefetch_units with the choice that fits (Adam
    state assumed; one decision on every rank). None: the config as given."""

    def __post_init__(self) -> None:
        self._resolve_sharding_strategy()
        check_verify_fields(self)
        for name in ("overlap_param_gather", "align_param_gather"):
            if getattr(self, name) and not self.use_distributed_optimizer:
                raise ValueError(
                    f"megabuf: DistributedDataParallelConfig.{name}=True requires "
                    "use_distributed_optimizer=True (only the distributed optimizer gathers "
                    "params); set use_distributed_optimizer=True or turn it off"
                )
        if (
            self.bucket_size is not None
            and self.bucket_size != "auto"
            and (isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int))
        ):
            raise ValueError(
                f"megabuf: DistributedDataParallelConfig.bucket_size must be an int number of "
                f'elements, "auto" or None, got {self.bucket_size!r}'
            )
        if self.bucket_size == "auto":
            self._check_auto_bucket()
        elif self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"megabuf: DistributedDataParallelConfig.bucket_size must be > 0 elements, got "
                f"{self.bucket_size}; use None for the default"
            )
        self._check_comm_hook()
        self._check_comm_hook_timeout()
        self._check_instances()

    def _check_instances(self) -> None:
        field = "DistributedDataParallelConfig.num_distributed_optimizer_instances"
        r = self.num_distributed_optimizer_instances
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"megabuf: {field} must be an int >= 1, got {r!r}")
        if r > 1 and "num_distributed_optimizer_instances" not in self.sharding.options:
            raise ValueError(
                f"megabuf: {field}={r} needs a strategy that shards the optimizer (hybrid "
                f"sharding replicates a sharded optimizer), got data_parallel_sharding_strategy="
                f"{self.sharding.name!r}; use 'optim', 'optim_grads' or 'optim_grads_params'"
            )

    def _check_auto_bucket(self) -> None:
        """bucket_size="auto" re-plans once ([Note: auto bucket re-plan]; sharded: [Note:
        sharded auto bucket re-plan]): not where the plan cannot change after construction."""
        warmup = self.auto_bucket_warmup_steps
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.auto_bucket_warmup_steps must be an int "
                f">= 2 (one learning step, then at least one measured), got {warmup!r}"
            )
        refusals = [
            (not self.overlap_grad_reduce, "overlap_grad_reduce=False (nothing to overlap: "
             "set overlap_grad_reduce=True, or leave bucket_size=None)"),
            (self.comm_hook is not None, "comm_hook (hook state follows the bucket boundaries: "
             "give an int bucket_size)"),
            (self.deterministic_reduction, "deterministic_reduction=True (its fixed-order hook "
             "is installed per bucket: give an int bucket_size)"),
            (self.whole_param_owners, "whole_param_owners=True (the owner table follows the "
             "bucket boundaries and a re-plan of it is not verified yet: give an int bucket_size)"),
        ]  # fmt: skip
        for refused, why in refusals:
            if refused:
                raise ValueError(
                    f'megabuf: DistributedDataParallelConfig.bucket_size="auto" cannot be used '
                    f"with {why}"
                )

    def _resolve_sharding_strategy(self) -> None:
        """Make `data_parallel_sharding_strategy` and `use_distributed_optimizer` agree (one may
        be None and follows the other); name every contradiction."""
        field = "DistributedDataParallelConfig.data_parallel_sharding_strategy"
        strategy, dist_opt = self.data_parallel_sharding_strategy, self.use_distributed_optimizer
        if strategy is not None and strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"megabuf: {field}={strategy!r} is not one of {list(SHARDING_STRATEGIES)}"
            )
        if dist_opt is not None and not isinstance(dist_opt, bool):
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.use_distributed_optimizer must be a bool "
                f"or None, got {dist_opt!r}"
            )
        if strategy is None:
            strategy = "optim" if dist_opt else "no_shard"
        if dist_opt is not None and dist_opt != (strategy != "no_shard"):
            raise ValueError(
                f"megabuf: {field}={strategy!r} contradicts use_distributed_optimizer={dist_opt} "
                "(every sharded strategy uses the distributed optimizer; no_shard does not); "
                "set only data_parallel_sharding_strategy and leave use_distributed_optimizer "
                "unset"
            )
        object.__setattr__(self, "data_parallel_sharding_strategy", strategy)
        object.__setattr__(self, "use_distributed_optimizer", strategy != "no_shard")
        self._check_sharding_options(strategy)

    def _check_sharding_options(self, strategy: str) -> None:
        """Options that only one strategy reads must not be set under another (a run that
        silently ignores them would not be the run the user asked for)."""
        units = self.shard_units
        if isinstance(units, (str, type)):
            units = (units,)
        if not isinstance(units, (tuple, list)) or not all(
            isinstance(u, (str, type)) and u for u in units
        ):
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.shard_units must be a list of module "
                f"class names, dotted module paths or classes, got {self.shard_units!r}"
            )
        object.__setattr__(self, "shard_units", tuple(units))
        prefetch = self.prefetch_units
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.prefetch_units must be an int >= 0, "
                f"got {prefetch!r}"
            )
        if self.sharded_grad_accumulation not in GRAD_ACCUMULATION_MODES:
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.sharded_grad_accumulation="
                f"{self.sharded_grad_accumulation!r} is not one of {list(GRAD_ACCUMULATION_MODES)}"
            )

        def names(option: str) -> tuple[str, ...]:  # the strategies that read `option`
            return tuple(n for n, s in STRATEGIES.items() if option in s.options)

        applies = {
            "shard_units": bool(self.shard_units),
            "reshard_after_forward": self.reshard_after_forward is not True,
            "prefetch_units": prefetch != 1,
            "verify_param_access": bool(self.verify_param_access),
            "sharded_grad_accumulation": (self.sharded_grad_accumulation != "accumulate_unsharded"),
            "cpu_offload": bool(self.cpu_offload),
            "whole_param_owners": bool(self.whole_param_owners),
            "whole_param_max_nbytes": self.whole_param_max_nbytes is not None,
        }
        for name, is_set in applies.items():
            if is_set and name not in STRATEGIES[strategy].options:
                raise ValueError(
                    f"megabuf: DistributedDataParallelConfig.{name}={getattr(self, name)!r} only "
                    f"applies to data_parallel_sharding_strategy {' / '.join(names(name))}, not "
                    f"{strategy!r}; leave {name} at its default or change the strategy"
                )
        refused, why = STRATEGIES[strategy].refuses
        if any(getattr(self, name) for name in refused):
            raise ValueError(
                f"megabuf: DistributedDataParallelConfig.{' / '.join(refused)} do not apply to "
                f"{strategy}: {why}; turn them off"
            )

    def _check_comm_hook(self) -> None:
        """A table with a string `name`; the hook itself is built (and its options checked) by
        the engine, which is where `megabuf.comm_hooks` may be imported."""
        hook = self.comm_hook
        if hook is None:
            return
        if not isinstance(hook, dict) or not isinstance(hook.get("name"), str):
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.comm_hook must be a table with a string "
                "`name` (reduce, noop, compress, powersgd, batched_powersgd) and the hook's "
                f"options, got {hook!r}"
            )
        object.__setattr__(self, "comm_hook", dict(hook))  # a copy: the config stays frozen

    def _check_comm_hook_timeout(self) -> None:
        timeout = self.comm_hook_timeout_s
        if timeout is None:
            return
        number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
        if not number or not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.comm_hook_timeout_s must be a positive "
                f"number of seconds or None (no bound), got {timeout!r}"
            )

    @property
    def sharding(self) -> ShardingStrategy:
        """`data_parallel_sharding_strategy` (and `reshard_after_forward`) as an object, which
        the engine asks instead of reading the flags ([Note: sharding strategy objects] in
        megabuf/sharding/strategies.py)."""
        return sharding_strategy(
            str(self.data_parallel_sharding_strategy),
            reshard_after_forward=self.reshard_after_forward,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> DistributedDataParallelConfig:
        """Build from a mapping; unknown keys raise a ValueError listing the valid fields."""
        return dataclass_from_dict(cls, values)

    @classmethod
    def from_toml(cls, path: str | Path) -> DistributedDataParallelConfig:
        """Load a TOML file; keys may sit at top level or under a `[ddp]` table, the comm hook
        in `[ddp.comm_hook]` or a top-level `[comm_hook]` table."""
        cfg = dataclass_from_toml(cls, path, "ddp", top_level_fallback=True)
        with open(path, "rb") as f:
            data = tomllib.load(f)
        top = data.get("comm_hook") if "ddp" in data else None
        if top is None:
            return cfg
        if cfg.comm_hook is not None:
            raise ValueError(
                f"megabuf: config file {path} has both [comm_hook] and [ddp.comm_hook]; keep one"
            )
        return cfg.replace(comm_hook=dict(top))

    def replace(self, **changes: Any) -> DistributedDataParallelConfig:
        """A copy with some fields changed (validated again). Changing only one of
        `data_parallel_sharding_strategy` / `use_distributed_optimizer` lets the other follow."""
        pair = ("data_parallel_sharding_strategy", "use_distributed_optimizer")
        for mine, other in (pair, pair[::-1]):
            if mine in changes and other not in changes:
                changes[other] = None
        return dataclasses.replace(self, **changes)
