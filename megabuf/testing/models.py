"""Small deterministic models (plain torch.nn) for megabuf's tests, examples and benchmarks.

Every model initialises itself from its own `torch.Generator` seeded with `seed`, inside
`torch.random.fork_rng`, so two processes building the same model with the same seed get bitwise
identical params whatever `torch.manual_seed` was called with, and building a model never
disturbs the caller's global RNG stream.

Typical use::

    model = build_model("gpt_tiny", seed=0)
    x, y = make_batch("gpt_tiny", batch_size=8, seed=step)
    loss = loss_fn("gpt_tiny")(model(x), y)

The word-level text corpus for the GPT example lives in `megabuf.testing.corpus` (re-exported
here as `corpus_tokens` and `lm_batches`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megabuf.testing.corpus import corpus_tokens, lm_batches

__all__ = [
    "GPT",
    "PRESETS",
    "GPTConfig",
    "MLPConfig",
    "MLPStack",
    "ManySmallConfig",
    "ManySmallParams",
    "build_model",
    "corpus_tokens",
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
]

_INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a decoder-only transformer."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    tie_embeddings: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff")
        bad = [name for name in sizes if getattr(self, name) < 1]
        if bad:
            raise ValueError(f"megabuf.testing: GPTConfig fields {bad} must be >= 1")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"megabuf.testing: GPTConfig.d_model={self.d_model} must be divisible by "
                f"n_heads={self.n_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"megabuf.testing: GPTConfig.dropout={self.dropout} not in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Square Linear+GELU stack of width `d`."""

    d: int
    n_layers: int


@dataclass(frozen=True, kw_only=True)
class ManySmallConfig:
    """`n_tensors` small param tensors in a residual chain of width `width`."""

    n_tensors: int = 2000
    width: int = 16


ModelConfig = GPTConfig | MLPConfig | ManySmallConfig


def _seeded_generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        # No qkv bias: the key bias's gradient is exactly zero (softmax ignores a shift shared
        # by all keys), so it would hold pure rounding noise, which Adam's normalisation blows
        # up to lr-sized steps and makes data-parallel vs single-process comparisons flaky.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        # [B, T, 3D] -> three [B, H, T, D/H] views, the layout SDPA expects.
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return F.dropout(self.proj(y.transpose(1, 2).reshape(b, t, d)), p, self.training)


class _Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        h = self.fc_out(F.gelu(self.fc(self.ln2(x))))
        return x + F.dropout(h, self.dropout, self.training)


