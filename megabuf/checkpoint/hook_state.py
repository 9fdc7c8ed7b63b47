"""Communication-hook state in checkpoints: what `save_checkpoint` takes from each stateful hook
(here) and what `load_checkpoint` hands back to it (hook_load.py).

[Note: comm hook state in checkpoints]
A hook is *stateful* when it has `state_dict()` and `load_state_dict(state)`. `state_dict()`
returns exactly {"replicated": {key: Tensor | int | float | bool | str}, "per_rank": {key:
Tensor}, "layout": {key: int | str | list[int]}}; per-param keys are "<field>/<param name>"
with the names of `GradBucket.param_names`, so the state is in param space, not bucket layout.
Each chunk's hooks are saved under a *slot*: the chunk's scope (`stage<i>/`, `chunk<j>/`, as
for model entries) plus "dense", "expert", or "all" when one hook reduces both kinds. In a
slot, a per-param key is stored with the param's checkpoint name (expert params carry
`ep<r>/` at ep > 1), so each expert's keys are told apart and held only by the ranks of its
expert-dp group.
- replicated tensors go to DCP once per key (every holder hands the same value; DCP writes one
  copy). Before DCP writes, every holder's SHA-256 of the value is compared: values that
  differ across ranks raise on every rank naming the key and the ranks (one copy would
  silently win). Scalars and strings are stored in metadata.json (JSON, checksummed), so
  loading never unpickles hook state;
- per-rank tensors go to DCP under the saving rank ("<slot>/per_rank/<rank>/<key>");
- metadata.json lists, per slot, the hook's class, its layout, the ranks that held it, and
  every key with its param, shape, dtype and holders (the saving ranks that held it; left out
  when they are all the slot's ranks, as for every dense key, to keep the index small).
No process group, no object: any other value type raises naming the hook and the key.

At load, the hooks are registered already (their `setup` has run). Saved slots are matched
with this model's stateful hooks by slot name and class; see `load_checkpoint` for what
`strict_comm_hooks` does with slots on one side only or with another class. Each rank reads
only the keys of the params its hook reduces (and the keys that name no param), and the hook
gets them under its own keys. Replicated state is handed back as saved at any dp size. If the
world size is the same and every rank needs exactly the per-rank keys it saved, each rank gets
its own values (`per_rank_merged=False`, `per_rank_counts` all 1: the continuation is bitwise
the uninterrupted run's); otherwise (another dp size) `per_rank[key]` is the sum over the saved
holders of that key, in rank order (fp32 for half dtypes), with `per_rank_counts[key]` their
number (`per_rank_merged=True`), and the hook decides what that means or raises. Merging holds
every holder's copy of this rank's per-rank keys at once, transiently. Tensors arrive on the
device of the hook's buckets; `layout` comes back as saved (JSON: lists stay lists). A hook
raising a ValueError in `load_state_dict` (e.g. a layout it is tied to changed) fails the load
on every rank with its message, before the model changes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megabuf.comm_hooks.contract import hook_name
from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.param_groups import scope_prefix
from megabuf.transport.collectives import Collectives

STATE_KEYS = ("replicated", "per_rank", "layout")
SCALARS = (bool, int, float, str)
HookIndex = dict[str, dict[str, Any]]  # slot -> its metadata.json entry


@dataclass(frozen=True)
class Slot:
    """One chunk's stateful hook, as the checkpoint names it."""

    name: str  # chunk scope + "dense" | "expert" | "all"
    hook: Any
    scoped: dict[str, str]  # local param name -> checkpoint name, params this hook reduces
    device: torch.device

    def local_names(self) -> dict[str, str]:
        return {scoped: local for local, scoped in self.scoped.items()}

    def split(self, key: str) -> tuple[str, str | None]:
        """(key as stored, checkpoint name of the param it names or None)."""
        for i, char in enumerate(key):
            if char == "/" and key[i + 1 :] in self.scoped:
                scoped = self.scoped[key[i + 1 :]]
                return f"{key[: i + 1]}{scoped}", scoped
        return key, None


def class_name(hook: object) -> str:
    return f"{type(hook).__module__}.{type(hook).__qualname__}"


