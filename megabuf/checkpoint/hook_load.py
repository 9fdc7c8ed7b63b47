"""Loading communication-hook state: which saved keys this rank reads, into which hook, and in
which form ([Note: comm hook state in checkpoints] in hook_state.py)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabuf.checkpoint.hook_state import (
    HookIndex,
    Slot,
    class_name,
    holders,
    hook_slots,
    registered_hooks,
    slot_prefix,
)
from megabuf.comm_hooks.contract import hook_name
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.param_groups import scope_prefix
from megabuf.transport.collectives import Collectives


@dataclass
class SlotLoad:
    """What one rank reads for one of its hooks."""

    slot: Slot
    saved: dict[str, Any]  # the slot's metadata.json entry
    replicated: dict[str, str]  # local key -> stored key (tensors and scalars)
    per_rank: dict[str, str]  # local key -> stored key

    def own(self, rank: int) -> bool:
        """This rank saved exactly the per-rank keys it needs now."""
        saved_here = {
            k for k, e in self.saved["per_rank"].items() if rank in holders(self.saved, e)
        }
        return saved_here == set(self.per_rank.values())


def _local_key(local_names: dict[str, str], stored: str, param: str | None) -> str | None:
    """The hook's own key for a stored key, or None if it names a param this rank lacks."""
    if param is None:
        return stored
    local = local_names.get(param)
    return None if local is None else stored[: len(stored) - len(param)] + local


def plan_hook_load(
    chunks: Sequence[DistributedDataParallel], saved: HookIndex, root: Any, strict: bool
) -> list[SlotLoad]:
    """Match the saved slots of this rank's chunks with its stateful hooks; raise (strict) or
    warn for a slot on one side only or a hook of another class."""
    prefixes = {scope_prefix(c, i, len(chunks), False) for i, c in enumerate(chunks)}
    mine = {name: entry for name, entry in saved.items() if slot_prefix(name) in prefixes}
    registered = registered_hooks(chunks)
    slots = {s.name: s for s in hook_slots(chunks)}
    problems: list[tuple[str, str, str]] = []  # (what, what to do, what strict=False does)
    plans = []
    for name, entry in mine.items():
        hook = slots.get(name)
        saved_by = f"comm hook {entry['hook']} ({entry['class']})"
        if hook is None:
            there = registered.get(name)
            has = (
                f"comm hook {hook_name(there)} (stateless)" if there is not None else "no comm hook"
            )
            problems.append((
                f"it holds state of {saved_by} for the {name!r} buffers, and this model has "
                f"{has} there", "register that hook (before load_checkpoint) to resume it",
                "its state is dropped",
            ))  # fmt: skip
        elif class_name(hook.hook) != entry["class"]:
            problems.append((
                f"its {name!r} hook state was saved by {saved_by}, and this model's hook there is "
                f"{class_name(hook.hook)}", "register the hook it was saved with",
                f"{hook_name(hook.hook)} keeps its initial state",
            ))  # fmt: skip
        else:
            plans.append(_slot_load(hook, entry))
    for name, slot in slots.items():
        if name not in mine:
            problems.append((
                f"this model's comm hook {hook_name(slot.hook)} ({class_name(slot.hook)}) on the "
                f"{name!r} buffers has state, and the checkpoint holds none for it (saved "
                "without that hook, e.g. before it was added)", "load a checkpoint saved with it",
                "it keeps its initial state",
            ))  # fmt: skip
    where = f"megabuf: load_checkpoint {root} (rank {Collectives.rank()})"
    option = "strict_comm_hooks=False"
    if problems and strict:
        told = [
            f"{what}: {fix}, or pass {option} (then {relaxed})" for what, fix, relaxed in problems
        ]
        raise ValueError(f"{where}: " + "; ".join(told))
    for what, _, relaxed in problems:
        warnings.warn(f"{where}: {what}; {relaxed} ({option})", RuntimeWarning, stacklevel=3)
    return plans


def _slot_load(slot: Slot, saved: dict[str, Any]) -> SlotLoad:
    parts: dict[str, dict[str, str]] = {"replicated": {}, "per_rank": {}}
    local_names = slot.local_names()
    for part, picked in parts.items():
        for stored, entry in saved[part].items():
            local = _local_key(local_names, stored, entry["param"])
            if local is not None:
                picked[local] = stored
    return SlotLoad(slot, saved, parts["replicated"], parts["per_rank"])


def _empty(entry: dict[str, Any], device: torch.device) -> Tensor:
    return torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device=device)


def hook_template(plans: list[SlotLoad], merged: bool) -> dict[str, Tensor]:
    """The "comm_hooks" part of the state handed to dcp.load: only what this rank needs."""
    rank, template = Collectives.rank(), {}
    for plan in plans:
        name, device = plan.slot.name, plan.slot.device
        for stored in plan.replicated.values():
            entry = plan.saved["replicated"][stored]
            if "value" not in entry:
                template[f"{name}/replicated/{stored}"] = _empty(entry, device)
        for stored in plan.per_rank.values():
            entry = plan.saved["per_rank"][stored]
            for holder in holders(plan.saved, entry) if merged else [rank]:
                template[f"{name}/per_rank/{holder}/{stored}"] = _empty(entry, device)
    return template


def load_hook_states(plans: list[SlotLoad], template: dict[str, Tensor], merged: bool) -> None:
    """Hand each hook its state (after dcp.load filled `template`)."""
    rank = Collectives.rank()
    for plan in plans:
        name, saved = plan.slot.name, plan.saved
        replicated = {}
        for local, stored in plan.replicated.items():
            entry = saved["replicated"][stored]
            scalar = "value" in entry
            replicated[local] = (
                entry["value"] if scalar else template[f"{name}/replicated/{stored}"]
            )
        per_rank, counts = {}, {}
        for local, stored in plan.per_rank.items():
            held = holders(saved, saved["per_rank"][stored]) if merged else [rank]
            per_rank[local] = _sum([template[f"{name}/per_rank/{h}/{stored}"] for h in held])
            counts[local] = len(held)
        try:
            plan.slot.hook.load_state_dict({
                "replicated": replicated, "per_rank": per_rank, "layout": dict(saved["layout"]),
                "per_rank_merged": merged, "per_rank_counts": counts,
            })  # fmt: skip
        except ValueError as exc:
            raise ValueError(
                f"megabuf: load_checkpoint: comm hook {hook_name(plan.slot.hook)} ({name!r} "
                f"buffers, rank {rank}) refused its saved state: {exc}"
            ) from exc


def _sum(values: list[Tensor]) -> Tensor:
    """In rank order; half-precision values are summed in fp32, then rounded once."""
    if len(values) == 1:
        return values[0]
    wide = values[0].is_floating_point() and values[0].element_size() < 4
    total = values[0].float() if wide else values[0].clone()
    for value in values[1:]:
        total += value
    return total.to(values[0].dtype)
