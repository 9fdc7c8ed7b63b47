"""`MegabufOptimizer`: the step contract shared by the distributed and non-distributed optimizers.

[Note: optimizer step]
`step()` returns `StepResult(update_successful, grad_norm, num_zeros_in_grad)` (a NamedTuple, so
`ok, grad_norm, num_zeros = opt.step()` works):
0. it refuses grads that are not this iteration's reduced grads: every bucket group of every model
   chunk must be SYNCED, i.e. backward ran and then `model.finish_grad_sync()` (or
   `finalize_model_grads`). After `zero_grad()` the buffer is zeroed lazily and still holds the
   last step's grads, and after backward without a finish it holds unreduced or in-flight grads;
   either would be applied silently. Then main params of model params edited in place since the
   last step are re-read (see [Note: main params follow the model params]);
1. point every main param's grad at its reduced grad (fp32 copy if the grad is bf16/fp16);
2. with a grad scaler: unscale, and take the inf/NaN flag's max over all ranks; on inf the scaler
   backs off and the step is skipped on every rank -> (False, None, None). When the scale
   changes, every model chunk's comm hooks hear the ratio
   (`notify_comm_hooks_loss_scale_changed`); on every skipped step (here or in 3) they hear
   that it was skipped (`notify_comm_hooks_step_skipped`);
3. the global grad norm over dense and expert grads (see [Note: global grad norm]). If it is not
   finite (inf/NaN grads without a grad scaler: bf16 or fp32 training) the step is skipped on
   every rank -> (False, grad_norm, None). The norm is summed over every group across which the
   grads differ, so every rank holds the same value and takes the same branch. A skipped step
   leaves params and optimizer state untouched and releases the fp32 grad copies. Otherwise clip
   to `clip_grad` if > 0;
4. step every inner optimizer (one for dense, one for expert params), copy updated fp32 main
   params back into the model's memory, and let the subclass publish them (the distributed
   optimizer marks params stale and all-gathers them, now or in the next forward).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.algorithms.join import Joinable, JoinHook

from megabuf.buckets.bucket_group import GradSyncState
from megabuf.core.join import attach_optimizer, optimizer_join_hook, sync_hyperparameters
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.clip import NormPart, clip_grads_, count_zeros, global_grad_norm
from megabuf.optimizer.exact_norm import exact_grad_norm
from megabuf.optimizer.grad_scaler import GradScaler
from megabuf.optimizer.grad_upcast import (
    DEFAULT_WINDOW_NUMEL,
    WINDOWED_OPTIMIZERS,
    is_half_grad,
    step_in_windows,
)
from megabuf.optimizer.main_params import MainParam, write_back_all
from megabuf.optimizer.memory import OptimizerMemoryReport, memory_report
from megabuf.optimizer.model_space import common_state, load_model_space_state, owned_pieces
from megabuf.optimizer.muon import check_matrix_groups
from megabuf.optimizer.param_groups import (
    ParamGroupsArg,
    as_chunks,
    model_space_keys,
    resolve_param_groups,
)
from megabuf.optimizer.param_versions import ModelParamVersions
from megabuf.optimizer.records import (
    DOMAIN_KINDS,
    Domain,
    DomainKind,
    OptimizerParts,
    StepResult,
)
from megabuf.transport.devices import params_device
from megabuf.verify.step_checks import StepChecks

logger = logging.getLogger(__name__)
_UNSYNCED = {
    GradSyncState.IDLE: "no reduction since zero_grad(), so the buffer holds the last step's "
    "grads (it is zeroed lazily) or this backward's unreduced ones",
    GradSyncState.DISPATCHED: "its reduction is still in flight",
}


class MegabufOptimizer(torch.optim.Optimizer, Joinable):
    """Base class; subclasses decide which main params a rank owns and how params are published.

    It is a `torch.optim.Optimizer` for `isinstance` checks, so `torch.optim.lr_scheduler.*`
    accept it: `param_groups` are the inner optimizers' own group dicts (dense groups, then
    expert groups), so one scheduler drives both, and `defaults` are the first inner
    optimizer's. torch's Optimizer constructor does not run: megabuf's `step()` contract,
    `zero_grad()` and model-space `state_dict()` replace torch's.
    """

    sharded = False  # main params are shards of the buffers (memory_report counts shard padding)
    # sharded, no grad scaler: bf16/fp16 grads are upcast this many elements at a time
    grad_upcast_window_numel: int | None = DEFAULT_WINDOW_NUMEL  # None: one full copy
    # torch.amp.GradScaler then hands itself to step() instead of unscaling grads it cannot see
    # (fp32 main-param copies get their grads inside step()): step() refuses it by name.
    _step_supports_amp_scaling = True

    def __init__(
        self,
        model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
        optimizer_cls: type[torch.optim.Optimizer],
        param_groups: ParamGroupsArg = None,
        *,
        clip_grad: float = 0.0,
        grad_scaler: GradScaler | None = None,
        log_num_zeros_in_grad: bool = False,
        **optimizer_kwargs: Any,
    ) -> None:
        self.model_chunks = as_chunks(model_chunks)
        self._check_chunks(self.model_chunks)
        self.collectives = self.model_chunks[0].engine.collectives
        self.process_groups = self.model_chunks[0].process_groups
        self.optimizer_cls = optimizer_cls
        self.clip_grad = clip_grad
        self.grad_scaler = grad_scaler
        self.log_num_zeros_in_grad = log_num_zeros_in_grad
        # flags, norms and the loss scale live here ([Note: allocation device])
        self.device = params_device(self.model_params(), None)
        self.keys = model_space_keys(self.model_chunks)
        self._hparams, self._group_of = resolve_param_groups(self.model_chunks, param_groups)
        check_matrix_groups(  # every rank sees every param: all raise alike
            optimizer_cls, self._hparams, self._group_of, self.keys, self._whole_params()
        )
        self._optimizer_kwargs = optimizer_kwargs
        self.domains: list[Domain] = self._build_domains()
        self._norm_kinds = self._model_wide_kinds()
        self.step_checks = StepChecks(self.model_chunks, self.collectives, self.process_groups,
                                      self.device)  # [Note: verify mode]  # fmt: skip
        self._copied_grads = False
        self._completed_steps = 0  # updates applied (skipped steps excluded): weight version
        self._versions = ModelParamVersions(self.main_params)
        # what torch's schedulers read besides param_groups (OneCycleLR: momentum / betas)
        self.defaults: dict[str, Any] = (
            dict(self.domains[0].optimizer.defaults) if self.domains else {}
        )
        Joinable.__init__(self)  # [Note: uneven inputs] in megabuf/core/join.py
        attach_optimizer(self.model_chunks, self)

    def _model_wide_kinds(self) -> tuple[DomainKind, ...]:
        """Kinds present on *any* rank. Every rank must join every norm reduction, even a
        pipeline stage without expert params, or the stages that have them wait forever. The max
        runs over pp, then dp: the model's pp x dp grid, not the world (ranks outside the model,
        e.g. inference workers receiving its weights, take no part)."""
        mine = {d.kind for d in self.domains}
        flags = torch.tensor([float(k in mine) for k in DOMAIN_KINDS], device=self.device)
        pgs = self.process_groups
        for group, size in ((pgs.pp, pgs.pp_size), (pgs.dp, pgs.dp_size)):
            if size > 1:
                self.collectives.all_reduce_max(flags, group)
        return tuple(k for k, f in zip(DOMAIN_KINDS, flags.tolist(), strict=True) if f > 0)

    # ---- subclass hooks -----------------------------------------------------------------------
    def _check_chunks(self, chunks: Sequence[DistributedDataParallel]) -> None:
        """Reject model chunks this optimizer cannot step (before anything is built)."""

    def _build_main_params(self, kind: DomainKind) -> list[MainParam] | None:
        """This rank's main params of `kind`, or None if the model has no such params."""
        raise NotImplementedError

    def _norm_groups(self, kind: DomainKind) -> tuple[ProcessGroup, ...]:
        raise NotImplementedError

    def _whole_params(self) -> bool:
        """Every main param is a whole param ([Note: matrix optimizers])."""
        return not self.sharded

    def _before_step(self) -> None:
        """Called once the grads are known to be reduced, before anything reads them."""

    def _before_update(self) -> None:
        """Called right before main params change (e.g. finish in-flight param gathers)."""

    def _after_update(self) -> None:
        """Called after updated values were copied into the model's memory."""

    # ---- construction helpers -----------------------------------------------------------------
    def _build_domains(self) -> list[Domain]:
        """Main params and inner optimizers on the model chunks' current buffers (again after a
        sharded re-plan: [Note: sharded auto bucket re-plan] in
        megabuf/replan/sharded_replan.py)."""
        domains = []
        for kind in DOMAIN_KINDS:
            mains = self._build_main_params(kind)
            if mains is not None:
                inner = self._make_inner(mains, self._optimizer_kwargs)
                domains.append(Domain(kind, mains, inner, self._norm_groups(kind)))
        return domains

    def _make_inner(
        self, mains: list[MainParam], optimizer_kwargs: dict[str, Any]
    ) -> torch.optim.Optimizer:
        groups: list[dict[str, Any]] = [{**hp, "params": []} for hp in self._hparams]
        for mp in mains:
            groups[self._group_of[mp.model_param]]["params"].append(mp.main)
        return self.optimizer_cls(groups, **optimizer_kwargs)

    # ---- the step -----------------------------------------------------------------------------
    @property
    def main_params(self) -> list[MainParam]:
        return [mp for d in self.domains for mp in d.main_params]

    @torch.no_grad()
    def step(self, closure: None = None, *, grad_scaler: Any = None) -> StepResult:  # type: ignore[override]
        """See [Note: optimizer step]. `closure` exists for torch's signature; it must be None
        (the loss comes from the training loop, the grads from the buffers). `grad_scaler` is
        what `torch.amp.GradScaler.step(opt)` passes: refused, see the error."""
        if closure is not None:
            raise ValueError("megabuf: optimizer.step() takes no closure; run backward first")
        if grad_scaler is not None:
            raise ValueError(
                "megabuf: torch.amp.GradScaler cannot drive a megabuf optimizer: its fp32 main "
                "params get their grads inside step(), so the scaler would step on scaled grads. "
                "Use megabuf's loss scaling: OptimizerConfig(fp16=True) (dynamic) or "
                "loss_scale=..., with opt.scale_loss(loss).backward() and opt.step()"
            )
        self._check_resident("optimizer step()")
        with torch.profiler.record_function("megabuf::optimizer_step"):
            self._check_grads_synced()
            sync_hyperparameters(self, self.model_chunks)  # [Note: uneven inputs]
            self._before_step()
            self._versions.reload_edited()
            lazy = self._upcast_window_numel() is not None
            attach = [mp for mp in self.main_params if not (lazy and is_half_grad(mp))]
            self._copied_grads = any([mp.attach_grad() for mp in attach])
            grads = [mp.main.grad for mp in self.main_params if mp.main.grad is not None]
            if self._scaler_found_inf(grads):
                return self._skip(None)
            parts = self._norm_parts()
            exact = any(c.ddp_config.deterministic_reduction for c in self.model_chunks)
            norm_fn = exact_grad_norm if exact else global_grad_norm  # [Note: exact grad norm]
            grad_norm = norm_fn(parts, self.collectives, device=self.device)
            if not math.isfinite(grad_norm):  # the same value on every rank
                return self._skip(grad_norm)
            part_norm = lambda i: norm_fn([parts[i]], self.collectives, device=self.device)  # noqa: E731
            if self.step_checks.skip(grad_norm, self._norm_kinds, self.domains, part_norm):
                return self._skip(grad_norm)  # spike guards ([Note: verify mode])
            coef = 1.0  # applied to attached grads here, to upcast windows as they are made
            if self.clip_grad > 0.0:
                coef = clip_grads_(grads, self.clip_grad, grad_norm)
            num_zeros = None
            if self.log_num_zeros_in_grad:
                num_zeros = count_zeros(parts, self.collectives, device=self.device)
            self._update(coef)
            return StepResult(True, grad_norm, num_zeros)

    def _upcast_window_numel(self) -> int | None:
        """Window of the half-precision grads' upcast, or None when every such grad gets its
        fp32 copy at attach time; see [Note: bf16 grads without an fp32 copy]."""
        if not self.sharded or self.grad_scaler is not None:
            return None
        if not all(type(d.optimizer) in WINDOWED_OPTIMIZERS for d in self.domains):
            return None  # other classes may keep per-group state (apex's step): one full copy
        return self.grad_upcast_window_numel

    def _update(self, coef: float) -> None:
        """Step the inner optimizers and publish the new values into the model's memory
        (`coef`: the clip factor, for grads upcast during the step)."""
        self._before_update()
        window = self._upcast_window_numel()
        with torch.profiler.record_function("megabuf::inner_step"):
            if window is not None:
                domains = [(d.optimizer, d.main_params) for d in self.domains]
                step_in_windows(domains, self.main_params, window, coef)
            else:
                for domain in self.domains:
                    domain.optimizer.step()
        with torch.profiler.record_function("megabuf::copy_main_to_model"):
            write_back_all(self.main_params)
        self._versions.record()  # the write-back moves no version; record anyway
        self._release_grads()
        self._completed_steps += 1
        self._after_update()

    def _skip(self, grad_norm: float | None) -> StepResult:
        """Skip the step on this rank (every rank decides alike): nothing changes, and the comm
        hooks forget what they kept of the skipped grads."""
        self._release_grads()
        for chunk in self.model_chunks:
            chunk.engine.hooks.notify_comm_hooks_step_skipped()
        if grad_norm is not None and self.process_groups.topology.rank == 0:  # routine skips
            logger.warning("megabuf: step skipped on every rank: global grad norm is %s", grad_norm)
        return StepResult(False, grad_norm, None)

    def _check_resident(self, entry: str) -> None:
        """[Note: offloaded engine] in megabuf/sync/residency.py."""
        for chunk in self.model_chunks:
            chunk.engine.check_resident(entry)

    def _check_grads_synced(self) -> None:
        """See [Note: optimizer step], point 0."""
        for i, chunk in enumerate(self.model_chunks):
            group = chunk.engine.sync.unsynced_group()
            if group is not None:
                names = [group.param_to_name.get(p, "?") for p in group.params_list[:3]]
                raise RuntimeError(
                    f"megabuf: optimizer step() on rank {chunk.engine.rank}: model chunk {i}, "
                    f"bucket group {group.group_id} (params {', '.join(names)}, ...) has grad "
                    f"sync {group.grad_state.name}, not SYNCED: {_UNSYNCED[group.grad_state]}. "
                    "Run backward, then model.finish_grad_sync() (or "
                    "megabuf.finalize_model_grads(model_chunks)), then step()"
                )

    def _scaler_found_inf(self, grads: list[torch.Tensor]) -> bool:
        """With a grad scaler: unscale grads, agree on inf/NaN over all ranks, let the scaler
        react. Without one: False (non-finite grads are caught by the norm check instead)."""
        scaler = self.grad_scaler
        if scaler is None:
            return False
        found_inf = self._unscale_and_check(scaler, grads)
        before = float(scaler.scale.item())
        scaler.update(found_inf)
        after = float(scaler.scale.item())
        if after != before:  # comm hooks' residuals are in loss-scaled units
            for chunk in self.model_chunks:
                chunk.engine.hooks.notify_comm_hooks_loss_scale_changed(after / before)
        return found_inf

    def _grads_of(self, domain: Domain, skip_shared: bool) -> list[torch.Tensor]:
        """The grads the norm reads: attached ones, and half-precision shards read in place
        when they are upcast only during the step ([Note: bf16 grads without an fp32 copy])."""
        return [
            mp.main.grad if mp.main.grad is not None else mp.model_grad  # None: left for a window
            for mp in domain.main_params
            if not (skip_shared and getattr(mp.model_param, "shared_embedding", False))
        ]

    def _norm_parts(self) -> list[NormPart]:
        """One part per kind present anywhere in the model (empty where this rank has none).
        A tied embedding has a copy on the first and the last pipeline stage holding the same
        grad after finalize_model_grads: only the first stage's copy counts."""
        skip_shared = self.process_groups.pp_rank != 0
        by_kind = {d.kind: d for d in self.domains}
        parts = []
        for kind in self._norm_kinds:
            domain = by_kind.get(kind)
            grads = self._grads_of(domain, skip_shared) if domain is not None else []
            parts.append(NormPart(grads, self._norm_groups(kind)))
        return parts

    def _unscale_and_check(self, scaler: GradScaler, grads: list[torch.Tensor]) -> bool:
        with torch.profiler.record_function("megabuf::unscale_and_check"):
            found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(
                    grads, found_inf, scaler.inv_scale.to(self.device)
                )
            for group in (self.process_groups.dp, self.process_groups.pp):
                if self.collectives.size(group) > 1:
                    self.collectives.all_reduce_max(found_inf, group)
            return bool(found_inf.item() > 0)

    def _release_grads(self) -> None:
        """Drop fp32 grad copies (views of the grad buffer stay attached)."""
        if self._copied_grads:
            for mp in self.main_params:
                if is_half_grad(mp):
                    mp.main.grad = None
            self._copied_grads = False

    # ---- torch-optimizer surface --------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the model chunks' grad buffers (grads live there)."""
        del set_to_none
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every inner group (dense groups, then expert groups): LR schedules edit these."""
        return [g for d in self.domains for g in d.optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def get_loss_scale(self) -> torch.Tensor:
        if self.grad_scaler is None:
            return torch.ones(1, device=self.device)
        return self.grad_scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * loss scale (unchanged without a grad scaler); call backward on the result."""
        if self.grad_scaler is None:
            return loss
        # fp32 product: an fp16 loss times a large scale would overflow
        return loss.float() * self.grad_scaler.scale.to(loss.device)[0]

    def model_params(self) -> list[nn.Parameter]:
        return [p for chunk in self.model_chunks for p in chunk.engine.param_to_name]

    def reload_model_params(self) -> None:
        """Copy the model params' current values into the fp32 main params that are copies of
        them. step() does this by itself for params edited in place through the param
        (`model.load_state_dict`, `p.mul_(...)` under no_grad); call it after writes through
        `param.data`. See [Note: main params follow the model params]."""
        self._versions.reload()

    # ---- uneven inputs: torch's Joinable ([Note: uneven inputs] in megabuf/core/join.py) ---------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """In `Join([model, optimizer])` after its model: a joined rank runs `step()` too."""
        return optimizer_join_hook(self, self.model_chunks)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self) -> Any:
        return self.process_groups.dp

    # ---- state and memory ---------------------------------------------------------------------
    def parts(self) -> OptimizerParts:
        """What the state and memory helpers read of this optimizer."""
        return OptimizerParts(
            domains=self.domains,
            keys=self.keys,
            model_chunks=self.model_chunks,
            optimizer_cls=self.optimizer_cls,
            num_param_groups=len(self._hparams),
            grad_scaler=self.grad_scaler,
            sharded=self.sharded,
            grad_upcast_window_numel=self._upcast_window_numel(),
        )

    def state_dict(self) -> dict[str, Any]:
        """{"common": rank-independent state, "pieces": this rank's state in model space};
        see [Note: model-space optimizer state]."""
        self._check_resident("optimizer state_dict()")
        parts = self.parts()
        return {"common": common_state(parts), "pieces": owned_pieces(parts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load pieces saved by any dp size / bucket layout (they must cover this rank's). Load
        the model first: see [Note: main params follow the model params]."""
        self._check_resident("optimizer load_state_dict()")
        load_model_space_state(self.parts(), state)
        self._versions.record()

    def memory_report(self) -> OptimizerMemoryReport:
        return memory_report(self.parts())