def is_stateful(hook: object) -> bool:
    return callable(getattr(hook, "state_dict", None)) and callable(
        getattr(hook, "load_state_dict", None)
    )


def _chunk_hooks(chunk: DistributedDataParallel) -> dict[str, Any]:
    """kind ("dense" | "expert" | "all") -> hook registered on this chunk."""
    hooks = chunk.comm_hooks()
    if len(hooks) == 2 and hooks["dense"] is hooks["expert"]:
        return {"all": hooks["dense"]}
    return hooks


def registered_hooks(chunks: Sequence[DistributedDataParallel]) -> dict[str, Any]:
    """Slot name -> hook, every registered hook (stateful or not) of every chunk."""
    return {
        scope_prefix(chunk, i, len(chunks), False) + kind: hook
        for i, chunk in enumerate(chunks)
        for kind, hook in _chunk_hooks(chunk).items()
    }


def slot_prefix(name: str) -> str:
    """The chunk scope of a slot name ("" or "stage<i>/...chunk<j>/")."""
    head, sep, _ = name.rpartition("/")
    return head + sep


def hook_slots(chunks: Sequence[DistributedDataParallel]) -> list[Slot]:
    """Every stateful hook of every chunk, with the params it reduces on this rank."""
    slots = []
    for i, chunk in enumerate(chunks):
        for kind, hook in _chunk_hooks(chunk).items():
            if not is_stateful(hook):
                continue
            views = [
                v
                for g in chunk.engine.all_bucket_groups
                if g.comm_hook is hook
                for v in g.hook_buckets
            ]
            scoped = {
                param: scope_prefix(chunk, i, len(chunks), view.expert) + param
                for view in views
                for param in view.param_names
            }
            name = scope_prefix(chunk, i, len(chunks), False) + kind
            slots.append(Slot(name, hook, scoped, views[0].data.device))
    return slots


# ---- save ---------------------------------------------------------------------------------------
def _checked_state(slot: Slot) -> dict[str, Any]:
    state = slot.hook.state_dict()
    rank = Collectives.rank()
    who = f"megabuf: comm hook {hook_name(slot.hook)} ({slot.name} buffers, rank {rank})"
    if not isinstance(state, dict) or set(state) != set(STATE_KEYS):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{who}: state_dict() must return a dict with exactly the keys {list(STATE_KEYS)}, "
            f"got {got} ([Note: comm hook state in checkpoints])"
        )
    allowed = {"replicated": (Tensor, *SCALARS), "per_rank": (Tensor,), "layout": (int, str, list)}
    for part, types in allowed.items():
        for key, value in state[part].items():
            bad_list = isinstance(value, list) and not all(type(v) is int for v in value)
            if not isinstance(key, str) or not isinstance(value, types) or bad_list:
                names = ", ".join(t.__name__ for t in types)
                raise ValueError(
                    f"{who}: state_dict()[{part!r}][{key!r}] is of type {type(value).__name__}; a "
                    f"checkpoint holds only {names} there (string keys; never a process group "
                    "or another object)"
                )
    return state


def _digest(value: Tensor) -> str:
    flat = value.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def _tensor_entry(value: Tensor, param: str | None) -> dict[str, Any]:
    return {"param": param, "shape": list(value.shape), "dtype": str(value.dtype).split(".")[-1]}


def hook_save_state(
    chunks: Sequence[DistributedDataParallel],
) -> tuple[dict[str, Tensor], HookIndex]:
    """(what this rank hands DCP under "comm_hooks", this rank's index of it); see [Note: comm
    hook state in checkpoints]. Raises ValueError for a state that cannot be saved."""
    rank = Collectives.rank()
    entries: dict[str, Tensor] = {}
    index: HookIndex = {}
    for slot in hook_slots(chunks):
        state = _checked_state(slot)
        replicated: dict[str, Any] = {}
        for key, value in state["replicated"].items():
            stored, param = slot.split(key)
            if isinstance(value, Tensor):
                entries[f"{slot.name}/replicated/{stored}"] = value.detach()
                replicated[stored] = {**_tensor_entry(value, param), "sha256": _digest(value)}
            else:
                replicated[stored] = {"param": param, "value": value}
        per_rank: dict[str, Any] = {}
        for key, value in state["per_rank"].items():
            stored, param = slot.split(key)
            entries[f"{slot.name}/per_rank/{rank}/{stored}"] = value.detach()
            per_rank[stored] = _tensor_entry(value, param)
        index[slot.name] = {
            "class": class_name(slot.hook), "hook": hook_name(slot.hook),
            "layout": dict(state["layout"]), "replicated": replicated, "per_rank": per_rank,
        }  # fmt: skip
    return entries, index


