"""The comm-hook part of `DistributedDataParallel`'s API: registration (once, before the first
backward), the registered hooks, their skip / loss-scale notifications, the deterministic mode's
hook and the wire-byte report. See [Note: comm hook contract] in megabuf/comm_hooks/contract.py.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import TYPE_CHECKING

from megabuf.comm_hooks.contract import CommHookRegistrationError, hook_name
from megabuf.comm_hooks.fixed_order import Deterministic, require_deterministic
from megabuf.comm_hooks.registration import install as install_comm_hook
from megabuf.comm_hooks.registration import selected_kinds
from megabuf.comm_hooks.telemetry import HookReport, hook_report
from megabuf.sharding.grads import check_error_feedback, error_feedback_nbytes

if TYPE_CHECKING:
    from megabuf.bucket_group import BucketGroup
    from megabuf.config import DistributedDataParallelConfig
    from megabuf.plan import Plan
    from megabuf.sharding.ledger import MemoryLedger

logger = logging.getLogger("megabuf.ddp")


class CommHookMethods:
    """Mixed into `DistributedDataParallel`, which provides the attributes declared here."""

    ddp_config: DistributedDataParallelConfig
    rank: int
    plan: Plan
    bucket_groups: list[BucketGroup]
    expert_parallel_bucket_groups: list[BucketGroup]
    memory_ledger: MemoryLedger
    _backward_seen: bool
    _mode_hook: Deterministic | None

    @property
    def all_bucket_groups(self) -> list[BucketGroup]:
        """Dense then expert bucket groups."""
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def register_comm_hook(self, hook: object, *, buffers: str = "all") -> None:
        """Reduce the `buffers` ("dense", "expert" or "all") buckets with `hook` instead of the
        engine's collective: see [Note: comm hook contract] in megabuf/comm_hooks/contract.py
        and the built-ins in `megabuf.comm_hooks`. Once per kind, before the first backward;
        every rank must register the same hook."""
        if self._backward_seen:
            raise CommHookRegistrationError(
                f"megabuf: register_comm_hook({hook_name(hook)}) after a backward (rank "
                f"{self.rank}); register before the first backward, as torch DDP requires"
            )
        cfg = self.ddp_config
        if cfg.deterministic_reduction:  # [Note: deterministic reduction]
            require_deterministic(hook, self.rank)
        strategy = cfg.sharding
        if strategy.shards_grads:
            check_error_feedback(hook, strategy.name, self.rank)
        with ExitStack() as stack:  # optim_grads*: views into the buckets need their storage
            for group in self.all_bucket_groups:
                if group.sharded_grads is not None:
                    stack.enter_context(group.sharded_grads.materialized())
            install_comm_hook(
                hook, self.all_bucket_groups, self.plan, expert_kinds=selected_kinds(buffers),
                mode=strategy.reduction, strategy_name=strategy.name,
                average=cfg.average_in_collective, rank=self.rank, replaceable=self._mode_hook,
            )  # fmt: skip
        nbytes = error_feedback_nbytes(hook) if strategy.shards_grads else 0
        if nbytes:
            self.memory_ledger.alloc("comm_hook_error_feedback", nbytes)
            logger.warning(
                "megabuf: %s keeps full-size error feedback under %s: %d bytes on rank %d "
                "(allow_full_size_error_feedback=True)", hook_name(hook), strategy.name, nbytes,
                self.rank,
            )  # fmt: skip

    def comm_hooks(self) -> dict[str, object]:
        """The registered comm hooks: "dense" / "expert" -> hook (a hook registered for "all"
        appears under both; a kind without a hook or without buffers is absent).
        `save_checkpoint` saves the state of those with `state_dict()`: [Note: comm hook state
        in checkpoints] in megabuf/checkpoint/hook_state.py."""
        hooks: dict[str, object] = {}
        for kind, groups in (
            ("dense", self.bucket_groups), ("expert", self.expert_parallel_bucket_groups)
        ):  # fmt: skip
            hook = next((g.comm_hook for g in groups if g.comm_hook is not None), None)
            if hook is not None:
                hooks[kind] = hook
        return hooks

    def _unique_comm_hooks(self) -> list[object]:
        hooks: list[object] = []
        for hook in self.comm_hooks().values():
            if not any(hook is h for h in hooks):
                hooks.append(hook)
        return hooks

    def notify_comm_hooks_step_skipped(self) -> None:
        """Tell the registered comm hooks that the optimizer skipped the step whose grads they
        just reduced (inf/NaN): each hook's optional `on_step_skipped()` runs (PowerSGD drops
        its residuals and Q). megabuf's optimizers call it; with torch's GradScaler, call it on
        every rank when `scaler.step(opt)` skipped (e.g. the scale went down)."""
        for hook in self._unique_comm_hooks():
            method = getattr(hook, "on_step_skipped", None)
            if method is not None:
                method()

    def notify_comm_hooks_loss_scale_changed(self, ratio: float) -> None:
        """Tell the registered comm hooks that the loss scale was multiplied by `ratio` (new /
        old): each hook's optional `on_loss_scale_change(ratio)` runs (PowerSGD rescales its
        residuals). megabuf's optimizers call it; with torch's GradScaler, call it on every
        rank after `scaler.update()` changed `scaler.get_scale()`."""
        for hook in self._unique_comm_hooks():
            method = getattr(hook, "on_loss_scale_change", None)
            if method is not None:
                method(ratio)

    def _install_deterministic(self) -> None:
        """deterministic_reduction: `Deterministic` on each buffer kind that has no hook yet;
        a deterministic hook registered later replaces it."""
        expert_of = {g.group_id: g.expert for g in self.plan.groups}
        free = {expert_of[g.group_id] for g in self.all_bucket_groups if g.comm_hook is None}
        if free:
            self._mode_hook = Deterministic()
            buffers = "all" if len(free) == 2 else ("expert" if True in free else "dense")
            self.register_comm_hook(self._mode_hook, buffers=buffers)

    def comm_hook_report(self, *, reset: bool = False) -> HookReport:
        """Wire bytes and calls each registered comm hook issued, per bucket, since the last
        reset ([Note: hook wire bytes] in megabuf/comm_hooks/telemetry.py)."""
        return hook_report(self, reset=reset)
