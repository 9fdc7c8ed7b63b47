"""Which optimizer kernel `build_optimizer` uses: a pure choice from the config.

[Note: optimizer implementation]
The math (Adam, AdamW, SGD) is `OptimizerConfig.optimizer`; the kernel that runs it is
`OptimizerConfig.implementation`, chosen explicitly and never substituted:
- "auto": torch's fused kernel (`fused=True`) on CUDA params, torch's multi-tensor kernel
  (`foreach=True`) anywhere else. On CPU, torch's fused Adam/SGD differ from the multi-tensor and
  single-tensor kernels by an ulp here and there, while those two agree bitwise; "auto" keeps CPU
  runs bitwise comparable with a plain `torch.optim.Adam` reference.
- "fused" / "foreach" / "for_loop": torch's three kernels, named as torch's docs name them
  (`fused=True`, `foreach=True`, `foreach=False, fused=False`). "fused" is passed on whatever
  the device: torch 2.13 has fused Adam/AdamW/SGD for CPU and CUDA, and raises itself elsewhere.
- "apex" / "transformer_engine": NVIDIA's multi-tensor FusedAdam / FusedSGD, CUDA only, when
  asked for. Not importable: an ImportError naming the field and the package to install.
All of them keep the same per-param state for the same math, so a checkpoint saved with one
loads into another; see [Note: optimizer state layout].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop", "apex", "transformer_engine")
TORCH_KWARGS: Mapping[str, Mapping[str, bool]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for_loop": {"foreach": False, "fused": False},
}
TORCH_CLASSES = {"adam": "torch.optim.Adam", "adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"}
# package -> (module of its fused optimizers, what to install)
PACKAGES = {
    "apex": ("apex.optimizers", "NVIDIA apex (https://github.com/NVIDIA/apex, built with CUDA)"),
    "transformer_engine": (
        "transformer_engine.pytorch.optimizers",
        "NVIDIA Transformer Engine (pip install transformer_engine[pytorch])",
    ),
}


@dataclass(frozen=True)
class ImplementationChoice:
    """The optimizer class to build (a dotted path; None: the user's own class) and the
    arguments that select its kernel, added to the hyperparameters."""

    class_path: str | None
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def choose_implementation(
    implementation: str, optimizer: str | None, device_type: str, importable: frozenset[str]
) -> ImplementationChoice:
    """`optimizer`: "adam" / "adamw" / "sgd", or None for a user's torch optimizer class;
    `importable`: which of PACKAGES can be imported here. See [Note: optimizer implementation]."""
    if implementation in PACKAGES:
        return _nvidia_choice(implementation, optimizer, device_type, importable)
    if implementation == "auto":
        kwargs = TORCH_KWARGS["fused" if device_type == "cuda" else "foreach"]
        if optimizer is None:  # the user's class keeps its own default kernel
            kwargs = {}
    elif implementation in TORCH_KWARGS:
        kwargs = TORCH_KWARGS[implementation]
    else:
        raise ValueError(
            f"megabuf: OptimizerConfig.implementation={implementation!r} is not one of "
            f"{IMPLEMENTATIONS}"
        )
    class_path = None if optimizer is None else TORCH_CLASSES[optimizer]
    return ImplementationChoice(class_path, dict(kwargs))


def _nvidia_choice(
    implementation: str, optimizer: str | None, device_type: str, importable: frozenset[str]
) -> ImplementationChoice:
    module, install = PACKAGES[implementation]
    if optimizer is None:
        raise ValueError(
            f"megabuf: OptimizerConfig.implementation={implementation!r} picks {module}'s "
            "FusedAdam / FusedSGD; it needs optimizer='adam', 'adamw' or 'sgd', not a class"
        )
    if device_type != "cuda":
        raise ValueError(
            f"megabuf: OptimizerConfig.implementation={implementation!r} runs on CUDA params "
            f"only, and the params are on {device_type}; use 'auto', 'fused' or 'foreach'"
        )
    if implementation not in importable:
        raise ImportError(
            f"megabuf: OptimizerConfig.implementation={implementation!r} needs {module}, which "
            f"is not importable here: install {install}, or use implementation='auto' (torch's "
            "fused kernel on CUDA)"
        )
    if optimizer == "sgd":
        return ImplementationChoice(f"{module}.FusedSGD")
    return ImplementationChoice(f"{module}.FusedAdam", {"adam_w_mode": optimizer == "adamw"})