def gathered_hook_state(
    chunks: Sequence[DistributedDataParallel],
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """`hook_save_state`, with an error kept for `agreed_hook_index` (raised on every rank after
    the save's all-gather, so no rank is left waiting in it)."""
    try:
        entries, index = hook_save_state(chunks)
    except Exception as exc:  # a user's hook may raise anything: report it everywhere
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        return {}, {"index": {}, "error": f"{message} (rank {Collectives.rank()})"}
    return entries, {"index": index, "error": None}


def agreed_hook_index(everyone: list[dict[str, Any]]) -> HookIndex:
    """Every rank's `gathered_hook_state` record -> metadata.json's "comm_hooks"; the same
    ValueError on every rank if any rank's hook state cannot be saved."""
    errors = [record["error"] for record in everyone if record["error"] is not None]
    if errors:
        raise ValueError(errors[0])
    return merge_hook_indices([record["index"] for record in everyone])


def merge_hook_indices(everyone: list[HookIndex]) -> HookIndex:
    """Every rank's hook index (rank order) -> metadata.json's "comm_hooks". Run on every rank
    with the same input, so each raises the same ValueError where holders disagree."""
    merged: HookIndex = {}
    for rank, index in enumerate(everyone):
        for name, mine in index.items():
            slot = merged.setdefault(
                name, {**{k: mine[k] for k in ("class", "hook", "layout")}, "ranks": [],
                       "replicated": {}, "per_rank": {}},
            )  # fmt: skip
            for field in ("class", "layout"):
                if slot[field] != mine[field]:
                    raise ValueError(
                        f"megabuf: save_checkpoint: the comm hooks of slot {name!r} differ "
                        f"across ranks: {field} {slot[field]!r} on rank {slot['ranks'][0]}, "
                        f"{mine[field]!r} on rank {rank}; every rank must register the same hook"
                    )
            slot["ranks"].append(rank)
            for part in ("replicated", "per_rank"):
                for key, entry in mine[part].items():
                    _add_holder(slot[part], key, entry, rank, f"{name!r} {part}")
    for slot in merged.values():
        for entry in [*slot["replicated"].values(), *slot["per_rank"].values()]:
            entry.pop("sha256", None)
            if entry["holders"] == slot["ranks"]:
                del entry["holders"]
    return merged


def holders(slot: dict[str, Any], entry: dict[str, Any]) -> list[int]:
    """The saving ranks that held a key (of a slot's metadata.json entry)."""
    return entry.get("holders", slot["ranks"])  # type: ignore[no-any-return]


def _canonical(entry: dict[str, Any]) -> str:
    """As metadata.json will hold it (tells 1 from True and 1.0; NaN equals NaN)."""
    return json.dumps(entry, sort_keys=True)


def _add_holder(
    entries: dict[str, Any], key: str, entry: dict[str, Any], rank: int, where: str
) -> None:
    if key not in entries:
        entries[key] = {**entry, "holders": [rank]}
        return
    held = entries[key]
    first = held["holders"][0]
    if _canonical({k: v for k, v in held.items() if k != "holders"}) != _canonical(entry):

        def show(e: dict[str, Any]) -> str:
            return str({k: v for k, v in e.items() if k not in ("holders", "param")})

        raise ValueError(
            f"megabuf: save_checkpoint: comm hook state {key!r} (slot {where}) differs across "
            f"the ranks that hold it: rank {first} has {show(held)}, rank {rank} has "
            f"{show(entry)}. Replicated state must be identical on every rank holding it "
            "(put rank-local values under 'per_rank')"
        )
    held["holders"].append(rank)
