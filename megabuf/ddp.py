"""`DistributedDataParallel`: wraps any nn.Module with contiguous grad buffers and bucket groups.

Its parts live in one `Engine` (engine.py), reachable as `model.engine`: the plan (model_plan.py)
and its allocation (assembly.py), the grad sync (grad_sync.py, [Note: step phase]; what `.grad`
holds: [Note: grad contract] in grads.py), the param side (param_sync.py, [Note: who waits for
param gathers]) and the comm-hook registry (hook_registry.py); [Note: import layers] in
tests/test_import_graph.py and docs/ARCHITECTURE.md. The methods here are `forward` and one
thin door per act into those parts.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from megabuf.buckets.bucket_group import Timeline
from megabuf.buckets.buffer import _ParamAndGradBuffer
from megabuf.comm_hooks.torch_adapter import hook_of_call
from megabuf.config import DistributedDataParallelConfig
from megabuf.core import pickling
from megabuf.core.engine import Engine
from megabuf.core.join import JoinConfigSlot, UnevenInputs, refuse_unsupported
from megabuf.planning.budget_agree import planned_config
from megabuf.transport import torch_compat
from megabuf.transport.collectives import Collectives
from megabuf.transport.process_groups import ProcessGroups, resolve_split


class DistributedDataParallel(nn.Module, Joinable):
    """Megatron-style data parallelism for any module: grads accumulate into contiguous
    buffers (`param.main_grad` views) and are reduced bucket group by bucket group.

    Per step: `zero_grad_buffer()` (or the optimizer's `zero_grad()`); forward; backward,
    which finishes the grad sync (`sync_grads_at_backward_end`; otherwise call
    `finish_grad_sync()`); optimizer step (README "Quickstart", docs/gradient-contract.md and
    docs/porting-from-torch-ddp.md). Construction is collective: every rank of the process groups
    must wrap the same model (checked; raises naming the first difference), and dp-rank 0's
    params and buffers are broadcast to the others.

    Args:
        module: the model, all params on one device. Params are bound at wrapping: replacing,
            adding, freezing or unfreezing one afterwards raises at the next grad sync.
        ddp_config: a `DistributedDataParallelConfig` (default: all fields at their defaults,
            i.e. synchronous all-reduce, one bucket per buffer, sync at backward end). torch's
            second positional argument, `device_ids`, is also accepted here.
        process_groups: the `ProcessGroups` to reduce over (default: `ProcessGroups.default()`,
            the whole world as dp; build with `ProcessGroups.build(pp_size=, ep_size=)`).
        disable_bucketing: one bucket group per kind (dense / expert) instead of one per bucket.
        collectives: the layer every collective goes through (default: a new `Collectives`);
            tests pass a subclass to count or intercept calls.
        **torch_ddp_args: any argument of `torch.nn.parallel.DistributedDataParallel`
            (`device_ids`, `output_device`, `broadcast_buffers`, `process_group`,
            `bucket_cap_mb`, `find_unused_parameters`, `static_graph`, ...): honoured, accepted
            where megabuf already behaves so, or rejected naming the megabuf way; see
            [Note: torch DDP arguments] in torch_compat.py and docs/porting-from-torch-ddp.md.
    """

    _join_config = JoinConfigSlot()  # torch's Join sets it; [Note: uneven inputs] in join.py

    def __init__(
        self,
        module: nn.Module,
        ddp_config: DistributedDataParallelConfig | None = None,
        *,
        process_groups: ProcessGroups | None = None,
        disable_bucketing: bool = False,
        collectives: Collectives | None = None,
        **torch_ddp_args: Any,
    ) -> None:
        super().__init__()
        options = torch_compat.resolve(module, ddp_config, process_groups, torch_ddp_args)
        self.module = module
        groups = options.process_groups or ProcessGroups.default()
        collectives = collectives if collectives is not None else Collectives()
        # memory_budget: the planner's choice ([Note: memory planner] in planning/budget.py)
        self.ddp_config = planned_config(module, options.ddp_config, groups, collectives)
        self.process_groups = resolve_split(groups, self.ddp_config)  # a hybrid split asked for
        self.engine = Engine(
            module, self.ddp_config, self.process_groups, collectives,
            disable_bucketing=disable_bucketing, init_sync=options.init_sync,
        )  # fmt: skip
        # Megatron's attribute name. It would shadow nn.Module.buffers(), so the list is also
        # callable: `model.buffers` is the dense grad buffers, `model.buffers()` the module's.
        self.buffers = _BufferList(self.engine.dense_buffers, self)  # type: ignore[method-assign,assignment]
        self._uneven = UnevenInputs(self.engine, options.sync_buffers_in_forward)
        Joinable.__init__(self)  # a disabled join config, until a Join sets one

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward. A training forward (grad enabled, grad sync on) first
        broadcasts dp-rank 0's module buffers (`broadcast_buffers`, torch's default; collective;
        inside a Join the highest active rank's), and its outputs arm the end-of-backward sync."""
        src = self._uneven.iteration_start(self) if torch.is_grad_enabled() else 0  # Join
        self.engine.before_forward(
            torch.compiler.is_compiling(), self._uneven.sync_buffers, buffer_src=src
        )
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.engine.watch_outputs(output)  # first: it raises before anything is queued
            self.engine.sync.watch(output)
        return output

    # ---- grad sync: thin calls into GradSync ([Note: step phase] in grad_sync.py) ------------
    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag: False makes backward only accumulate (as inside `no_sync()`)."""
        return self.engine.sync.require_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.engine.sync.set_require_sync(value)

    def no_sync(self) -> AbstractContextManager[None]:
        """Accumulate grads without reducing (all micro-batches but the last)."""
        return self.engine.sync.no_sync()

    def deferred_grad_sync(self) -> AbstractContextManager[None]:
        """Backwards ending inside this block leave the grad sync to `finish_grad_sync()` (the
        last buckets' reductions overlap whatever runs before it; pipeline schedules use it).
        See [Note: grad sync at backward end]."""
        return self.engine.sync.deferred()

    def finish_microbatch(self) -> None:
        """optim_grads* with reduce_each_microbatch, a micro-batch inside no_sync(): dispatch
        what backward did not, wait, add every reduced shard into the grad shards and release
        the full buckets ([Note: sharded grad lifecycle]). Runs at the end of such a backward
        (or, when that backward's sync is deferred, at the next forward or finish_grad_sync);
        a no-op otherwise. Collective: every dp rank runs the same forwards."""
        self.engine.sync.finish_microbatch()

    def start_grad_sync(self) -> None:
        """Dispatch every reduction not yet dispatched, in chain order (e.g. from a pipeline's
        grad_sync_func). Collective: every dp rank must call it."""
        self.engine.check_resident("start_grad_sync()")
        self.engine.sync.start()

    def finish_grad_sync(self) -> None:
        """Dispatch what backward did not (unused params are zero-filled), wait for every
        reduction, and hand out the grads: see [Note: grad contract]. Collective: every dp rank
        must call it once per iteration, unless backward already did (sync_grads_at_backward_end
        outside deferred_grad_sync()): it is a no-op while every group is synced."""
        self.engine.check_resident("finish_grad_sync()")
        self.engine.sync.finish()

    @property
    def timeline(self) -> Timeline | None:
        """The timeline `enable_timeline()` made, or None."""
        return self.engine.sync.timeline

    def enable_timeline(self) -> Timeline:
        """Record when every bucket group became ready, was dispatched and finished, and a
        "backward_end" marker (group id -1) at the start of each finish_grad_sync(), into one
        shared `Timeline` (also `self.timeline`); `megabuf.pure.overlap` turns it into a report.
        On CUDA params the events are timed CUDA events, resolved when `timeline.events` is
        read: see [Note: timeline on CUDA] in timeline.py."""
        return self.engine.enable_timeline()

    def zero_grad_buffer(self) -> None:
        """Start a new iteration's grads: lazily, see [Note: grad accumulation into main_grad]
        (no pass over the buffer: each param's first grad overwrites its main_grad; only the
        small params' grads are zeroed, [Note: small grads accumulate in place]). With
        bucket_size="auto", after the warm-up also the one re-plan ([Note: auto bucket re-plan])."""
        self.engine.zero_grad_buffer()
        self.buffers[:] = self.engine.dense_buffers  # type: ignore[index]  # renewed: sharded re-plan

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as zero_grad_buffer(): grads live in the buffers, see [Note: grad accumulation
        into main_grad]."""
        del set_to_none
        self.zero_grad_buffer()

    def reset_iter_state(self) -> None:
        """Bring the engine back to a clean iteration start after an exception in forward,
        backward or between them (a bad batch, a caught OOM), without rebuilding it: in-flight
        grad reductions and param gathers are waited for (their grads are dropped), grads are
        zeroed and no_sync is left. Every dp rank must call it at the same point, like any
        other step of the loop, so the collectives already issued pair up."""
        self.engine.param_side.reset()
        self.engine.sync.abandon()

    def scale_gradients(self, scaling_factor: float) -> None:
        self.engine.scale_gradients(scaling_factor)

    # ---- params -------------------------------------------------------------------------------
    def broadcast_params(self) -> None:
        """Copy dp-rank-0's params (expert params: expt_dp-rank-0's) and buffers to all ranks.
        Collective: every rank must call it. Under optim_grads_params the params are gathered,
        broadcast and written back into the shards."""
        self.engine.broadcast_params()  # waits for gathers in flight

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """After an optimizer step (the step calls it): dispatch every group's param gather, in
        the order the next forward reads them, for the forward pre-hooks to wait on just in time
        ([Note: publishing params] in optimizer/distributed.py); without overlap_param_gather,
        or while torch.profiler records, gather synchronously (an async gloo collective started
        inside a profiled region and waited on after it crashes the process at exit).

        `force_sync=True` (Megatron's idiom before evaluation or checkpointing): on return every
        param on this rank holds the gathered values of the last step; gathers in flight are
        waited for, stale ones gathered now ([Note: who waits for param gathers]). Positional
        arguments (Megatron's schedules pass the chunk's params) and `force_dispatch` are
        accepted and change nothing: every gather is dispatched anyway. Collective when a group
        is stale (only inside the step); otherwise it only waits. Under optim_grads_params a
        no-op: params are shards between forwards, and forward, `state_dict()` and
        `summon_full_params()` gather them ([Note: who gathers when])."""
        del unused, force_dispatch
        self.engine.check_resident("start_param_sync()")
        self.engine.param_side.start(force_sync)

    def publish_params(self) -> None:
        """Wait for every param gather in flight: call before reading params outside forward
        (evaluation code that bypasses forward, checkpoint saving); state_dict() calls it.
        Not collective: the step dispatched every gather on every rank, so one rank may call
        it alone (evaluation or saving on rank 0 only)."""
        self.engine.param_side.publish()

    def reshard_params(self) -> None:
        """optim_grads_params: finish every gather in flight and release every unit's full
        params (the optimizer does it before writing the shards). Not collective; a no-op under
        the other strategies."""
        self.engine.param_side.reshard()

    @contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Every param readable inside (optim_grads_params: every unit gathered, released on
        exit; `writeback=True` copies what was written into the params back into the shards).
        Read or edit params outside forward inside it: a released param has a 0-byte storage
        and reading it fails (a RuntimeError, or a crash of the process for some CPU kernels).
        Collective under optim_grads_params; elsewhere it publishes params (not collective)."""
        self.engine.check_resident("summon_full_params()")
        with self.engine.param_side.summon(writeback=writeback):
            yield

    def enable_forward_pre_hook(self) -> None:
        """Megatron's: forwards wait for each param gather just before its first reader again
        (overlap_param_gather)."""
        self.engine.gather_hooks.enable()

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Megatron's, before evaluation or checkpointing: no per-module waits in forward. With
        `param_sync=True` every param holds the last step's gathered values on return
        (`start_param_sync(force_sync=True)`); with False params are left as they are, and
        the next forward still waits for every gather in flight before running the module, so
        it never reads a param mid-gather ([Note: who waits for param gathers])."""
        self.engine.gather_hooks.disable()
        if param_sync:
            self.start_param_sync(force_sync=True)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The wrapped module's state dict (its keys, no `module.` prefix), after publishing
        params (not collective: rank 0 may call it alone, see publish_params). Under
        optim_grads_params the params are gathered unit by unit and copied out: collective
        (every dp rank calls it), keyword arguments only."""
        self.engine.check_resident("state_dict()")
        return self.engine.param_side.state_dict(self.module, args, kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Copy values into the wrapped module's params and buffers (its keys). megabuf's
        optimizers notice the change (param versions) and reload their fp32 main params.
        Every dp rank must call it with the same state dict, or replicas differ. Under
        optim_grads_params every unit is gathered around the load (a full param copy at the
        peak) and the loaded values are written into the shards."""
        self.engine.check_resident("load_state_dict()")
        if assign:
            raise ValueError(
                "megabuf: load_state_dict(assign=True) would detach params from the buffers; "
                "use assign=False (values are copied into the existing params)"
            )
        with self.summon_full_params(writeback=True):
            return self.module.load_state_dict(state_dict, strict=strict)

    # ---- torch DDP's names (docs/porting-from-torch-ddp.md, "Every public name of torch DDP") ---
    @property
    def broadcast_buffers(self) -> bool:
        """torch DDP's flag: training forwards broadcast dp-rank 0's module buffers (settable)."""
        return self._uneven.sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self._uneven.set_sync_buffers(bool(value))

    def will_sync_module_buffers(self) -> bool:
        """torch DDP's: the flag is on, grads sync, and the module has buffers."""
        has = next(iter(self.module.buffers()), None) is not None
        return self._uneven.sync_buffers and self.require_backward_grad_sync and has

    # ---- pickling and copying ([Note: pickling a wrapped model] in pickling.py) ---------------
    def __getstate__(self) -> dict[str, Any]:
        """The config and a snapshot of the module's values; no buffers, groups or grads."""
        return pickling.wrapper_state(self.__dict__, self.engine, self.process_groups,
                                      self.ddp_config)  # fmt: skip

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuilds the engine on the default groups, eagerly and without a collective."""
        self.process_groups, self.engine, sync_buffers = pickling.restore(self, state)
        self.buffers = _BufferList(self.engine.dense_buffers, self)  # type: ignore[method-assign,assignment]
        self._uneven = UnevenInputs(self.engine, sync_buffers)
        Joinable.__init__(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> DistributedDataParallel:
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(pickling.copied_state(self.__getstate__(), memo))
        return copied

    # ---- communication hooks ([Note: comm hook contract] in comm_hooks/contract.py) -----------
    def register_comm_hook(self, *hook: object, buffers: str = "all", **torch_form: object) -> None:
        """`register_comm_hook(hook, buffers="all")`: reduce the `buffers` ("dense", "expert" or
        "all") buckets with `hook` instead of the engine's collective (the built-ins:
        `megabuf.comm_hooks`). Once per kind, before the first backward; every rank must
        register the same hook. torch's `register_comm_hook(state, hook)` registers
        `from_torch(hook, state)` ([Note: torch hooks on megabuf buckets])."""
        self.engine.register_comm_hook(hook_of_call(hook, torch_form), buffers)

    def comm_hooks(self) -> dict[str, object]:
        """The registered comm hooks: "dense" / "expert" -> hook (a hook registered for "all"
        appears under both; a kind without a hook or without buffers is absent).
        `save_checkpoint` saves the state of those with `state_dict()`."""
        return self.engine.hooks.comm_hooks()

    # ---- uneven inputs: torch's Joinable ([Note: uneven inputs] in join.py) ----------------
    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """torch DDP's context manager for uneven inputs, `Join([self], ...)` (with a megabuf
        optimizer: `Join([model, optimizer])`): ranks out of data shadow the others'
        collectives, with zero grads. Every rank must enter it."""
        refuse_unsupported(self.engine, "join()")
        return Join(
            [self], enable, throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )  # fmt: skip

    def join_hook(self, **kwargs: Any) -> Any:
        """torch's Joinable (kwarg `divide_by_initial_world_size`); every rank builds the Join."""
        return self._uneven.join_hook(kwargs)

    @property
    def join_device(self) -> torch.device:
        """torch's Joinable: the device of the Join's own all-reduces (the params')."""
        return self.engine.device

    @property
    def join_process_group(self) -> Any:
        """torch's Joinable: the dp group."""
        return self.process_groups.dp


def as_model_chunks(
    model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel], user: str
) -> list[DistributedDataParallel]:
    """One chunk or a list of chunks, each a megabuf DistributedDataParallel; `user` names the
    caller in the error."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    if not chunks:
        raise ValueError(f"megabuf: {user} got no model chunks")
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise ValueError(
                f"megabuf: {user}: model chunk {i} is a {type(chunk).__name__}, not a "
                "megabuf.DistributedDataParallel; wrap every chunk before training"
            )
    return chunks


class _BufferList(list):  # type: ignore[type-arg]
    """A list of `_ParamAndGradBuffer` that, called, behaves like `nn.Module.buffers()`."""

    def __init__(self, items: list[_ParamAndGradBuffer], owner: nn.Module) -> None:
        super().__init__(items)
        self._owner = owner

    def __call__(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        return nn.Module.buffers(self._owner, recurse)
