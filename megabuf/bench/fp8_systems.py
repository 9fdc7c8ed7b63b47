"""FP8 weights and their peers (issue 42): megabuf and FSDP2, each with a torchao float8 model
and with bf16 params, and what their param all-gathers put on the wire.

[Note: float8 peers]
Four systems train the same model from the same seed on the same data (`FP8_SYSTEMS`):
- `megabuf_fp8`: torchao's float8 training model (`to_float8`: fp32 weights, tensorwise dynamic
  scaling, `enable_fsdp_float8_all_gather=True`) wrapped by `megabuf.DistributedDataParallel`
  under a sharding strategy (optim / optim_grads / optim_grads_params), exactly as a user would
  (the contract of megabuf's FP8 param kind). Before that kind is in the build, megabuf stores and
  gathers these weights at full width (4 bytes per element): the row says so, and needs no
  change when the kind lands (it is measured, not assumed);
- `megabuf_bf16`: the same model in bf16 (`module.to(bfloat16)`) under the same strategy, with
  megabuf's distributed optimizer keeping fp32 main params (2 bytes per gathered element);
- `fsdp2_fp8`: `fully_shard` (each transformer block a unit, then the root; resharded after
  forward) around the same float8 model, `precompute_float8_dynamic_scale_for_fsdp` after every
  optimizer step (one amax all-reduce for all float8 weights): float8 weights are gathered at
  1 byte per element, the other params (embeddings, norms) at fp32;
- `fsdp2_bf16`: the same `fully_shard` around the fp32 model with
  `MixedPrecisionPolicy(param_dtype=bfloat16)`: every param gathered (and reduced) in bf16.
`lm_head` is left in high precision by `float8_filter`: in the demo GPT it is tied to the token
embedding, and `convert_to_float8_training` would replace the shared Parameter by a new one
(untying them: another model).

Bytes on the wire are counted, not computed: megabuf's from its own collective records
(`Collectives.stats`, op "all_gather": the ring figure (n-1) x the shard each rank hands over,
[Note: wire accounting by group]); FSDP2's by `GatherCounter`, a wrapper this module puts around
`torch.distributed.all_gather_single` (the call FSDP2's default all-gather makes) on the bench's
ranks only, counting the same ring figure from each call's input tensor (element size x numel).
`param_gather_formula_nbytes` is the figure these counts must equal for FSDP2.

Everything here imports without torchao; `torchao_unavailable_reason` says why the float8 rows
cannot run, and the callers skip them with that reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megabuf.bench.systems import MEGABUF_CONFIGS, Engine, NotAvailable
from megabuf.config import DistributedDataParallelConfig
from megabuf.ddp import DistributedDataParallel
from megabuf.transport.process_groups import ProcessGroups

FP8_SYSTEMS: tuple[str, ...] = ("megabuf_bf16", "megabuf_fp8", "fsdp2_bf16", "fsdp2_fp8")
STRATEGY_SYSTEMS: dict[str, str] = {  # the megabuf bench config (systems.py) of each strategy
    "optim": "megabuf_distopt_overlap",
    "optim_grads": "megabuf_zero2",
    "optim_grads_params": "megabuf_zero3",
}
FLOAT8_MULTIPLE = 16  # torchao's float8 matmul needs both dims of a weight divisible by this
EXCLUDED_FQNS = ("lm_head",)  # tied to the token embedding in the demo GPT (see the Note)


def torchao_unavailable_reason() -> str | None:
    """Why torchao's float8 training cannot run here, or None when it can."""
    try:
        importlib.import_module("torchao.float8")
    except Exception as exc:  # ImportError, or a broken install raising anything
        return (
            f"torchao.float8 does not import ({type(exc).__name__}: {exc}); "
            "pip install 'megabuf[fp8]' (torchao==0.18.0)"
        )
    return None


def float8_filter(module: nn.Module, fqn: str) -> bool:
    """Which Linears `to_float8` converts: every one with both dims a multiple of 16, except
    `EXCLUDED_FQNS` ([Note: float8 peers])."""
    if fqn in EXCLUDED_FQNS or not isinstance(module, nn.Linear):
        return False
    return module.in_features % FLOAT8_MULTIPLE == 0 and module.out_features % FLOAT8_MULTIPLE == 0


def to_float8(module: nn.Module) -> nn.Module:
    """`module` with its Linears converted in place to torchao's float8 training (tensorwise
    dynamic scaling, float8 all-gather enabled); raises NotAvailable without torchao."""
    reason = torchao_unavailable_reason()
    if reason is not None:
        raise NotAvailable(reason)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(module, module_filter_fn=float8_filter, config=config)
    return module


