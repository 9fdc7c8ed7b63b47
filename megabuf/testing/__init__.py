"""Helpers for megabuf's tests, examples and benchmarks: deterministic models, a text corpus and
a small multi-process launcher. Not needed to use the engine itself."""

from megabuf.testing.corpus import corpus_text, corpus_tokens, decode, lm_batches
from megabuf.testing.launch import spawn
from megabuf.testing.models import (
    GPT,
    PRESETS,
    GPTConfig,
    ManySmallConfig,
    ManySmallParams,
    MLPConfig,
    MLPStack,
    build_model,
    gpt_loss,
    gpt_medium,
    gpt_small,
    gpt_tiny,
    loss_fn,
    make_batch,
    many_small,
    mlp_34m,
    mlp_tiny,
    model_from_config,
)

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "MLPConfig",
    "MLPStack",
    "ManySmallConfig",
    "ManySmallParams",
    "build_model",
    "corpus_text",
    "corpus_tokens",
    "decode",
    "gpt_loss",
    "gpt_medium",
    "gpt_small",
    "gpt_tiny",
    "lm_batches",
    "loss_fn",
    "make_batch",
    "many_small",
    "mlp_34m",
    "mlp_tiny",
    "model_from_config",
    "spawn",
]
