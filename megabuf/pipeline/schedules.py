"""Forward/backward schedules over micro-batches: no pipelining, 1F1B, interleaved 1F1B.

Megatron's calling convention: `forward_step_func(data_iterator, model) -> (output, loss_func)`;
on the last (virtual) stage `loss_func(output)` returns `loss`, `(loss, metrics)` or, for a
per-token loss, `(loss_sum, num_tokens, metrics)`. Stages after the first get their input through
`model.set_input_tensor(tensor)`. A mean loss is divided by `num_microbatches` before backward; a
per-token loss is not, and the summed token count goes to `finalize_model_grads_func`, which
normalises the grads. Each schedule returns the list of `metrics` of its micro-batches (empty
except on the last stage). Orders: [Note: pipeline orders] in order.py; traffic: [Note:
pipeline point-to-point] in p2p.py; hooks: hooks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor, nn

from megabuf.pipeline.chunks import set_input_tensor
from megabuf.pipeline.hooks import GradSyncSwitch, ScheduleHooks, per_chunk
from megabuf.pipeline.order import (
    FORWARD,
    Action,
    P2PStep,
    interleaved_order,
    one_f_one_b_order,
)
from megabuf.pipeline.p2p import PipelineP2P
from megabuf.transport.collectives import Collectives
from megabuf.transport.devices import params_device
from megabuf.transport.process_groups import ProcessGroups

ForwardStepFunc = Callable[[Any, nn.Module], tuple[Tensor, Callable[[Tensor], Any]]]


class _Runner:
    """Runs forward and backward steps of (chunk, micro-batch) and keeps what backward needs."""

    def __init__(
        self,
        forward_step_func: ForwardStepFunc,
        data_iterators: list[Any],
        chunks: list[nn.Module],
        num_microbatches: int,
        p2p: PipelineP2P | None,
        per_token_loss: bool,
        device: torch.device,
    ) -> None:
        self.forward_step_func = forward_step_func
        self.data_iterators = data_iterators
        self.chunks = chunks
        self.num_microbatches = num_microbatches
        self.p2p = p2p
        self.per_token_loss = per_token_loss
        self.saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        self.metrics: list[Any] = []
        # 1-D, float64, one element; on the stage's param device ([Note: allocation device])
        self.num_tokens = torch.zeros(1, dtype=torch.float64, device=device)

    def is_first(self, chunk: int) -> bool:
        return self.p2p is None or self.p2p.is_first(chunk)

    def is_last(self, chunk: int) -> bool:
        return self.p2p is None or self.p2p.is_last(chunk)

    def forward(self, chunk: int, microbatch: int, keep_for_backward: bool) -> None:
        inp = None
        if not self.is_first(chunk) and self.p2p is not None:
            inp = self.p2p.take_input(chunk, microbatch)
        set_input_tensor(self.chunks[chunk], inp)
        with torch.profiler.record_function("megabuf::pipeline_forward"):
            output, loss_func = self.forward_step_func(
                self.data_iterators[chunk], self.chunks[chunk]
            )
        if self.is_last(chunk):
            output = self._loss(loss_func(output), chunk, microbatch)
        elif self.p2p is not None:
            self.p2p.put_output(output, chunk, microbatch)
        if keep_for_backward:
            self.saved[(chunk, microbatch)] = (inp, output)

    def _loss(self, result: Any, chunk: int, microbatch: int) -> Tensor:
        num_tokens = None
        if isinstance(result, Tensor):
            loss, metrics = result, None
        elif len(result) == 2:
            loss, metrics = result
        else:
            loss, num_tokens, metrics = result
        self.metrics.append(metrics)
        if not self.per_token_loss:
            return loss / self.num_microbatches  # type: ignore[no-any-return]
        if num_tokens is None:
            raise ValueError(
                f"megabuf: per_token_loss=True but loss_func of chunk {chunk} micro-batch "
                f"{microbatch} returned no token count; return (loss_sum, num_tokens, metrics)"
            )
        count = torch.as_tensor(num_tokens, dtype=torch.float64, device=self.num_tokens.device)
        self.num_tokens += count.reshape(1)
        return loss  # type: ignore[no-any-return]

    def backward(self, chunk: int, microbatch: int) -> None:
        inp, output = self.saved.pop((chunk, microbatch))
        grad = None
        if not self.is_last(chunk) and self.p2p is not None:
            grad = self.p2p.take_output_grad(chunk, microbatch)
        with torch.profiler.record_function("megabuf::pipeline_backward"), ExitStack() as stack:
            # the schedule finishes the grad sync itself (finalize), after later chunks' work
            for c in self.chunks:
                defer: Any = getattr(c, "deferred_grad_sync", None)
                if defer is not None:
                    stack.enter_context(defer())
            torch.autograd.backward(output, grad_tensors=grad)
        if inp is not None and self.p2p is not None:
            input_grad = inp.grad if inp.grad is not None else torch.zeros_like(inp)
            self.p2p.put_input_grad(input_grad, chunk, microbatch)


def _as_chunks(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    return [model] if isinstance(model, nn.Module) else list(model)


def _iterators(data_iterator: Any, num_chunks: int) -> list[Any]:
    if isinstance(data_iterator, list | tuple):
        if len(data_iterator) != num_chunks:
            raise ValueError(
                f"megabuf: got {len(data_iterator)} data iterators for {num_chunks} chunks"
            )
        return list(data_iterator)
    return [data_iterator] * num_chunks


def _steps(
    p2p: PipelineP2P, order: list[Action], forward_only: bool, *, paired: bool
) -> list[P2PStep]:
    """The point-to-point steps of `order` ([Note: pipeline point-to-point]); forward-only runs
    no backward, so its steps carry no grads."""
    if forward_only:
        order = [act for act in order if act.phase == FORWARD]
    return p2p.steps(order, paired=paired)


def _finalize(hooks: ScheduleHooks, chunks: list[nn.Module], runner: _Runner) -> None:
    if hooks.finalize_model_grads_func is not None:
        tokens = runner.num_tokens if runner.per_token_loss else None
        hooks.finalize_model_grads_func(chunks, tokens)


def forward_backward_no_pipelining(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | Any,
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    hooks: ScheduleHooks | None = None,
    forward_only: bool = False,
    per_token_loss: bool = False,
) -> list[Any]:
    """Gradient accumulation: every micro-batch but the last inside no_sync, the last outside
    (its backward launches the reduction), then finalize_model_grads_func."""
    chunks = _as_chunks(model)
    if len(chunks) != 1:
        raise ValueError(f"megabuf: no-pipelining schedule takes one model, got {len(chunks)}")
    hooks = hooks or ScheduleHooks()
    pgs = getattr(chunks[0], "process_groups", None)
    device = params_device(chunks[0].parameters(), pgs.dp if pgs is not None else None)
    runner = _Runner(forward_step_func, _iterators(data_iterator, 1), chunks,
                     num_microbatches, None, per_token_loss, device)  # fmt: skip
    switch = GradSyncSwitch(hooks, chunks)
    switch.disable()
    for m in range(num_microbatches - 1):
        runner.forward(0, m, keep_for_backward=not forward_only)
        if not forward_only:
            runner.backward(0, m)
    switch.enable()
    runner.forward(0, num_microbatches - 1, keep_for_backward=not forward_only)
    if not forward_only:
        runner.backward(0, num_microbatches - 1)
        _finalize(hooks, chunks, runner)
    return runner.metrics


def _pipeline_setup(
    model: nn.Module | Sequence[nn.Module],
    process_groups: ProcessGroups | None,
    collectives: Collectives | None,
) -> tuple[list[nn.Module], ProcessGroups, Collectives]:
    chunks = _as_chunks(model)
    pgs = process_groups or getattr(chunks[0], "process_groups", None)
    if pgs is None:
        raise ValueError(
            "megabuf: pipeline schedules need process_groups= (or megabuf DDP model chunks)"
        )
    coll = collectives or getattr(chunks[0], "collectives", None) or Collectives()
    return chunks, pgs, coll


def _stage_device(chunks: list[nn.Module], pgs: ProcessGroups) -> torch.device:
    """Where this stage's receive buffers and token count live: its params' device, or the
    pipeline group's device if it has no params ([Note: allocation device])."""
    return params_device((p for chunk in chunks for p in chunk.parameters()), pgs.pp)


