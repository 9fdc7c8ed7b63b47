#!/usr/bin/env python3
"""Move megabuf's top-level modules into one package per import layer, and rewrite every reference.

Usage (from anywhere inside the repository; needs git):
    python .ci/relayer.py --check   # print the plan: moves, packages, files to rewrite, warnings
    python .ci/relayer.py           # do it: `git mv`, new `__init__.py` files, rewritten references

Edit MOVES / STAY_AT_ROOT / PACKAGES below; the script is deterministic and idempotent (a second
run finds nothing to do). It fails, naming the module, when a top-level module of megabuf/ is in
neither MOVES nor STAY_AT_ROOT, when a mapped module exists at neither its old nor its new place,
or when a package name would collide with a module of the same name.

What it rewrites, in every tracked text file under REWRITE_ROOTS (never in this script):
  - dotted paths `megabuf.old[.attr]`: imports, `import megabuf.old as x`, mock patch targets,
    logger names, `python -m megabuf.old`, docs;
  - `from megabuf[.pkg] import old` (a moved module imported from its package) into one line per
    new package;
  - file paths `megabuf/old.py`, and in Python files a quoted path relative to megabuf/ ("old.py",
    as tests/test_devices.py's allowlist writes them);
  - relative imports (`from .x import y`) inside megabuf/, made absolute first.
What it cannot rewrite is printed as a warning: bare file names in prose (`old.py` without the
`megabuf/` prefix) and dynamic paths (`f"megabuf.{name}"`, `"megabuf" / "old.py"`).
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

# old dotted module -> new dotted module. One package per import layer (tests/test_import_graph.py,
# [Note: import layers]); a key may also be a submodule of an existing package.
MOVES: dict[str, str] = {
    # pure: layout math and the records the config and the plan are made from
    "megabuf.layout": "megabuf.pure.layout",
    "megabuf.owners": "megabuf.pure.owners",
    "megabuf.hybrid": "megabuf.pure.hybrid",
    "megabuf.bucket_planner": "megabuf.pure.bucket_planner",
    "megabuf.timeline": "megabuf.pure.timeline",
    "megabuf.overlap": "megabuf.pure.overlap",
    "megabuf.config_fields": "megabuf.pure.config_fields",
    # transport: every torch.distributed call, process groups, devices
    "megabuf.collectives": "megabuf.transport.collectives",
    "megabuf.comm_records": "megabuf.transport.comm_records",
    "megabuf.worker_refs": "megabuf.transport.worker_refs",
    "megabuf.process_groups": "megabuf.transport.process_groups",
    "megabuf.distributed_init": "megabuf.transport.distributed_init",
    "megabuf.devices": "megabuf.transport.devices",
    "megabuf.dist_autograd": "megabuf.transport.dist_autograd",
    "megabuf.torch_compat": "megabuf.transport.torch_compat",
    "megabuf.collective_backends": "megabuf.transport.collective_backends",
    # planning: the one planner and the model's side of it
    "megabuf.plan": "megabuf.planning.plan",
    "megabuf.model_plan": "megabuf.planning.model_plan",
    "megabuf.replicas": "megabuf.planning.replicas",
    # buckets: the contiguous buffers and the bucket groups
    "megabuf.buffer": "megabuf.buckets.buffer",
    "megabuf.bucket_group": "megabuf.buckets.bucket_group",
    "megabuf.dispatch": "megabuf.buckets.dispatch",
    "megabuf.grad_math": "megabuf.buckets.grad_math",
    "megabuf.arrivals": "megabuf.buckets.arrivals",
    "megabuf.readiness": "megabuf.buckets.readiness",
    "megabuf.reductions": "megabuf.buckets.reductions",
    "megabuf.param_gather": "megabuf.buckets.param_gather",
    "megabuf.full_grads": "megabuf.buckets.full_grads",
    # sync: the grad and param syncs and the parts they drive
    "megabuf.grad_sync": "megabuf.sync.grad_sync",
    "megabuf.param_sync": "megabuf.sync.param_sync",
    "megabuf.backward_sync": "megabuf.sync.backward_sync",
    "megabuf.hooks": "megabuf.sync.hooks",
    "megabuf.grads": "megabuf.sync.grads",
    "megabuf.nan_check": "megabuf.sync.nan_check",
    "megabuf.microbatches": "megabuf.sync.microbatches",
    "megabuf.hook_registry": "megabuf.sync.hook_registry",
    "megabuf.sparse_grads": "megabuf.sync.sparse_grads",
    "megabuf.residency": "megabuf.sync.residency",
    # replan: bucket_size = "auto"
    "megabuf.autobucket": "megabuf.replan.autobucket",
    "megabuf.warmup": "megabuf.replan.warmup",
    "megabuf.sharded_replan": "megabuf.replan.sharded_replan",
    # core: the engine, built and wired once, and what acts on it whole
    "megabuf.assembly": "megabuf.core.assembly",
    "megabuf.wiring": "megabuf.core.wiring",
    "megabuf.engine": "megabuf.core.engine",
    "megabuf.pickling": "megabuf.core.pickling",
    "megabuf.join": "megabuf.core.join",
    # training: what a training loop calls on wrapped models
    "megabuf.finalize": "megabuf.training.finalize",
    "megabuf.reproducible": "megabuf.training.reproducible",
}

# Top-level modules users import or run by name (README, docs, examples, the console script).
STAY_AT_ROOT: tuple[str, ...] = (
    "megabuf",  # the package root: what a training script calls
    "megabuf.config",  # DistributedDataParallelConfig; docs cite megabuf/config.py
    "megabuf.ddp",  # DistributedDataParallel
    "megabuf.cli",  # the `megabuf` console script (pyproject.toml)
    "megabuf.inspect",  # `megabuf inspect`
)

# The docstring of each new package's __init__.py (no re-exports).
PACKAGES: dict[str, str] = {
    "megabuf.pure": (
        "Pure: layout math and the small records the config and the plan are made from (units,\n"
        "owners, the hybrid split, bucket boundaries, the strategy objects, the timeline). Sees\n"
        "numels, dtypes, sizes and names, never a process group or a parameter; tested without\n"
        "processes. The lowest layer ([Note: import layers], tests/test_import_graph.py)."
    ),
    "megabuf.transport": (
        "Transport: every torch.distributed call (`Collectives`), the process groups and their\n"
        "`Topology`, where tensors are allocated, and torch DDP's arguments mapped onto megabuf's."
    ),
    "megabuf.planning": (
        "Planning: the one planner (`build_plan`), `plan_model` from a module and a config,\n"
        "and the replica checks and param markers the planner reads."
    ),
    "megabuf.buckets": (
        "Buckets: the contiguous param-and-grad buffers and the bucket groups that reduce them\n"
        "(lifecycles, dispatch chains, arrivals, the two-level reduction)."
    ),
    "megabuf.sync": (
        "Sync: the grad sync and the param side of an engine, the autograd and module hooks that\n"
        "drive them, and the parts they own (exposed grads, NaN check, comm-hook registry, ZeRO-3\n"
        "param units, sparse grads, residency)."
    ),
    "megabuf.replan": (
        'Re-plan: `bucket_size = "auto"`: the warm-up measurement, the agreed plan and the\n'
        "rebuild (dense and sharded)."
    ),
    "megabuf.core": (
        "Core: `assemble`, the `Engine` it builds once and its `Wiring` record, and what acts on\n"
        "the engine whole"
        "(pickling and copying a wrapped model, uneven inputs under torch's `Join`)."
    ),
    "megabuf.training": (
        "Training: what a training loop calls on wrapped models between steps\n"
        "(`finalize_model_grads`, `verify_reproducible`)."
    ),
}

# Where references are rewritten (tracked files only; this script is skipped).
REWRITE_ROOTS: tuple[str, ...] = (
    "megabuf/",
    "tests/",
    "examples/",
    "docs/",
    "configs/",
    ".ci/",
    "README.md",
    "BENCHMARKS.md",
    "Makefile",
    "pyproject.toml",
)
TEXT_SUFFIXES = (".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ".json")


class RelayerError(RuntimeError):
    pass


def _git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True)
    return out.stdout


def _path(module: str) -> str:
    """`megabuf.a.b` -> `megabuf/a/b.py` (the module file, not a package)."""
    return module.replace(".", "/") + ".py"


def _rel(module: str) -> str:
    """`megabuf.a.b` -> `a/b.py`, the path relative to megabuf/."""
    return _path(module).removeprefix("megabuf/")


def _validate(repo: Path) -> list[tuple[str, str]]:
    """The moves still to do, in table order; raises on anything the table does not say."""
    root_modules = sorted(
        "megabuf." + p.stem for p in (repo / "megabuf").glob("*.py") if p.stem != "__init__"
    )
    unmapped = [m for m in root_modules if m not in MOVES and m not in STAY_AT_ROOT]
    if unmapped:
        raise RelayerError(
            f"relayer: top-level module(s) {', '.join(unmapped)} are in neither MOVES nor "
            "STAY_AT_ROOT in .ci/relayer.py; add each to the package of its import layer"
        )
    for new in sorted(set(MOVES.values())):
        package = new.rsplit(".", 1)[0]
        if (repo / _path(package)).exists() and package not in MOVES:
            raise RelayerError(
                f"relayer: package {package} (for {new}) collides with the module "
                f"{_path(package)}; choose another package name in MOVES"
            )
        if package not in PACKAGES and not (repo / package.replace(".", "/")).is_dir():
            raise RelayerError(f"relayer: new package {package} has no docstring in PACKAGES")
    for old in MOVES:
        if old.split(".")[-1] in {n.split(".")[1] for n in MOVES.values()}:
            raise RelayerError(f"relayer: {old}'s name is also a new package's; rename one")
    pending = []
    for old, new in MOVES.items():
        old_there, new_there = (repo / _path(old)).exists(), (repo / _path(new)).exists()
        if old_there and new_there:
            raise RelayerError(f"relayer: both {_path(old)} and {_path(new)} exist; merge by hand")
        if not old_there and not new_there:
            raise RelayerError(
                f"relayer: mapped module {old} exists neither at {_path(old)} nor at "
                f"{_path(new)}; update its row in MOVES"
            )
        if old_there:
            pending.append((old, new))
    return pending


def _new_packages(repo: Path) -> list[str]:
    packages = sorted({new.rsplit(".", 1)[0] for new in MOVES.values()})
    return [p for p in packages if not (repo / p.replace(".", "/") / "__init__.py").exists()]


def _init_text(package: str) -> str:
    doc = PACKAGES[package]
    return f'"""{doc}\n"""\n' if "\n" in doc else f'"""{doc}"""\n'


def _alt(names: list[str]) -> str:
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))


def _make_rewriter() -> tuple[object, ...]:
    dotted = re.compile(rf"(?<![\w.])({_alt(list(MOVES))})(?!\w)")
    paths = {_path(o): _path(n) for o, n in MOVES.items()}
    path_re = re.compile(rf"(?<!\w)({_alt(list(paths))})(?!\w)")
    rels = {_rel(o): _rel(n) for o, n in MOVES.items()}
    rel_re = re.compile(rf"""(?<=["'])({_alt(list(rels))})(?=["'])""")
    return dotted, paths, path_re, rels, rel_re


def _rels() -> dict[str, str]:
    return {_rel(o): _rel(n) for o, n in MOVES.items()}


def _unique_rels(repo: Path) -> dict[str, str]:
    """Moved top-level files whose name no other megabuf file has: `old.py` -> `pkg/old.py`."""
    names = [p.name for p in (repo / "megabuf").rglob("*.py")]
    return {
        _rel(o): _rel(n)
        for o, n in MOVES.items()
        if o.count(".") == 1 and names.count(_rel(o)) == 1
    }


FROM_IMPORT = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<pkg>megabuf(?:\.\w+)*) import "
    r"(?:\((?P<paren>[^)]*)\)|(?P<flat>[^\n#(]+?))[ \t]*$",
    re.MULTILINE,
)