def is_float8_weight(param: Any) -> bool:
    """True for a weight torchao's float8 all-gather casts (also inside an FSDP2 DTensor)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    return type(local).__name__ == "WeightWithDynamicFloat8CastTensor"


@dataclass
class GatherCount:
    """Param all-gathers one rank issued: calls, ring bytes ((n-1) x its input) and the bytes
    of the gathered outputs."""

    calls: int = 0
    ring_nbytes: int = 0
    gathered_nbytes: int = 0

    def add(self, other: GatherCount) -> None:
        self.calls += other.calls
        self.ring_nbytes += other.ring_nbytes
        self.gathered_nbytes += other.gathered_nbytes


class GatherCounter:
    """Counts `torch.distributed.all_gather_single` calls while `installed()`: the bench's
    wrapper around FSDP2's all-gather ([Note: float8 peers]); never used by library code."""

    def __init__(self) -> None:
        self.count = GatherCount()

    def take(self) -> GatherCount:
        """What was counted since the last take, and start again from zero."""
        out, self.count = self.count, GatherCount()
        return out

    def _wrap(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            size = dist.get_world_size(kwargs.get("group", args[0] if args else None))
            self.count.calls += 1
            self.count.ring_nbytes += (size - 1) * input.numel() * input.element_size()
            self.count.gathered_nbytes += output.numel() * output.element_size()
            return inner(output, input, *args, **kwargs)

        return counted

    @contextmanager
    def installed(self) -> Iterator[GatherCounter]:
        inner = dist.all_gather_single
        dist.all_gather_single = self._wrap(inner)  # type: ignore[assignment]
        try:
            yield self
        finally:
            dist.all_gather_single = inner  # type: ignore[assignment]


def _blocks(module: nn.Module) -> list[nn.Module]:
    blocks = getattr(module, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def build_fsdp2(module: nn.Module, pgs: ProcessGroups, *, float8: bool) -> Engine:
    """`fsdp2_fp8` or `fsdp2_bf16` around `module` (fp32), AdamW as the other bench systems."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from megabuf.bench.settings import OPTIMIZER_KWARGS

    if float8:
        to_float8(module)
    policy = MixedPrecisionPolicy() if float8 else MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mesh = DeviceMesh.from_group(pgs.dp, next(module.parameters()).device.type)
    for block in _blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(module.parameters(), **OPTIMIZER_KWARGS)  # type: ignore[arg-type]
    after_step: Callable[[], None] = lambda: None  # noqa: E731
    if float8:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        def after_step() -> None:
            precompute_float8_dynamic_scale_for_fsdp(module)

    engine = Engine(module, module, opt, 0, opt.zero_grad, after_step=after_step)
    engine.notes.append(f"{len(_blocks(module))} FSDP units + root, reshard after forward")
    return engine


def build_megabuf_precision(
    module: nn.Module, pgs: ProcessGroups, *, float8: bool, strategy: str
) -> Engine:
    """`megabuf_fp8` or `megabuf_bf16` under sharding `strategy` (a key of STRATEGY_SYSTEMS)."""
    if strategy not in STRATEGY_SYSTEMS:
        raise ValueError(
            f"megabuf.bench: strategy {strategy!r} has no FP8 row; known: {list(STRATEGY_SYSTEMS)}"
        )
    from megabuf.bench.settings import OPTIMIZER_KWARGS
    from megabuf.optimizer import OptimizerConfig, build_optimizer

    module = to_float8(module) if float8 else module.to(torch.bfloat16)
    config = DistributedDataParallelConfig(**MEGABUF_CONFIGS[STRATEGY_SYSTEMS[strategy]])
    model = DistributedDataParallel(module, config, process_groups=pgs)
    opt = build_optimizer(model, OptimizerConfig(
        optimizer="adamw", lr=OPTIMIZER_KWARGS["lr"], weight_decay=OPTIMIZER_KWARGS["weight_decay"],
        adam_eps=OPTIMIZER_KWARGS["eps"], bf16=not float8,  # bf16: fp32 main params
    ))  # fmt: skip
    return Engine(
        model, module, opt, 0, opt.zero_grad, model.finish_grad_sync,
        publish=model.publish_params, collectives=model.engine.collectives, ddp=model,
    )  # fmt: skip


def build_fp8_system(name: str, module: nn.Module, pgs: ProcessGroups, strategy: str) -> Engine:
    """System `name` (one of FP8_SYSTEMS) around the fp32 `module`; `strategy` for megabuf."""
    if name not in FP8_SYSTEMS:
        raise ValueError(f"megabuf.bench: unknown FP8 system {name!r}; known: {FP8_SYSTEMS}")
    float8 = name.endswith("_fp8")
    if name.startswith("fsdp2"):
        return build_fsdp2(module, pgs, float8=float8)
    return build_megabuf_precision(module, pgs, float8=float8, strategy=strategy)


def megabuf_gather_count(engine: Engine) -> GatherCount:
    """What megabuf's collective layer counted for op "all_gather" since its last reset."""
    if engine.collectives is None:
        return GatherCount()
    stats = engine.collectives.stats
    return GatherCount(
        calls=stats.calls.get("all_gather", 0),
        ring_nbytes=stats.ring_nbytes.get("all_gather", 0),
        gathered_nbytes=stats.output_nbytes.get("all_gather", 0),
    )


def wire_element_nbytes(param: Any, float8: bool, param_dtype: torch.dtype | None) -> int:
    """Bytes one element of `param` takes in FSDP2's all-gather: 1 for a float8 weight with the
    float8 all-gather, else the element size of `param_dtype` (the policy's) or of the param."""
    if float8 and is_float8_weight(param):
        return 1
    dtype = param_dtype if param_dtype is not None else param.dtype
    return torch.empty((), dtype=dtype).element_size()


def param_gather_formula_nbytes(
    module: nn.Module, dp_size: int, *, float8: bool, param_dtype: torch.dtype | None = None
) -> int:
    """FSDP2's param all-gather ring bytes per step for `module` (wrapped by `build_fsdp2`):
    (dp-1)/dp of every param once in forward, and of every block's params again in backward
    (resharded after forward; the root is not), dim 0 of each padded to a multiple of dp as
    FSDP2 shards it."""

    def nbytes(params: Any) -> int:
        return sum(
            _padded_numel(p, dp_size) * wire_element_nbytes(p, float8, param_dtype) for p in params
        )

    again = sum(nbytes(b.parameters()) for b in _blocks(module))
    return (dp_size - 1) * (nbytes(module.parameters()) + again) // dp_size


def _padded_numel(param: Any, dp_size: int) -> int:
    if param.dim() == 0:
        return dp_size
    rows = -(-param.shape[0] // dp_size) * dp_size
    return rows * (param.numel() // param.shape[0])