def forward_backward_pipelining_without_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Iterator[Any] | Any,
    model: nn.Module | Sequence[nn.Module],
    num_microbatches: int,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    process_groups: ProcessGroups | None = None,
    collectives: Collectives | None = None,
    hooks: ScheduleHooks | None = None,
    forward_only: bool = False,
    per_token_loss: bool = False,
) -> list[Any]:
    """1F1B over batched point-to-point groups, one per forward or backward step
    (`tensor_shape`/`dtype`: the activation between two stages). Grad sync stays off until stage
    0's last backward; stages > 0 with a grad_sync_func launch their reduction after the
    cool-down (see hooks.py)."""
    chunks, pgs, coll = _pipeline_setup(model, process_groups, collectives)
    if len(chunks) != 1:
        raise ValueError(f"megabuf: 1F1B takes one model chunk per stage, got {len(chunks)}")
    hooks = hooks or ScheduleHooks()
    device = _stage_device(chunks, pgs)
    p2p = PipelineP2P(pgs, coll, num_chunks=1, num_microbatches=num_microbatches,
                      tensor_shape=tensor_shape, dtype=dtype, device=device)  # fmt: skip
    runner = _Runner(forward_step_func, _iterators(data_iterator, 1), chunks,
                     num_microbatches, p2p, per_token_loss, device)  # fmt: skip
    order = one_f_one_b_order(num_microbatches, pgs.pp_size, pgs.pp_rank)
    grad_sync = per_chunk(hooks.grad_sync_func, 1, "grad_sync_func")
    switch = GradSyncSwitch(hooks, chunks)
    switch.disable()
    for act in p2p.run(_steps(p2p, order, forward_only, paired=False)):
        if act.phase == FORWARD:
            runner.forward(0, act.microbatch, keep_for_backward=not forward_only)
        elif not forward_only:
            if act.microbatch == num_microbatches - 1 and (grad_sync is None or pgs.pp_rank == 0):
                switch.enable()  # this backward's bucket hooks launch the reduction
            runner.backward(0, act.microbatch)
    switch.enable()
    if not forward_only and grad_sync is not None:
        grad_sync[0](chunks[0].parameters())
    p2p.finish()
    if not forward_only:
        _finalize(hooks, chunks, runner)
    return runner.metrics