def _split_from_import(match: re.Match[str]) -> str:
    """`from megabuf import a, b` where a moved: one import line per package the names live in."""
    pkg, indent = match["pkg"], match["indent"]
    body = match["paren"] if match["paren"] is not None else match["flat"]
    names = [n.strip() for n in body.replace("\n", " ").split(",") if n.strip()]
    groups: dict[str, list[str]] = {}
    for name in names:
        module = f"{pkg}.{name.split(' as ')[0].strip()}"
        target = MOVES[module].rsplit(".", 1)[0] if module in MOVES else pkg
        groups.setdefault(target, []).append(name)
    if list(groups) == [pkg]:
        return match[0]
    return "\n".join(f"{indent}from {p} import {', '.join(ns)}" for p, ns in groups.items())


RELATIVE = re.compile(
    r"^(?P<indent>[ \t]*)from (?P<dots>\.+)(?P<rest>[\w.]*) import ", re.MULTILINE
)


def _absolute_relative_imports(text: str, module: str, is_package: bool) -> str:
    """Relative imports of a megabuf module made absolute (from its old place)."""
    base = module.split(".") if is_package else module.split(".")[:-1]

    def fix(m: re.Match[str]) -> str:
        up = len(m["dots"]) - 1
        parts = base[: len(base) - up] + ([m["rest"]] if m["rest"] else [])
        return f"{m['indent']}from {'.'.join(parts)} import "

    return RELATIVE.sub(fix, text)