class GPT(nn.Module):
    """Decoder-only transformer: tokens [B, T] (int64) -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = cfg
        with torch.random.fork_rng(devices=[]):  # default nn init must not touch caller's RNG
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # One Parameter object in two modules: parameters() yields it once, so the engine
            # sees a single param whose grad sums both uses.
            self.lm_head.weight = self.tok_emb.weight
        self._init_weights(_seeded_generator(seed))
        if dtype is not None:
            self.to(dtype)

    @torch.no_grad()
    def _init_weights(self, gen: torch.Generator) -> None:
        # Residual-branch outputs are scaled down with depth so the residual stream's variance
        # stays O(1) at init (GPT-2 practice).
        proj_std = _INIT_STD / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "fc_out.weight")):
                p.normal_(0.0, proj_std, generator=gen)
            elif p.dim() >= 2:
                p.normal_(0.0, _INIT_STD, generator=gen)
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.zero_()

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"megabuf.testing: sequence length {t} exceeds GPTConfig.seq_len "
                f"{self.config.seq_len}"
            )
        pos = torch.arange(t, device=tokens.device)
        h = F.dropout(self.tok_emb(tokens) + self.pos_emb(pos), self.config.dropout, self.training)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy; logits [B, T, V], targets [B, T]. Computed in fp32."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _mse_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.mse_loss(output.float(), target.float())


class MLPStack(nn.Module):
    """`n_layers` square Linear layers of width `d` with GELU between them."""

    def __init__(
        self, d: int, n_layers: int, *, seed: int = 0, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        if d < 1 or n_layers < 1:
            raise ValueError(
                f"megabuf.testing: MLPStack needs d >= 1 and n_layers >= 1; got {d=}, {n_layers=}"
            )
        self.config = MLPConfig(d=d, n_layers=n_layers)
        with torch.random.fork_rng(devices=[]):
            layers = [nn.Linear(d, d) for _ in range(n_layers)]
        self.layers = nn.ModuleList(layers)
        gen = _seeded_generator(seed)
        with torch.no_grad():
            for layer in layers:
                # 1/sqrt(fan_in) keeps activations O(1) through the stack.
                layer.weight.normal_(0.0, 1.0 / math.sqrt(d), generator=gen)
                # Non-zero biases so a test can tell a synced bias from an untouched one.
                layer.bias.normal_(0.0, _INIT_STD, generator=gen)
        if dtype is not None:
            self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x


class ManySmallParams(nn.Module):
    """A residual chain of tiny Linear layers: exactly `n_tensors` param tensors, all used.

    Stresses per-param overheads (hooks, bucket bookkeeping) rather than bandwidth. Each layer
    contributes a [width, width] weight and a [width] bias; an odd `n_tensors` adds one final
    [width] scale vector.
    """

    def __init__(
        self,
        n_tensors: int = 2000,
        width: int = 16,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if n_tensors < 1 or width < 1:
            raise ValueError(
                f"megabuf.testing: ManySmallParams needs n_tensors >= 1 and width >= 1, "
                f"got {n_tensors=}, {width=}"
            )
        self.config = ManySmallConfig(n_tensors=n_tensors, width=width)
        with torch.random.fork_rng(devices=[]):
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(n_tensors // 2))
        self.out_scale = nn.Parameter(torch.empty(width)) if n_tensors % 2 else None
        # Scaling each branch by 1/sqrt(depth) keeps the residual stream (a sum of ~1000
        # bounded tanh terms) and the loss O(1) at any depth.
        self.branch_scale = 1.0 / math.sqrt(max(1, len(self.layers)))
        gen = _seeded_generator(seed)
        with torch.no_grad():
            for p in self.parameters():
                # Biases and the scale are non-zero so every element's sync is observable.
                p.normal_(1.0 if p is self.out_scale else 0.0, _INIT_STD, generator=gen)
        if dtype is not None:
            self.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + self.branch_scale * torch.tanh(layer(x))
        return x * self.out_scale if self.out_scale is not None else x


PRESETS: dict[str, ModelConfig] = {
    "gpt_tiny": GPTConfig(vocab_size=128, seq_len=32, d_model=64, n_layers=2, n_heads=4, d_ff=256),
    "gpt_small": GPTConfig(
        vocab_size=8192, seq_len=128, d_model=384, n_layers=8, n_heads=6, d_ff=1536
    ),
    "gpt_medium": GPTConfig(
        vocab_size=8192, seq_len=256, d_model=512, n_layers=12, n_heads=8, d_ff=2048
    ),
    "mlp_tiny": MLPConfig(d=32, n_layers=3),
    "mlp_34m": MLPConfig(d=2048, n_layers=8),
    "many_small": ManySmallConfig(n_tensors=2000, width=16),
}
"""Named model shapes understood by `build_model`, `make_batch` and `loss_fn`."""


def model_from_config(
    cfg: ModelConfig, *, seed: int = 0, dtype: torch.dtype | None = None
) -> nn.Module:
    """Build the model a config describes, deterministically from `seed`."""
    if isinstance(cfg, GPTConfig):
        return GPT(cfg, seed=seed, dtype=dtype)
    if isinstance(cfg, MLPConfig):
        return MLPStack(cfg.d, cfg.n_layers, seed=seed, dtype=dtype)
    if isinstance(cfg, ManySmallConfig):
        return ManySmallParams(cfg.n_tensors, cfg.width, seed=seed, dtype=dtype)
    raise TypeError(f"megabuf.testing: not a model config: {cfg!r}")


def _preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"megabuf.testing: unknown model {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def build_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build a preset by name ("gpt_tiny", "mlp_34m", "many_small", ...; see `PRESETS`)."""
    return model_from_config(_preset(name), seed=seed, dtype=dtype)


