"""The memory planner's pure core: from a byte budget to a configuration (`megabuf plan`).

[Note: memory planner]
Given the trainable params (`ParamSpec`s, and their ZeRO-3 units), the optimizer's state
(`OptimizerStateSpec`), a device byte budget (and optionally a host budget), the dp topology
and one step's activation bytes, `plan_budget` tries a small discrete set of candidates
(`Candidate`: strategy, hybrid shard size, cpu_offload, bucket size, ZeRO-3 prefetch depth,
grad_reduce_in_fp32 where the search may vary it) and predicts for each, on the busiest rank:
- persistent bytes, exactly: the config's plan (`build_plan`, what the engine allocates) under
  `persistent_bytes`, the formula the engine's ledger and the storage walk are tested against
  ([Note: memory formula]); no second formula. Frozen params and module buffers are added as
  they are (`fixed_nbytes`);
- transient bounds: `transient_bounds` (full grad buckets in flight, gloo's landing zones,
  gathered units at the given prefetch depth) and, under "no_shard" with half params over
  fp32 grads, the `.grad` copies handed out after the sync ("grad_copies");
- activations as measured (or given);
- exposed communication from the calibrated collective model ([Note: planner step-time model]).
A candidate fits when its device total is at most the budget less the margin
(`usable(budget, margin)`), and its host total likewise when a host budget is given. The
choice: among those that fit, the least predicted exposed communication (within TIE_S), then
the least device bytes, then the least host bytes, then the earlier candidate (the search
order: least sharded first), so identical inputs give the identical choice on every rank
([Note: one plan on every rank] in budget_agree.py). Every other candidate keeps its reason.
If nothing fits, `needed_budget_nbytes` is the smallest budget with which one would fit, and
`advice` says what else could change (activations, more ranks, offload).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from megabuf.config import DistributedDataParallelConfig
from megabuf.planning.budget_time import exposed_comm_s
from megabuf.planning.plan import ParamSpec, build_plan
from megabuf.pure.bucket_planner import CollectiveModel
from megabuf.sharding.formula import (
    DEVICE_CATEGORIES,
    HOST_CATEGORIES,
    OptimizerStateSpec,
    persistent_bytes,
    transient_bounds,
)
from megabuf.sharding.strategies import SHARDING_STRATEGIES, STRATEGIES

TIE_S = 1e-6
DEFAULT_MARGIN = 0.1
# 10 GB/s and 50 us: a nominal link until a measured one is given
NOMINAL_LINK = CollectiveModel(latency_s=50e-6, seconds_per_byte=1e-10)
NOMINAL_HOST_LINK = CollectiveModel(latency_s=10e-6, seconds_per_byte=1.0 / 20e9)
SHARDED = tuple(n for n in SHARDING_STRATEGIES if STRATEGIES[n].shards_optimizer)
SEARCHED_FIELDS = (
    "data_parallel_sharding_strategy", "use_distributed_optimizer", "cpu_offload", "bucket_size",
    "prefetch_units", "grad_reduce_in_fp32", "num_distributed_optimizer_instances",
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One point of the search."""

    strategy: str
    shard_size: int  # dp = replicas x shard_size; == dp_size: flat
    cpu_offload: bool
    bucket_size: int | None
    prefetch_units: int
    grad_reduce_in_fp32: bool

    def describe(self) -> str:
        parts = [self.strategy]
        if self.strategy != "no_shard":
            parts.append(f"shard {self.shard_size}")
        parts.append(f"bucket {self.bucket_size if self.bucket_size is not None else 'default'}")
        if self.strategy == "optim_grads_params":
            parts.append(f"prefetch {self.prefetch_units}")
        if self.cpu_offload:
            parts.append("cpu_offload")
        if self.grad_reduce_in_fp32:
            parts.append("fp32 grads")
        return ", ".join(parts)


@dataclass(frozen=True)
class BudgetInputs:
    """What the planner plans from; see [Note: memory planner]."""

    specs: tuple[ParamSpec, ...]
    optimizer: OptimizerStateSpec
    device_budget_nbytes: int
    dp_size: int = 1
    ep_size: int = 1
    host_budget_nbytes: int | None = None
    activation_nbytes: int = 0  # one step at the user's micro-batch, measured or given
    fixed_nbytes: int = 0  # frozen params and module buffers
    unit_of_param: tuple[int, ...] | None = None  # ZeRO-3 shard unit of each spec
    margin: float = DEFAULT_MARGIN  # of each budget, kept free
    accelerator: bool = False  # params on an accelerator: cpu_offload moves bytes to the host
    reduce_scatter_scratch: bool = False  # gloo keeps all-to-all landing zones
    step_compute_s: float = 0.0  # forward + backward of one step, measured or given
    collective: CollectiveModel = NOMINAL_LINK
    host_link: CollectiveModel = NOMINAL_HOST_LINK
    base: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    strategies: tuple[str, ...] = SHARDING_STRATEGIES
    shard_sizes: tuple[int, ...] | None = None  # None: every divisor of dp_size
    bucket_sizes: tuple[int | None, ...] | None = None  # None: see `_bucket_sizes`
    prefetch_depths: tuple[int, ...] = (0, 1, 2)
    vary_grad_reduce_in_fp32: bool = False  # else the base config's value is kept