def rewrite(text: str, is_python: bool, ticked: dict[str, str]) -> str:
    dotted, paths, path_re, rels, rel_re = _make_rewriter()
    if is_python:
        text = FROM_IMPORT.sub(_split_from_import, text)
    text = dotted.sub(lambda m: MOVES[m[1]], text)  # type: ignore[attr-defined]
    text = path_re.sub(lambda m: paths[m[1]], text)  # type: ignore[attr-defined,index]
    if is_python:
        text = rel_re.sub(lambda m: rels[m[1]], text)  # type: ignore[attr-defined,index]
    if ticked and not is_python:  # `old.py` in backticks: the docs cite files relative to megabuf/
        tick_re = re.compile(rf"(?<=`)({_alt(list(ticked))})(?=`)")
        text = tick_re.sub(lambda m: ticked[m[1]], text)
    return text


def _tracked_text_files(repo: Path) -> list[str]:
    files = _git(repo, "ls-files", "-z").split("\0")
    out = []
    for f in sorted(files):
        if not f or f == ".ci/relayer.py" or not (repo / f).is_file():
            continue
        if not any(f == r or f.startswith(r) for r in REWRITE_ROOTS):
            continue
        if f.endswith(TEXT_SUFFIXES) or Path(f).name in ("Makefile", "run"):
            out.append(f)
    return out


