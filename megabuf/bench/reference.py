"""The single-process step every system is checked against: one AdamW step on the global batch.

Each rank's batch is `rank_batch(model, batch_per_rank, rank)`; the global batch is their
concatenation in rank order, so with mean losses over equal-sized slices, averaged data-parallel
grads equal the single-process grads up to rounding. The reference keeps a deterministic sample
of each param's values after the step (all of a small param, 4096 elements of a large one), which
is cheap to ship to the ranks and to compare against.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.testing.models import (
    PRESETS,
    GPTConfig,
    ModelConfig,
    loss_fn,
    make_batch,
    model_from_config,
)

SAMPLE_NUMEL = 4096


@dataclass(frozen=True)
class Reference:
    """Sampled params of `model` after one single-process step on the global batch."""

    model: str
    samples: dict[str, tuple[Tensor, Tensor]]  # name -> (flat indices int64, values fp32)


def bench_model(model: str, overrides: Mapping[str, int] | None = None) -> ModelConfig:
    """The shape of preset `model`, with GPTConfig fields from `overrides` if it is a GPT (the
    `--gpt-width/--gpt-depth/--gpt-seq-len` flags; other models ignore them)."""
    if model not in PRESETS:
        raise ValueError(f"megabuf.bench: unknown model {model!r}; known: {sorted(PRESETS)}")
    cfg = PRESETS[model]
    if overrides and isinstance(cfg, GPTConfig):
        return dataclasses.replace(cfg, **dict(overrides))  # type: ignore[arg-type]
    return cfg


def tokens_per_sample(cfg: ModelConfig) -> int | None:
    """Tokens in one sample of a GPT batch (its seq_len); None for other models."""
    return cfg.seq_len if isinstance(cfg, GPTConfig) else None


def rank_batch(model: str | ModelConfig, batch_per_rank: int, rank: int) -> tuple[Tensor, Tensor]:
    """The batch rank `rank` trains on (the same every step: the benchmark times compute)."""
    return make_batch(model, batch_per_rank, seed=1000 + rank)


def sample_indices(name: str, numel: int) -> Tensor:
    if numel <= SAMPLE_NUMEL:
        return torch.arange(numel)
    gen = torch.Generator().manual_seed(sum(name.encode()) + numel)
    return torch.randint(0, numel, (SAMPLE_NUMEL,), generator=gen)


def compute_reference(
    model: str, batch_per_rank: int, world_size: int, overrides: Mapping[str, int] | None = None
) -> Reference:
    cfg = bench_model(model, overrides)
    module = model_from_config(cfg, seed=0)
    batches = [rank_batch(cfg, batch_per_rank, r) for r in range(world_size)]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    optimizer = torch.optim.AdamW(module.parameters(), **OPTIMIZER_KWARGS)  # type: ignore[arg-type]
    loss_fn(cfg)(module(x), y).backward()
    optimizer.step()
    samples = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            idx = sample_indices(name, p.numel())
            samples[name] = (idx, p.detach().reshape(-1)[idx].float().clone())
    return Reference(model, samples)


def max_error(reference: Reference, params: Iterable[tuple[str, Tensor]]) -> float:
    """Largest |param - reference| over the sampled elements; raises on a missing param."""
    seen: set[str] = set()
    worst = 0.0
    for name, full in params:
        if name not in reference.samples:
            raise ValueError(f"megabuf.bench: param {name} is not in the reference model")
        idx, values = reference.samples[name]
        got = full.detach().reshape(-1)[idx].float()
        worst = max(worst, float((got - values).abs().max()))
        seen.add(name)
    missing = sorted(set(reference.samples) - seen)
    if missing:
        raise ValueError(f"megabuf.bench: params {missing[:5]} were not checked")
    return worst