def gpt_tiny(dtype: torch.dtype | None = None, *, seed: int = 0) -> GPT:
    """~0.11M params; for unit tests."""
    return GPT(_gpt_preset("gpt_tiny"), seed=seed, dtype=dtype)


def gpt_small(dtype: torch.dtype | None = None, *, seed: int = 0) -> GPT:
    """~17M params."""
    return GPT(_gpt_preset("gpt_small"), seed=seed, dtype=dtype)


def gpt_medium(dtype: torch.dtype | None = None, *, seed: int = 0) -> GPT:
    """~42M params."""
    return GPT(_gpt_preset("gpt_medium"), seed=seed, dtype=dtype)


def mlp_tiny(dtype: torch.dtype | None = None, *, seed: int = 0) -> MLPStack:
    """~3K params."""
    return MLPStack(32, 3, seed=seed, dtype=dtype)


def mlp_34m(dtype: torch.dtype | None = None, *, seed: int = 0) -> MLPStack:
    """~34M params in 8 layers of 2048x2048 (16 MiB fp32 weights each)."""
    return MLPStack(2048, 8, seed=seed, dtype=dtype)


def many_small(dtype: torch.dtype | None = None, *, seed: int = 0) -> ManySmallParams:
    """2000 param tensors, ~0.3M params."""
    return ManySmallParams(2000, 16, seed=seed, dtype=dtype)


def _gpt_preset(name: str) -> GPTConfig:
    cfg = _preset(name)
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"megabuf.testing: preset {name!r} is not a GPT")
    return cfg


def _config_of(model: str | ModelConfig | nn.Module) -> ModelConfig:
    if isinstance(model, str):
        return _preset(model)
    if isinstance(model, GPTConfig | MLPConfig | ManySmallConfig):
        return model
    cfg = getattr(model, "config", None)
    if isinstance(cfg, GPTConfig | MLPConfig | ManySmallConfig):
        return cfg
    raise TypeError(
        f"megabuf.testing: expected a preset name, a model config or a megabuf.testing model; "
        f"got {type(model).__name__}"
    )


def make_batch(
    model: str | ModelConfig | nn.Module,
    batch_size: int,
    seed: int,
    *,
    dtype: torch.dtype | None = None,
    seq_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Deterministic (inputs, targets) for `model` from a generator seeded with `seed`.

    GPT: random token ids [B, T] and their next tokens. MLP / many-small: standard normal
    inputs and regression targets [B, width] in `dtype` (default: the model's param dtype when
    a model is passed, else fp32).
    """
    if batch_size < 1:
        raise ValueError(f"megabuf.testing: batch_size must be >= 1, got {batch_size}")
    cfg = _config_of(model)
    gen = _seeded_generator(seed)
    if isinstance(cfg, GPTConfig):
        t = cfg.seq_len if seq_len is None else seq_len
        seq = torch.randint(0, cfg.vocab_size, (batch_size, t + 1), generator=gen)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    if dtype is None:
        first = next(model.parameters(), None) if isinstance(model, nn.Module) else None
        dtype = first.dtype if first is not None else torch.float32
    width = cfg.d if isinstance(cfg, MLPConfig) else cfg.width
    x = torch.randn(batch_size, width, generator=gen).to(dtype)
    y = torch.randn(batch_size, width, generator=gen).to(dtype)
    return x, y


def loss_fn(model: str | ModelConfig | nn.Module) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss matching `make_batch` for `model`: cross-entropy for GPT, else MSE (fp32)."""
    return gpt_loss if isinstance(_config_of(model), GPTConfig) else _mse_loss