def _warnings(repo: Path, files: list[str], ticked: dict[str, str]) -> list[str]:
    """References the script leaves alone: bare file names in prose and dynamic paths."""
    bare = re.compile(rf"(?<![\w/.])({_alt([_rel(o) for o in MOVES])})(?!\w)")
    dynamic = re.compile(rf"""megabuf\.\{{|["']megabuf["']\s*/\s*["']({_alt(list(_rels()))})""")
    out = []
    for f in files:
        for lineno, line in enumerate((repo / f).read_text().splitlines(), 1):
            hits = [m[1] for m in bare.finditer(line)]
            if f.endswith(".md"):
                hits = [h for h in hits if f"`{h}`" not in line or h not in ticked]
            if f.endswith(".py"):  # quoted "old.py" in Python is rewritten; prose mentions are not
                hits = [h for h in hits if f'"{h}"' not in line and f"'{h}'" not in line]
            if hits:
                out.append(f"{f}:{lineno}: bare file name(s) {', '.join(hits)}")
            if dynamic.search(line):
                out.append(f"{f}:{lineno}: dynamic megabuf path: {line.strip()[:90]}")
    return out


def _module_of(path: str) -> tuple[str, bool]:
    is_package = path.endswith("/__init__.py")
    dotted = path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    return dotted, is_package


def _tidy_imports(repo: Path, files: list[str]) -> None:
    """Longer module paths re-sort and re-wrap imports: ruff's isort fix and formatter, as the
    Makefile's lint runs them; comment and docstring lines pushed over LINE_LENGTH are wrapped;
    what is still too long is printed for a hand."""
    if not files:
        return
    ruff = repo / ".venv" / "bin" / "ruff"
    exe = str(ruff) if ruff.exists() else shutil.which("ruff")
    if exe is None:
        print("warn  ruff not found: run `ruff check --select I --fix` and `ruff format` by hand")
    else:
        subprocess.run([exe, "check", "-q", "--select", "I", "--fix", *files], cwd=repo)
        subprocess.run([exe, "format", "-q", *files], cwd=repo, check=False)
    for f in files:
        text = (repo / f).read_text()
        wrapped = _wrap_prose(text)
        if wrapped != text:
            (repo / f).write_text(wrapped)
    if exe is not None:
        args = ["check", "-q", "--select", "E501", "--output-format", "concise", *files]
        left = subprocess.run([exe, *args], cwd=repo, capture_output=True, text=True).stdout
        for line in left.splitlines():
            print(f"warn  {line}: wrap it by hand")


LINE_LENGTH = 100
PROSE_START = ('"""', "- ", "* ", "|", "[Note", ">>>")