def forward_backward_pipelining_with_interleaving(
    *,
    forward_step_func: ForwardStepFunc,
    data_iterator: Sequence[Any] | Any,
    model: Sequence[nn.Module],
    num_microbatches: int,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    process_groups: ProcessGroups | None = None,
    collectives: Collectives | None = None,
    hooks: ScheduleHooks | None = None,
    forward_only: bool = False,
    per_token_loss: bool = False,
) -> list[Any]:
    """Interleaved 1F1B over `len(model)` chunks per stage (virtual pipeline). Param gathers of
    chunks >= 2 are dispatched pp_rank steps ahead of their first forward and grad reductions
    pp_rank steps after their last backward, so all stages launch them together (Megatron)."""
    chunks, pgs, coll = _pipeline_setup(model, process_groups, collectives)
    hooks = hooks or ScheduleHooks()
    n_chunks = len(chunks)
    device = _stage_device(chunks, pgs)
    p2p = PipelineP2P(pgs, coll, num_chunks=n_chunks, num_microbatches=num_microbatches,
                      tensor_shape=tensor_shape, dtype=dtype, device=device)  # fmt: skip
    runner = _Runner(forward_step_func, _iterators(data_iterator, n_chunks), chunks,
                     num_microbatches, p2p, per_token_loss, device)  # fmt: skip
    order = interleaved_order(num_microbatches, pgs.pp_size, pgs.pp_rank, n_chunks)
    actions = p2p.run(_steps(p2p, order, forward_only, paired=True))
    _InterleavedDriver(runner, order, hooks, chunks, pgs.pp_rank, forward_only).run(actions)
    p2p.finish()
    if not forward_only:
        _finalize(hooks, chunks, runner)
    return runner.metrics


