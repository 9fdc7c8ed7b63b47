"""Per-rank memory of an optimizer and its model chunks, in exact bytes.

With Adam, bf16 params and fp32 grads, plain data parallelism holds 2 (param) + 4 (grad) +
4 (fp32 main param) + 8 (two moments) = 18 bytes per param; the distributed optimizer holds
2 + 4 + 12 / dp (+ padding). `memory_report` measures what is actually allocated.

[Note: memory report categories]
`OptimizerMemoryReport.persistent` holds what one rank keeps for the whole run on the params'
device, per category: "params" (the param buffers, or the params themselves; the param shards
where the engine's `MemoryLedger` records "param_shard": optim_grads_params), "grads" (the
grad buffers; the grad shards where it records "grad_shard": optim_grads*), "main_params"
(fp32 copies), "optimizer_state" (elementwise state and per-tensor scalars), "comm_scratch"
(reduce-scatter landing zones), "frozen_params" and "module_buffers". The first five equal
`persistent_bytes` of megabuf/sharding/formula.py ([Note: memory formula]) category by
category. `host` holds every optimizer tensor on the CPU while the params are on an
accelerator, by category: with cpu_offload "main_params", "optimizer_state" and "grads"
(pinned host copies of the grads). `transient_now` and `transient_peak` are the ledger's other
categories ("grad_buckets", "unsharded_params": storages released and refilled during a step)
now and at their high-water mark, plus "grad_copies": `.grad` copies in the param dtype
exposed after a grad sync (bf16 params over fp32 grads without the distributed optimizer),
dropped by the next backward. `persistent_nbytes + host_nbytes + transient_now_nbytes` equals
an independent walk over unique storages (`megabuf.sharding.walk.storage_walk`, [Note:
storage walk]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.grad_upcast import is_half_grad, peak_window_nbytes
from megabuf.optimizer.param_groups import grad_buffers
from megabuf.optimizer.records import OptimizerParts
from megabuf.transport.devices import params_device


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
    # [Note: memory report categories]
    strategy: str = "no_shard"  # data_parallel_sharding_strategy of the model chunks
    persistent: Mapping[str, int] = field(default_factory=dict)  # on the params' device
    host: Mapping[str, int] = field(default_factory=dict)  # CPU bytes, params on an accelerator
    transient_now: Mapping[str, int] = field(default_factory=dict)
    transient_peak: Mapping[str, int] = field(default_factory=dict)

    @property
    def persistent_nbytes(self) -> int:
        return sum(self.persistent.values())

    @property
    def host_nbytes(self) -> int:
        return sum(self.host.values())

    @property
    def transient_now_nbytes(self) -> int:
        return sum(self.transient_now.values())

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


PERSISTENT_CATEGORIES = (
    "params", "grads", "main_params", "optimizer_state", "comm_scratch", "frozen_params",
    "module_buffers",
)  # fmt: skip
LEDGER_PERSISTENT = {"param_shard": "params", "grad_shard": "grads"}  # ledger -> category


def _held(t: Tensor | None) -> int:
    """Bytes of `t`, or 0 when it is None or its storage is released (resized to 0)."""
    if t is None or t.untyped_storage().nbytes() == 0:
        return 0
    return _nbytes(t)


def _chunk_categories(chunk: DistributedDataParallel, out: dict[str, dict[str, int]]) -> None:
    """Add one model chunk's params, grads, scratch, frozen params, module buffers, grad copies
    and ledger figures into `out` ({"persistent", "transient_now", "transient_peak"})."""
    persistent, now, peak = out["persistent"], out["transient_now"], out["transient_peak"]
    ledger = chunk.engine.memory_ledger
    buffers = grad_buffers(chunk, False) + grad_buffers(chunk, True)
    recorded = ledger.current()  # the shards a sharded strategy allocated, if it did
    if "param_shard" in recorded:
        persistent["params"] += recorded["param_shard"]
    else:
        persistent["params"] += sum(
            _nbytes(b.param_data) if b.param_data is not None else sum(map(_nbytes, b.params))
            for b in buffers
        )
    if "grad_shard" in recorded:
        persistent["grads"] += recorded["grad_shard"]
    else:
        persistent["grads"] += sum(_nbytes(b.grad_data) for b in buffers)
    persistent["comm_scratch"] += sum(_held(k.scratch) for b in buffers for k in b.buckets)
    for fp8 in (b.fp8 for b in buffers if b.fp8 is not None):  # [Note: FP8 params]
        persistent["params"] += fp8.nbytes  # the scales
        persistent["main_params"] += sum(map(_nbytes, fp8.masters))  # the fp32 master shards
    trainable = set(chunk.engine.param_to_name)
    frozen = [p for p in chunk.module.parameters() if p not in trainable]
    persistent["frozen_params"] += sum(map(_nbytes, frozen))
    persistent["module_buffers"] += sum(map(_nbytes, chunk.module.buffers()))
    copies = 0
    for p in trainable:
        main_grad = getattr(p, "main_grad", None)
        if p.grad is not None and main_grad is not None and not _same_storage(p.grad, main_grad):
            copies += _held(p.grad)
    now["grad_copies"] = now.get("grad_copies", 0) + copies
    for category, nbytes in ledger.current().items():
        if category not in LEDGER_PERSISTENT:
            now[category] = now.get(category, 0) + nbytes
            peak[category] = peak.get(category, 0) + ledger.peak(category)


def _same_storage(a: Tensor, b: Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _optimizer_categories(
    parts: OptimizerParts, device: torch.device, out: dict[str, dict[str, int]]
) -> None:
    """Main params and state into "persistent", or "host" where they sit on the CPU while the
    params are on an accelerator."""

    def where(t: Tensor) -> dict[str, int]:
        host = t.device.type == "cpu" and device.type != "cpu"
        return out["host"] if host else out["persistent"]

    for domain in parts.domains:
        for mp in domain.main_params:
            if mp.model_grad.device.type == "cpu" and device.type != "cpu":  # cpu offload
                out["host"]["grads"] = out["host"].get("grads", 0) + _nbytes(mp.model_grad)
            if mp.is_copy:
                bucket = where(mp.main)
                bucket["main_params"] = bucket.get("main_params", 0) + _nbytes(mp.main)
            for value in domain.optimizer.state.get(mp.main, {}).values():
                if isinstance(value, Tensor):
                    bucket = where(value)
                    bucket["optimizer_state"] = bucket.get("optimizer_state", 0) + _nbytes(value)


def memory_categories(parts: OptimizerParts) -> dict[str, dict[str, int]]:
    """{"persistent", "host", "transient_now", "transient_peak"}: bytes per category, see
    [Note: memory report categories]."""
    out: dict[str, dict[str, int]] = {
        "persistent": dict.fromkeys(PERSISTENT_CATEGORIES, 0),
        "host": {},
        "transient_now": {},
        "transient_peak": {},
    }
    for chunk in parts.model_chunks:
        _chunk_categories(chunk, out)
    device = params_device([p for c in parts.model_chunks for p in c.engine.param_to_name], None)
    _optimizer_categories(parts, device, out)
    return out


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
    full_copy = sum(4 * mp.numel for mp in parts.main_params if is_half_grad(mp))
    window = parts.grad_upcast_window_numel
    copy = full_copy if window is None else peak_window_nbytes(parts.main_params, window)
    categories = memory_categories(parts)
    persistent = categories["persistent"]
    return OptimizerMemoryReport(
        owned_numel=owned,
        shard_numel=shard,
        main_param_nbytes=main_nbytes,
        state_nbytes=state_nbytes,
        scalar_state_nbytes=scalar_nbytes,
        param_buffer_nbytes=persistent["params"],
        grad_buffer_nbytes=persistent["grads"],
        grad_copy_nbytes=copy,
        grad_copy_saved_nbytes=full_copy - copy,
        strategy=parts.model_chunks[0].ddp_config.sharding.name,
        persistent=persistent,
        host=categories["host"],
        transient_now=categories["transient_now"],
        transient_peak=categories["transient_peak"],
    )
