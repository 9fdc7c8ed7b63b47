"""Config dataclasses from dicts and TOML files, and their field docs in `help()` (shared by
`DistributedDataParallelConfig` and `OptimizerConfig`)."""

from __future__ import annotations

import ast
import inspect
import itertools
import sys
import textwrap
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

T = TypeVar("T")


def dataclass_from_dict(cls: type[T], values: dict[str, Any]) -> T:
    """Build config dataclass `cls` from a mapping; unknown keys raise a ValueError listing the
    valid fields (shared by every megabuf config)."""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"megabuf: unknown {cls.__name__} field(s) {unknown}; valid fields: {sorted(known)}"
        )
    return cls(**values)


def dataclass_from_toml(
    cls: type[T], path: str | Path, table: str, *, top_level_fallback: bool
) -> T:
    """Load `[table]` of a TOML file into `cls` (the whole file if the table is absent and
    `top_level_fallback`, else the defaults); errors name the file and the table."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    section = data.get(table, data if top_level_fallback else {})
    try:
        return dataclass_from_dict(cls, dict(section))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"megabuf: bad [{table}] table in config file {path}: {exc}") from exc


def document_fields(cls: type[T]) -> type[T]:
    """Append each field's attribute docstring (the string literal right after the field) to the
    class docstring, so `help(cls)` shows what every field means. Without the source (a frozen
    build) the docstring is left as it is."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return cls
    body = tree.body[0].body  # type: ignore[attr-defined]
    lines = []
    for node, nxt in itertools.pairwise(body):
        doc = _string_literal(nxt)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and doc:
            default = ast.unparse(node.value) if node.value is not None else "required"
            lines.append(f"{node.target.id} = {default}")
            lines.extend("    " + line for line in inspect.cleandoc(doc).splitlines())
    if lines:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\nFields:\n\n" + "\n".join(lines)
    return cls


def _string_literal(node: ast.stmt) -> str | None:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        value = node.value.value
        return value if isinstance(value, str) else None
    return None