@dataclass(frozen=True)
class Evaluation:
    """One candidate's prediction on the busiest rank, and why it was or was not chosen."""

    candidate: Candidate
    config: DistributedDataParallelConfig | None  # None: the config refused the candidate
    device: dict[str, int]  # category -> bytes: persistent, transient bounds, activations
    host: dict[str, int]
    exposed_comm_s: float
    step_s: float
    fits: bool
    reason: str  # "" for the chosen one
    persistent_per_rank: tuple[dict[str, int], ...] = ()  # the formula on every shard rank

    @property
    def device_nbytes(self) -> int:
        return sum(self.device.values())

    @property
    def host_nbytes(self) -> int:
        return sum(self.host.values())


@dataclass(frozen=True)
class BudgetPlan:
    """The planner's answer; `chosen` is None when nothing fits."""

    inputs: BudgetInputs
    chosen: Evaluation | None
    evaluations: tuple[Evaluation, ...]  # every candidate, search order
    needed_budget_nbytes: int | None  # nothing fits: the least device budget one would fit in
    advice: tuple[str, ...]

    @property
    def rejected(self) -> tuple[Evaluation, ...]:
        return tuple(e for e in self.evaluations if e is not self.chosen)

    @property
    def config(self) -> DistributedDataParallelConfig:
        """The chosen config; raises with the smallest budget that would fit when none does."""
        if self.chosen is None or self.chosen.config is None:
            raise ValueError(
                f"megabuf: no configuration fits a device budget of "
                f"{self.inputs.device_budget_nbytes:,} bytes (margin {self.inputs.margin:.0%}); "
                f"the smallest that would is {self.needed_budget_nbytes or 0:,} bytes. "
                + " ".join(self.advice)
            )
        return self.chosen.config


