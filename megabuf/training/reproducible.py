"""`verify_reproducible`: are a model's reduced gradients bitwise the same across engine variants?

[Note: what verify_reproducible proves]
It builds the user's model once per variant (a `DistributedDataParallelConfig` with a few fields
changed: by default a repeat of the base config, a small and a one-bucket `bucket_size`, and
`overlap_grad_reduce` flipped), runs the same `steps` forward/backward passes on the same
batches, and compares every trainable param's reduced gradient bitwise (its bytes) with the base
config's, on every rank. With the distributed optimizer each rank holds only its shard of each
bucket, and shard ranges move with the bucket size, so the shards are first all-gathered back
into the whole bucket (param space). A difference names the variant, the first param (in the
model's parameter order) and the lowest rank where it differs, and the largest absolute
difference. It proves reproducibility for the inputs, model, world size and variants given, no
more: other batches, other models or other process-group shapes are not covered, and it never
steps an optimizer. Collective: every rank calls it with the same arguments; the torch RNG is
reseeded with `seed` before each variant and restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups

Batch = Any
LossFn = Callable[[DistributedDataParallel, Batch], Tensor]


class ReproducibilityError(RuntimeError):
    """`verify_reproducible(..., raise_on_difference=True)` found a differing gradient."""


@dataclass(frozen=True)
class VariantResult:
    """One variant against the base config, agreed over every rank."""

    name: str
    changes: dict[str, Any]  # the config fields changed from the base config
    identical: bool  # every param's grad bitwise equal to the base's, on every rank
    param: str | None = None  # first differing param (model order), on `rank`
    rank: int | None = None  # lowest global rank with a difference
    max_abs_diff: float = 0.0  # over every param and rank

    def describe(self) -> str:
        if self.identical:
            return f"{self.name}: bitwise identical"
        return (
            f"{self.name}: differs from the base config at {self.param} on rank {self.rank} "
            f"(largest |difference| {self.max_abs_diff:.3g})"
        )


@dataclass(frozen=True)
class ReproducibilityReport:
    """What `verify_reproducible` found: one `VariantResult` per variant."""

    config: DistributedDataParallelConfig  # the base config
    steps: int
    variants: tuple[VariantResult, ...] = field(default=())

    @property
    def identical(self) -> bool:
        return all(v.identical for v in self.variants)

    def __str__(self) -> str:
        lines = [f"megabuf reproducibility, {self.steps} step(s), against the base config:"]
        return "\n".join(lines + ["  " + v.describe() for v in self.variants])


def default_variants(
    config: DistributedDataParallelConfig, numel: int
) -> dict[str, dict[str, Any]]:
    """A repeat, a small and a one-bucket `bucket_size` (for a model of `numel` trainable
    elements) and `overlap_grad_reduce` flipped."""
    small = max(1, numel // 8)
    overlap = not config.overlap_grad_reduce
    return {
        "repeat": {},
        f"bucket_size={small}": {"bucket_size": small},
        f"bucket_size={numel}": {"bucket_size": numel},
        f"overlap_grad_reduce={overlap}": {"overlap_grad_reduce": overlap},
    }


def verify_reproducible(
    model_factory: Callable[[], nn.Module],
    batch: Batch,
    loss_fn: LossFn,
    config: DistributedDataParallelConfig | None = None,
    *,
    variants: Mapping[str, Mapping[str, Any]] | None = None,
    steps: int = 2,
    process_groups: ProcessGroups | None = None,
    comm_hook: Callable[[], object] | None = None,
    seed: int = 0,
    raise_on_difference: bool = False,
) -> ReproducibilityReport:
    """Check that this model's reduced gradients are bitwise the same under each variant of
    `config` as under `config` itself: see [Note: what verify_reproducible proves]. Call it on
    every rank (e.g. under torchrun), after `init_process_group`.

    `model_factory()` builds a fresh module (the same values on every call); `batch` is this
    rank's batch, or a callable `batch(step)` returning it; `loss_fn(model, batch)` runs the
    forward on the wrapped model and returns the scalar loss (the checker runs backward).
    `variants` maps a name to the config fields it changes (default: `default_variants`);
    `comm_hook()` makes a hook registered on every model (buffers="all"). Returns a
    `ReproducibilityReport` (the same on every rank); with `raise_on_difference`, raises
    `ReproducibilityError` naming the variant, param and rank instead. Memory: one model and
    two copies of its grads at a time."""
    if steps < 1:
        raise ValueError(f"megabuf: verify_reproducible steps must be >= 1, got {steps}")
    config = config if config is not None else DistributedDataParallelConfig()

    def run(cfg: DistributedDataParallelConfig) -> tuple[list[str], list[Tensor]]:
        with torch.random.fork_rng(devices=_cuda_devices()):
            torch.manual_seed(seed)
            model = DistributedDataParallel(model_factory(), cfg, process_groups=process_groups)
            if comm_hook is not None:
                model.register_comm_hook(comm_hook(), buffers="all")
            for step in range(steps):
                model.zero_grad_buffer()
                loss_fn(model, batch(step) if callable(batch) else batch).backward()
                model.finish_grad_sync()
            return _param_space_grads(model)

    names, base = run(config)
    numel = sum(g.numel() for g in base)
    chosen = variants if variants is not None else default_variants(config, numel)
    results = []
    for name, changes in chosen.items():
        _, grads = run(config.replace(**changes))
        results.append(_agree(name, dict(changes), _compare(names, base, grads), Collectives()))
    report = ReproducibilityReport(config, steps, tuple(results))
    if raise_on_difference and not report.identical:
        raise ReproducibilityError(f"megabuf: gradients are not reproducible:\n{report}")
    return report


def _cuda_devices() -> list[int]:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.current_device()]
    return []


def _param_space_grads(model: DistributedDataParallel) -> tuple[list[str], list[Tensor]]:
    """Every trainable param's reduced grad (copies), in the model's parameter order. Under the
    distributed optimizer each bucket's shards are all-gathered into the bucket first."""
    strategy = model.ddp_config.sharding
    if strategy.shards_grads:
        raise RuntimeError(
            f"megabuf: the reproducibility check compares full reduced grads, which "
            f"data_parallel_sharding_strategy={strategy.name!r} does not keep (rank "
            f"{model.engine.rank}); "
            "run it under 'optim' (bitwise equal to 'optim_grads' at one micro-batch)"
        )
    if strategy.reduction == "reduce_scatter":
        for group in model.engine.all_bucket_groups:
            for bucket in group.buckets:
                shard = group.local_shard(bucket.grad_data).clone()
                group.collectives.all_gather(
                    bucket.grad_data, shard, group.collective_group, async_op=False
                ).wait()
    named = list(model.engine.param_to_name.items())
    return [n for _, n in named], [p.main_grad.detach().clone() for p, _ in named]  # type: ignore[attr-defined]


def _compare(names: list[str], base: list[Tensor], other: list[Tensor]) -> tuple[str | None, float]:
    """(first param whose grad differs in its bytes, largest |difference|) on this rank."""
    first, worst = None, 0.0
    for name, a, b in zip(names, base, other, strict=True):
        if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            continue
        first = first if first is not None else name
        worst = max(worst, (a.double() - b.double()).abs().max().item())
    return first, worst


def _agree(
    name: str, changes: dict[str, Any], mine: tuple[str | None, float], collectives: Collectives
) -> VariantResult:
    """Every rank's (first differing param, largest difference) -> one result on every rank."""
    every = [mine]
    if dist.is_initialized() and collectives.size() > 1:
        every = collectives.all_gather_object(mine, None)
    differing = [(rank, param) for rank, (param, _) in enumerate(every) if param is not None]
    worst = max(diff for _, diff in every)
    if not differing:
        return VariantResult(name, changes, True)
    rank, param = differing[0]
    return VariantResult(name, changes, False, param, rank, worst)
