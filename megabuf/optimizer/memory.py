"""Per-rank memory of an optimizer and its model chunks, in exact bytes.

With Adam, bf16 params and fp32 grads, plain data parallelism holds 2 (param) + 4 (grad) +
4 (fp32 main param) + 8 (two moments) = 18 bytes per param; the distributed optimizer holds
2 + 4 + 12 / dp (+ padding). `memory_report` measures what is actually allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from megabuf.optimizer.grad_upcast import is_half_grad, peak_window_nbytes
from megabuf.optimizer.param_groups import grad_buffers
from megabuf.optimizer.records import OptimizerParts


@dataclass(frozen=True)
class OptimizerMemoryReport:
    """Bytes (and elements) one rank holds."""

    owned_numel: int  # param elements this rank's inner optimizers step
    shard_numel: int  # elements of this rank's buffer shards incl. padding (= owned if unsharded)
    main_param_nbytes: int  # fp32 main-param copies (0 where the buffer itself is stepped)
    state_nbytes: int  # elementwise optimizer state (e.g. Adam's two moments)
    scalar_state_nbytes: int  # per-tensor scalars (e.g. Adam's `step`, one per main param)
    param_buffer_nbytes: int  # model params (the param_data buffers, or the params themselves)
    grad_buffer_nbytes: int  # grad_data buffers
    # transient fp32 copies of bf16/fp16 grads during a step (peak); see [Note: bf16 grads
    # without an fp32 copy]: the largest upcast window, or all of them at once
    grad_copy_nbytes: int = 0
    grad_copy_saved_nbytes: int = 0  # fp32 bytes of copying every half grad, minus the above

    @property
    def padding_numel(self) -> int:
        """Shard elements that belong to no param (bucket and alignment padding)."""
        return self.shard_numel - self.owned_numel

    @property
    def optimizer_nbytes(self) -> int:
        return self.main_param_nbytes + self.state_nbytes + self.scalar_state_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.optimizer_nbytes + self.param_buffer_nbytes + self.grad_buffer_nbytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def memory_report(parts: OptimizerParts) -> OptimizerMemoryReport:
    """This rank's bytes: the optimizer's main params and state, the chunks' buffers."""
    owned = main_nbytes = state_nbytes = scalar_nbytes = 0
    for domain in parts.domains:
        for mp in domain.main_params:
            owned += mp.numel
            main_nbytes += _nbytes(mp.main) if mp.is_copy else 0
            for value in domain.optimizer.state.get(mp.main, {}).values():
                if not isinstance(value, Tensor):
                    continue
                if value.shape == mp.main.shape and value.numel() == mp.numel:
                    state_nbytes += _nbytes(value)
                else:
                    scalar_nbytes += _nbytes(value)
    buffers = [
        b for c in parts.model_chunks for expert in (False, True) for b in grad_buffers(c, expert)
    ]
    shard = sum(b.numel // b.dp_size for b in buffers) if parts.sharded else owned
    param_nbytes = sum(b.param_nbytes for b in buffers)
    full_copy = sum(4 * mp.numel for mp in parts.main_params if is_half_grad(mp))
    window = parts.grad_upcast_window_numel
    copy = full_copy if window is None else peak_window_nbytes(parts.main_params, window)
    return OptimizerMemoryReport(
        owned_numel=owned,
        shard_numel=shard,
        main_param_nbytes=main_nbytes,
        state_nbytes=state_nbytes,
        scalar_state_nbytes=scalar_nbytes,
        param_buffer_nbytes=param_nbytes,
        grad_buffer_nbytes=sum(b.grad_nbytes for b in buffers),
        grad_copy_nbytes=copy,
        grad_copy_saved_nbytes=full_copy - copy,
    )
