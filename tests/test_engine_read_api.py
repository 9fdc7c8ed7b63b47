"""[Note: the engine's read API] (megabuf/core/engine.py): code outside the engine layer reads an
`Engine` only through the documented names, and the engine has no other public member. Parsed
with `ast`, as tests/test_public_surface.py does; no process group."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# the names, grouped as in engine.py's docstring and docs/ARCHITECTURE.md
ENGINE_READ_API = {
    # what it wraps and how it was built
    "module", "config", "disable_bucketing",
    # topology
    "rank", "topology", "process_groups", "collectives", "device",
    # params and plan
    "plan", "param_to_name", "sparse_grads",
    # buffers and groups by kind (Megatron's names)
    "buffers", "dense_buffers", "expert_parallel_buffers",
    "bucket_groups", "expert_parallel_bucket_groups", "all_bucket_groups",
    # the ledger
    "memory_ledger",
    # the parts a step drives
    "sync", "param_side", "hooks", "gather_hooks", "auto", "replan_listeners",
    # residency: the engine's own acts ([Note: offloaded engine])
    "offloaded", "offload", "restore", "check_resident", "watch_outputs",
    # what the wrapper's doors call
    "before_forward", "zero_grad_buffer", "scale_gradients", "broadcast_params",
    "broadcast_module_buffers", "register_comm_hook", "enable_timeline", "rebucket",
}  # fmt: skip

# the engine layer itself may read its parts directly
ENGINE_LAYER_FILES = {
    "megabuf/core/engine.py",
    "megabuf/core/wiring.py",
    "megabuf/core/pickling.py",
}


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _engine_reads(path: Path) -> list[tuple[str, int]]:
    """(name, line) of every `X.engine.NAME` and `engine.NAME` in `path` (not
    `megabuf.core.engine.NAME`, the module; not under megabuf/bench or comm_hooks, whose local
    `engine` is another object)."""
    tree = ast.parse(path.read_text())
    local_ok = not ({"bench", "comm_hooks"} & set(path.parts))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        attr = isinstance(v, ast.Attribute) and v.attr == "engine"
        if attr and _root_name(v) == "megabuf":  # the module megabuf.core.engine
            continue
        if attr or (local_ok and isinstance(v, ast.Name) and v.id == "engine"):
            out.append((node.attr, node.lineno))
    return out


def _outside_files() -> list[Path]:
    files = sorted((REPO / "megabuf").rglob("*.py")) + sorted((REPO / "tests").glob("*.py"))
    return [p for p in files if str(p.relative_to(REPO)) not in ENGINE_LAYER_FILES]


def test_code_outside_the_engine_reads_only_the_read_api() -> None:
    stray = [
        f"{p.relative_to(REPO)}:{line}: engine.{name}"
        for p in _outside_files()
        for name, line in _engine_reads(p)
        if name not in ENGINE_READ_API
    ]
    assert stray == [], "read through the engine's read API ([Note: the engine's read API])"


def test_the_engine_has_no_public_member_beyond_the_read_api() -> None:
    from megabuf.core.engine import Engine

    source = (REPO / "megabuf" / "core/engine.py").read_text()
    engine_class = next(
        c for c in ast.walk(ast.parse(source)) if isinstance(c, ast.ClassDef) and c.name == "Engine"
    )
    assigned = {  # `self.NAME = ...` in any of its methods
        t.attr
        for node in ast.walk(engine_class)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    members = {n for n in vars(Engine) if not n.startswith("_")} | assigned
    public = {n for n in members if not n.startswith("_")}
    assert public == ENGINE_READ_API


def test_the_wiring_is_not_written_from_outside() -> None:
    """A read-API name backed by the engine's wiring refuses a write ([Note: wired once,
    swapped whole] in megabuf/core/wiring.py)."""
    import pytest

    from megabuf.core.engine import Engine

    engine = Engine.__new__(Engine)
    with pytest.raises(AttributeError, match="read-only"):
        engine.sync = None  # type: ignore[assignment,misc]


def _written_chains(path: Path) -> list[tuple[str, int]]:
    """Every assignment target that is an attribute of an attribute (`a.b.c = ...`) or of a
    local (`x.y = ...`, not `self.y`), as dotted text with its line."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            if isinstance(t, ast.Attribute) and not (
                isinstance(t.value, ast.Name) and t.value.id == "self"
            ):
                out.append((ast.unparse(t), node.lineno))
    return out


def test_the_engine_patches_nothing_into_its_parts() -> None:
    """[Note: wired once, swapped whole] in megabuf/core/wiring.py: the engine patches nothing
    into its parts (the counted arrivals too are the group's own switch, `count_arrivals`)."""
    writes = [
        f"{name}:{line}: {chain}"
        for name in ("core/engine.py", "core/wiring.py", "core/assembly.py")
        for chain, line in _written_chains(REPO / "megabuf" / name)
    ]
    assert writes == []


# test doubles: a counting spy on the bookkeeping, a faked auto warm-up measurement
TEST_SPIES = ("model.engine.sync.on_grad", ".auto.measure")


def test_nothing_outside_the_engine_writes_into_it() -> None:
    """No `X.engine.Y = ...` / `X.engine.part.Z = ...` in library code or tests (the weights
    package asks `engine.offload(record)`; [Note: offloaded engine]); a local named `engine` is
    one under megabuf/bench and comm_hooks, where it is another object."""
    writes = []
    for p in _outside_files():
        local_ok = not ({"bench", "comm_hooks"} & set(p.parts)) and p.name != Path(__file__).name
        for chain, line in _written_chains(p):
            inner = ".engine." in chain and not chain.startswith("megabuf.core.engine.")
            if (inner or (local_ok and chain.startswith("engine."))) and not (
                chain.endswith(TEST_SPIES)
            ):
                writes.append(f"{p.relative_to(REPO)}:{line}: {chain}")
    assert writes == []
