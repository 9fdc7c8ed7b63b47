"""`OptimizerConfig`: what `megabuf.build_optimizer` builds, in one keyword-only dataclass.

Loaded from the `[optimizer]` table of a TOML file (`from_toml`) or a plain dict (`from_dict`);
contradictions are rejected at construction with a ValueError naming the fields involved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megabuf.optimizer.implementation import IMPLEMENTATIONS
from megabuf.pure.config_fields import dataclass_from_dict, dataclass_from_toml, document_fields

OPTIMIZER_NAMES = ("adam", "adamw", "sgd", "muon")
MUON_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


@document_fields
@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Configuration of the optimizer megabuf builds around DDP model chunks."""

    optimizer: str | type[torch.optim.Optimizer] = "adam"
    """"adam" (torch.optim.Adam: L2 weight decay added to the grad), "adamw" (torch.optim.AdamW:
    decoupled weight decay), "sgd" (torch.optim.SGD with `sgd_momentum`), "muon"
    (`megabuf.optimizer.MuonAdamW`: torch.optim.Muon for 2-D weights, AdamW with `lr` and the
    Adam fields for embeddings, norms and biases; [Note: matrix optimizers]; the distributed
    optimizer needs `whole_param_owners`), or any pointwise torch optimizer class (built with
    `lr` and `weight_decay` only)."""

    implementation: str = "auto"
    """Which kernel runs the optimizer, never substituted ([Note: optimizer implementation]):
    "auto" (torch `fused=True` on CUDA params, `foreach=True` elsewhere), "fused", "foreach",
    "for_loop" (torch's three kernels, under the names torch's docs give them), "apex" or
    "transformer_engine" (NVIDIA's FusedAdam / FusedSGD on CUDA; an ImportError naming the
    package when it is not installed). A user's optimizer class gets `fused` / `foreach` passed
    through, and its own default under "auto". Checkpoints move between implementations."""

    lr: float = 1e-3
    """Learning rate of every param group."""

    weight_decay: float = 0.0
    """Weight decay, with the chosen torch optimizer's semantics."""

    adam_beta1: float = 0.9
    """Adam/AdamW first-moment decay."""

    adam_beta2: float = 0.999
    """Adam/AdamW second-moment decay."""

    adam_eps: float = 1e-8
    """Adam/AdamW denominator epsilon."""

    sgd_momentum: float = 0.9
    """SGD momentum (0 = plain SGD, which keeps no state)."""

    muon_lr: float | None = None
    """optimizer="muon": learning rate of the Muon group (None: `lr`); Muon commonly runs ~0.02
    with AdamW's lr ~3e-4 for the rest."""

    muon_momentum: float = 0.95
    """optimizer="muon": Muon's momentum (Nesterov)."""

    muon_ns_steps: int = 5
    """optimizer="muon": Newton-Schulz iterations per step."""

    muon_adjust_lr_fn: str | None = None
    """optimizer="muon": torch.optim.Muon's `adjust_lr_fn` (None, "original" or
    "match_rms_adamw"; another value raises, as torch.optim.Muon does)."""

    clip_grad: float = 0.0
    """Clip by the global grad norm (over dense and expert params of all ranks) to this value;
    0 = off. The norm is computed and returned by `step()` either way."""

    fp16: bool = False
    """Params are fp16: a grad scaler is required (dynamic unless `loss_scale` is set)."""

    bf16: bool = False
    """Params are bf16: fp32 main params, no grad scaler needed."""

    loss_scale: float | None = None
    """Constant loss scale. None: dynamic scaling when `fp16`, no scaling otherwise."""

    initial_loss_scale: float = 2.0**32
    """Dynamic scaling: the first scale."""

    min_loss_scale: float = 1.0
    """Dynamic scaling: the scale never drops below this."""

    loss_scale_window: int = 1000
    """Dynamic scaling: grow the scale after this many consecutive steps without inf/NaN."""

    hysteresis: int = 2
    """Dynamic scaling: back off only after this many (not necessarily consecutive) inf steps."""

    growth_factor: float = 2.0
    """Dynamic scaling: multiply the scale by this when growing."""

    backoff_factor: float = 0.5
    """Dynamic scaling: multiply the scale by this when backing off."""

    log_num_zeros_in_grad: bool = False
    """Count zero grad elements (over all ranks) and return the count from `step()`."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZER_NAMES:
            raise ValueError(
                f"megabuf: OptimizerConfig.optimizer={self.optimizer!r} is not one of "
                f"{OPTIMIZER_NAMES}; pass a name or a torch.optim.Optimizer subclass"
            )
        if not isinstance(self.optimizer, str) and not (
            isinstance(self.optimizer, type) and issubclass(self.optimizer, torch.optim.Optimizer)
        ):
            raise ValueError(
                f"megabuf: OptimizerConfig.optimizer={self.optimizer!r} is neither a name nor a "
                "torch.optim.Optimizer subclass"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"megabuf: OptimizerConfig.implementation={self.implementation!r} is not one of "
                f"{IMPLEMENTATIONS}"
            )
        if self.optimizer == "muon" and self.implementation != "auto":
            raise ValueError(
                f"megabuf: OptimizerConfig.implementation={self.implementation!r} does not apply "
                "to optimizer='muon' (torch.optim.Muon has one kernel); leave it at 'auto'"
            )
        if self.muon_adjust_lr_fn not in MUON_ADJUST_LR_FNS:
            raise ValueError(
                f"megabuf: OptimizerConfig.muon_adjust_lr_fn={self.muon_adjust_lr_fn!r} is not one "
                f"of {MUON_ADJUST_LR_FNS} (torch.optim.Muon's adjust_lr_fn)"
            )
        if self.fp16 and self.bf16:
            raise ValueError("megabuf: OptimizerConfig.fp16 and bf16 are both True; pick one")
        self._check_positive()

    def _check_positive(self) -> None:
        for name in ("lr", "initial_loss_scale", "min_loss_scale", "growth_factor"):
            if getattr(self, name) <= 0:
                raise ValueError(f"megabuf: OptimizerConfig.{name} must be > 0")
        if self.clip_grad < 0:
            raise ValueError(f"megabuf: OptimizerConfig.clip_grad={self.clip_grad} must be >= 0")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise ValueError(f"megabuf: OptimizerConfig.loss_scale={self.loss_scale} must be > 0")
        if not 0 < self.backoff_factor < 1:
            raise ValueError("megabuf: OptimizerConfig.backoff_factor must be in (0, 1)")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(
                "megabuf: OptimizerConfig.loss_scale_window and hysteresis must be >= 1"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> OptimizerConfig:
        """Build from a mapping; unknown keys raise a ValueError listing the valid fields."""
        return dataclass_from_dict(cls, values)

    @classmethod
    def from_toml(cls, path: str | Path) -> OptimizerConfig:
        """Load the `[optimizer]` table of a TOML file (defaults if the table is absent)."""
        return dataclass_from_toml(cls, path, "optimizer", top_level_fallback=False)

    def replace(self, **changes: Any) -> OptimizerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)