def _prose_lines(text: str) -> set[int]:
    """0-based numbers of the lines holding only a comment or docstring text."""
    out: set[int] = set()
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    starts = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT and tok.line.lstrip().startswith("#"):
            out.add(tok.start[0] - 1)
        elif tok.type == tokenize.STRING and tok.string.startswith('"""'):
            alone = (i == 0 or tokens[i - 1].type in starts) and (
                i + 1 < len(tokens) and tokens[i + 1].type == tokenize.NEWLINE
            )
            if alone:
                out.update(range(tok.start[0] - 1, tok.end[0]))
    return out


def _lead(line: str) -> str:
    match = re.match(r"^(\s*(?:# )?)", line)
    return match.group(1) if match else ""


def _wrap_prose(text: str) -> str:
    """Comment and docstring lines over LINE_LENGTH: the overflow moves to the start of the next
    line of the same paragraph, or onto a new line at the same indent (a bullet's: two more)."""
    try:
        prose = _prose_lines(text)
    except (tokenize.TokenError, SyntaxError):
        return text
    src = text.split("\n")
    is_prose = [i in prose for i in range(len(src))]
    for start in sorted((i for i in prose if len(src[i]) > LINE_LENGTH), reverse=True):
        i = start
        while i < len(src) and is_prose[i] and len(src[i]) > LINE_LENGTH:
            line, lead = src[i], _lead(src[i])
            if src[i].lstrip().startswith("#") and set(line[LINE_LENGTH:]) == {"-"}:
                src[i] = line[:LINE_LENGTH]  # a `# ---- title ----` rule: shorten the rule
                break
            cut = line.rfind(" ", 0, LINE_LENGTH + 1)
            if cut <= len(lead):
                break
            head, tail = line[:cut].rstrip(), line[cut + 1 :]
            nxt = src[i + 1] if i + 1 < len(src) else ""
            indent = lead + ("  " if line[len(lead) :].startswith("- ") else "")
            joins = (
                (is_prose[i + 1] if i + 1 < len(src) else False)
                and '"""' not in tail
                and _lead(nxt) == indent
                and nxt.strip() != ""
            )
            joins = joins and not nxt.strip().startswith(PROSE_START)
            src[i] = head
            if joins:
                src[i + 1] = indent + tail + " " + nxt[len(indent) :]
            else:
                src.insert(i + 1, indent + tail)
                is_prose.insert(i + 1, True)
            i += 1
    return "\n".join(src)


def run(repo: Path, check: bool, verbose: bool = False) -> int:
    pending = _validate(repo)
    packages = _new_packages(repo)
    for old, new in pending:
        print(f"move  {_path(old)} -> {_path(new)}")
    for package in packages:
        print(f"new   {package.replace('.', '/')}/__init__.py")
    if not check:
        for package in packages:
            init = repo / package.replace(".", "/") / "__init__.py"
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(_init_text(package))
            _git(repo, "add", str(init.relative_to(repo)))
        for old, new in pending:
            text = (repo / _path(old)).read_text()
            fixed = _absolute_relative_imports(text, old, is_package=False)
            if fixed != text:
                (repo / _path(old)).write_text(fixed)
            _git(repo, "mv", _path(old), _path(new))
    files = _tracked_text_files(repo)
    ticked = _unique_rels(repo)
    changed, py_changed = 0, [_path(new) for _, new in pending]
    for f in files:
        text = (repo / f).read_text()
        new_text = text
        if f.startswith("megabuf/") and f.endswith(".py"):
            module, is_package = _module_of(f)
            new_text = _absolute_relative_imports(new_text, module, is_package)
        new_text = rewrite(new_text, f.endswith(".py"), ticked)
        if new_text != text:
            changed += 1
            py_changed.extend([f] if f.endswith(".py") else [])
            print(f"edit  {f}")
            if not check:
                (repo / f).write_text(new_text)
    if not check:
        _tidy_imports(repo, sorted(set(py_changed)))
    warnings = _warnings(repo, files, ticked)
    for warning in warnings if verbose else [w for w in warnings if "dynamic" in w]:
        print(f"warn  {warning}")
    print(f"relayer: {len(warnings)} lines cite a moved file by bare name (--verbose lists them)")
    verb = "would change" if check else "changed"
    print(f"relayer: {len(pending)} moves, {len(packages)} new packages, {verb} {changed} files")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--verbose", action="store_true", help="list bare file-name citations")
    args = parser.parse_args(argv)
    repo = Path(_git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel").strip())
    try:
        return run(repo, args.check, args.verbose)
    except RelayerError as err:
        print(err, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