def usable(budget_nbytes: int, margin: float) -> int:
    """The bytes of a budget a candidate may fill: the margin stays free."""
    return math.floor(budget_nbytes * (1.0 - margin))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _bucket_sizes(inputs: BudgetInputs) -> tuple[int | None, ...]:
    """The default (None), and with overlap a quarter and a sixteenth of the params."""
    if inputs.bucket_sizes is not None:
        return inputs.bucket_sizes
    if not inputs.base.overlap_grad_reduce:
        return (None,)
    numel = sum(s.numel for s in inputs.specs)
    return tuple(dict.fromkeys((None, max(1, numel // 4), max(1, numel // 16))))


def candidates(inputs: BudgetInputs) -> list[Candidate]:
    """The search set, least sharded first; see [Note: memory planner]."""
    dp = inputs.dp_size
    out = []
    fp32 = (False, True) if inputs.vary_grad_reduce_in_fp32 else (inputs.base.grad_reduce_in_fp32,)
    for name in inputs.strategies:
        rules = STRATEGIES[name]
        shards = [dp]
        if rules.shards_optimizer and inputs.ep_size == 1:
            # a 1-rank shard is "no_shard" with extra steps: only at dp 1
            sizes = inputs.shard_sizes or [d for d in _divisors(dp) if d > 1 or dp == 1]
            shards = sorted(set(sizes), reverse=True)
        offloads = (False, True) if rules.shards_optimizer and inputs.accelerator else (False,)
        prefetch = inputs.prefetch_depths if rules.shards_params else (inputs.base.prefetch_units,)
        for shard in shards:
            for offload in offloads:
                for size in _bucket_sizes(inputs):
                    for depth in prefetch:
                        for f32 in fp32:
                            out.append(Candidate(name, shard, offload, size, depth, f32))
    return out


def candidate_config(
    base: DistributedDataParallelConfig, candidate: Candidate, dp_size: int
) -> DistributedDataParallelConfig:
    """`base` with the searched fields set to `candidate`; options the candidate's strategy does
    not read go back to their defaults (the config would refuse them)."""
    rules = STRATEGIES[candidate.strategy]
    values = dict(base.__dict__)
    defaults = {f.name: f.default for f in dataclasses.fields(DistributedDataParallelConfig)}
    foreign = set().union(*(s.options for s in STRATEGIES.values())) - rules.options
    for name in foreign | set(rules.refuses[0]):
        if name in defaults and defaults[name] is not dataclasses.MISSING:
            values[name] = defaults[name]
    values.update(
        data_parallel_sharding_strategy=candidate.strategy, use_distributed_optimizer=None,
        cpu_offload=candidate.cpu_offload, bucket_size=candidate.bucket_size,
        grad_reduce_in_fp32=candidate.grad_reduce_in_fp32, memory_budget=None,
    )  # fmt: skip
    if rules.shards_params:
        values["prefetch_units"] = candidate.prefetch_units
    if rules.shards_optimizer:
        values["num_distributed_optimizer_instances"] = dp_size // candidate.shard_size
    return DistributedDataParallelConfig.from_dict(values)


def _predict(
    inputs: BudgetInputs, candidate: Candidate, config: DistributedDataParallelConfig
) -> Evaluation:
    """Bytes per category on the busiest rank and the exposed communication, not yet judged."""
    shard, ep = candidate.shard_size, inputs.ep_size
    expt = max(1, shard // ep)
    plan = build_plan(
        inputs.specs, config, dp_size=shard, expt_dp_size=expt, expert_shares_dp_group=ep == 1,
        unit_of_param=inputs.unit_of_param if config.sharding.shards_params else None,
    )  # fmt: skip
    offload = candidate.cpu_offload and inputs.accelerator
    per_rank = tuple(
        persistent_bytes(
            plan,
            candidate.strategy,
            inputs.optimizer,
            dp_rank=r,
            expt_dp_rank=r % expt,
            reduce_scatter_scratch=inputs.reduce_scatter_scratch,
            cpu_offload=offload,
        )
        for r in range(shard)
    )
    busiest = max(per_rank, key=lambda f: sum(f[c] for c in DEVICE_CATEGORIES))
    device = {c: busiest[c] for c in DEVICE_CATEGORIES}
    device["frozen_and_buffers"] = inputs.fixed_nbytes
    bounds = transient_bounds(plan, config.sharding, prefetch_units=config.prefetch_units)
    if not inputs.reduce_scatter_scratch:
        bounds.pop("grad_scratch", None)
    device.update(bounds)
    device["grad_copies"] = _grad_copies(plan, config)
    device["activations"] = inputs.activation_nbytes
    host = {c: busiest[c] for c in HOST_CATEGORIES}
    comm = exposed_comm_s(
        plan, config.sharding, model=inputs.collective, dp_size=inputs.dp_size,
        shard_size=shard, step_compute_s=inputs.step_compute_s,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather, prefetch_units=config.prefetch_units,
        offload_nbytes=_offload_nbytes(busiest, inputs.specs) if offload else 0,
        host_link=inputs.host_link,
    )  # fmt: skip
    step = inputs.step_compute_s + comm
    return Evaluation(candidate, config, device, host, comm, step, True, "", per_rank)


def _offload_nbytes(figures: dict[str, int], specs: Sequence[ParamSpec]) -> int:
    """Bytes crossing the host link per step with cpu_offload: the grad shard down, the
    updated param shard (in the first param's dtype) back up."""
    owned = figures["host_main_params"] // 4  # fp32 main params of the owned elements
    return figures["host_grads"] + owned * specs[0].dtype.itemsize


def _grad_copies(plan: object, config: DistributedDataParallelConfig) -> int:
    """`.grad` copies in the param dtype handed out after a "no_shard" sync when the grads are
    kept in another dtype ([Note: memory report categories])."""
    if not config.sharding.exposes_grads:
        return 0
    return sum(
        b.layout.numel_unpadded * b.param_dtype.itemsize
        for b in getattr(plan, "buffers", ())
        if b.param_dtype != b.grad_dtype
    )


def _judge(inputs: BudgetInputs, ev: Evaluation) -> Evaluation:
    """`ev` with `fits` and, when it does not, the side and category that overflow."""
    reasons = []
    room = usable(inputs.device_budget_nbytes, inputs.margin)
    if ev.device_nbytes > room:
        reasons.append(_overflow("device", ev.device, room, inputs.device_budget_nbytes, inputs))
    if inputs.host_budget_nbytes is not None:
        host_room = usable(inputs.host_budget_nbytes, inputs.margin)
        if ev.host_nbytes > host_room:
            reasons.append(_overflow("host", ev.host, host_room, inputs.host_budget_nbytes, inputs))
    if not reasons:
        return ev
    return dataclasses.replace(ev, fits=False, reason="; ".join(reasons))


def _overflow(
    side: str, figures: dict[str, int], room: int, budget: int, inputs: BudgetInputs
) -> str:
    largest = max(figures, key=lambda c: figures[c])
    total = sum(figures.values())
    return (
        f"{side} needs {total:,} B > {room:,} B usable ({budget:,} B less the "
        f"{inputs.margin:.0%} margin): over by {total - room:,} B; largest category "
        f"{largest} {figures[largest]:,} B"
    )


def _rank_key(ev: Evaluation) -> tuple[float, int, int]:
    return (round(ev.exposed_comm_s / TIE_S), ev.device_nbytes, ev.host_nbytes)


def evaluate(inputs: BudgetInputs, candidate: Candidate) -> Evaluation:
    """One candidate, predicted and judged against the budgets."""
    try:
        config = candidate_config(inputs.base, candidate, inputs.dp_size)
    except ValueError as exc:
        return Evaluation(candidate, None, {}, {}, math.inf, math.inf, False, f"refused: {exc}")
    return _judge(inputs, _predict(inputs, candidate, config))


def plan_budget(inputs: BudgetInputs) -> BudgetPlan:
    """The chosen configuration and every alternative's reason; see [Note: memory planner]."""
    check_inputs(inputs)
    evaluations = [evaluate(inputs, c) for c in candidates(inputs)]
    fitting = [e for e in evaluations if e.fits]
    chosen = min(fitting, key=_rank_key) if fitting else None
    out = [_lost(e, chosen) if e.fits and e is not chosen else e for e in evaluations]
    if chosen is not None:
        return BudgetPlan(inputs, chosen, tuple(out), None, ())
    needed = _needed_budget(inputs, evaluations)
    return BudgetPlan(inputs, None, tuple(out), needed, _advice(inputs, evaluations, needed))


def _lost(ev: Evaluation, chosen: Evaluation | None) -> Evaluation:
    if chosen is None:
        return ev
    if _rank_key(ev)[0] > _rank_key(chosen)[0]:
        why = (
            f"fits, but predicts {ev.exposed_comm_s * 1e3:.3f} ms exposed communication > "
            f"{chosen.exposed_comm_s * 1e3:.3f} ms of the chosen"
        )
    else:
        why = (
            f"fits with the same predicted communication, but needs {ev.device_nbytes:,} B "
            f"(host {ev.host_nbytes:,} B) >= the chosen's {chosen.device_nbytes:,} B "
            f"(host {chosen.host_nbytes:,} B)"
        )
    return dataclasses.replace(ev, reason=why)


def _needed_budget(inputs: BudgetInputs, evaluations: Sequence[Evaluation]) -> int | None:
    """The least device budget with which some candidate (that fits its host budget) fits."""
    needs = [
        e.device_nbytes
        for e in evaluations
        if e.config is not None and "host needs" not in e.reason
    ]
    if not needs:
        return None
    least = min(needs)
    budget = math.ceil(least / (1.0 - inputs.margin))
    while usable(budget - 1, inputs.margin) >= least:  # float rounding: the least such budget
        budget -= 1
    while usable(budget, inputs.margin) < least:
        budget += 1
    return budget


def _advice(
    inputs: BudgetInputs, evaluations: Sequence[Evaluation], needed: int | None
) -> tuple[str, ...]:
    out = []
    if needed is not None:
        out.append(f"Give a device budget of at least {needed:,} bytes.")
    if inputs.activation_nbytes:
        out.append(
            f"Activations take {inputs.activation_nbytes:,} B of every candidate: a smaller "
            "micro-batch (or activation checkpointing) shrinks them about in proportion."
        )
    if "optim_grads_params" in inputs.strategies:
        out.append(
            "More data-parallel ranks shrink the sharded params, grads and optimizer state "
            "of optim_grads_params about in proportion."
        )
    if not inputs.accelerator:
        out.append("cpu_offload moves main params and optimizer state to the host only when "
                   "the params are on an accelerator.")  # fmt: skip
    elif inputs.host_budget_nbytes is not None:
        out.append("A larger host budget lets cpu_offload candidates fit.")
    return tuple(out)


def check_inputs(inputs: BudgetInputs) -> None:
    if inputs.device_budget_nbytes <= 0:
        raise ValueError(
            f"megabuf: plan_for_budget device budget must be > 0 bytes, got "
            f"{inputs.device_budget_nbytes}"
        )
    if not 0.0 <= inputs.margin < 1.0:
        raise ValueError(f"megabuf: plan_for_budget margin must be in [0, 1), got {inputs.margin}")
    if inputs.dp_size < 1 or inputs.dp_size % inputs.ep_size:
        raise ValueError(
            f"megabuf: plan_for_budget needs dp_size >= 1 divisible by ep_size; got "
            f"{inputs.dp_size}, {inputs.ep_size}"
        )
    unknown = [s for s in inputs.strategies if s not in STRATEGIES]
    if unknown or not inputs.specs:
        raise ValueError(
            f"megabuf: plan_for_budget strategies {unknown} are not among "
            f"{list(SHARDING_STRATEGIES)}, or the model has no trainable params"
        )