class _InterleavedDriver:
    """Walks an interleaved order, calling the sync hooks where Megatron does."""

    def __init__(
        self,
        runner: _Runner,
        order: list[Action],
        hooks: ScheduleHooks,
        chunks: list[nn.Module],
        pp_rank: int,
        forward_only: bool,
    ) -> None:
        self.runner, self.order, self.chunks = runner, order, chunks
        self.pp_rank, self.forward_only = pp_rank, forward_only
        self.forwards = sorted((a for a in order if a.phase == FORWARD), key=lambda a: a.index)
        self.backwards = sorted((a for a in order if a.phase != FORWARD), key=lambda a: a.index)
        self.grad_sync = per_chunk(hooks.grad_sync_func, len(chunks), "grad_sync_func")
        self.param_sync = per_chunk(hooks.param_sync_func, len(chunks), "param_sync_func")
        self.switch = GradSyncSwitch(hooks, chunks)
        self.synced: set[int] = set()

    def _params(self, chunk: int) -> Any:
        return self.chunks[chunk].parameters()

    def run(self, actions: Iterable[Action]) -> None:
        """Run `actions` (this rank's order, as `PipelineP2P.run` yields it)."""
        self.switch.disable()
        if self.param_sync is not None:
            for chunk in range(min(2, len(self.chunks))):
                self.param_sync[chunk](self._params(chunk))
        last_mb = self.runner.num_microbatches - 1
        for act in actions:
            if act.phase == FORWARD:
                self._prefetch_params(act)
                self.runner.forward(act.chunk, act.microbatch, not self.forward_only)
            elif not self.forward_only:
                if self.grad_sync is None and act.microbatch == last_mb:
                    self.switch.enable()  # bucket hooks reduce this chunk in its last backward
                self.runner.backward(act.chunk, act.microbatch)
                self._launch_grad_sync(act)
                self.switch.disable()
        self.switch.enable()
        if self.grad_sync is not None and not self.forward_only:
            for chunk in range(len(self.chunks)):
                if chunk not in self.synced:
                    self.grad_sync[chunk](self._params(chunk))

    def _prefetch_params(self, act: Action) -> None:
        if self.param_sync is None:
            return
        k = act.index + self.pp_rank
        if k < len(self.forwards) and self.forwards[k].microbatch == 0:
            chunk = self.forwards[k].chunk + 1
            if 1 < chunk < len(self.chunks):
                self.param_sync[chunk](self._params(chunk))

    def _launch_grad_sync(self, act: Action) -> None:
        if self.grad_sync is None:
            return
        k = act.index - self.pp_rank
        last_mb = self.runner.num_microbatches - 1
        if k >= 0 and self.backwards[k].microbatch == last_mb:
            chunk = self.backwards[k].chunk
            self.switch.enable()
            self.grad_sync[chunk](self._params(chunk))
            self.synced.add(chunk)


def get_forward_backward_func(pp_size: int, num_chunks: int = 1) -> Callable[..., list[Any]]:
    """The schedule for a (pp_size, model chunks per stage) configuration."""
    if pp_size == 1:
        if num_chunks != 1:
            raise ValueError("megabuf: model chunks > 1 need pipeline parallelism (pp_size > 1)")
        return forward_backward_no_pipelining
    if num_chunks > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
