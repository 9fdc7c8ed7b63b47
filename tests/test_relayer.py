""".ci/relayer.py, the script that moves megabuf's top-level modules into their layers' folders
([Note: import layers] in tests/test_import_graph.py), on a small git repository of its own: what
it rewrites, that a second run does nothing, and that it fails naming what its table misses."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]

FILES = {
    "megabuf/__init__.py": "from megabuf import alpha\n",
    "megabuf/alpha.py": '"""Reads beta.py."""\n\nfrom .beta import B\n',
    "megabuf/beta.py": "B = 1\n",
    "megabuf/keep.py": "",
    "tests/test_x.py": (
        "import megabuf.alpha\n"
        "from megabuf import alpha, keep\n"
        'PATCH = "megabuf.beta.B"\n'
        'FILE = "megabuf/beta.py"\n'
        'ALLOW = ("beta.py", "f")\n'
        'NOT_A_MODULE = "megabuf.betamax"\n'
    ),
    "docs/a.md": "See `beta.py`, megabuf/alpha.py and `python -m megabuf.alpha`.\n",
}
EXPECTED = {
    "megabuf/__init__.py": "from megabuf.low import alpha\n",
    "megabuf/low/alpha.py": '"""Reads beta.py."""\n\nfrom megabuf.low.beta import B\n',
    "megabuf/low/beta.py": "B = 1\n",
    "megabuf/low/__init__.py": '"""The low layer."""\n',
    "tests/test_x.py": (
        "import megabuf.low.alpha\n"
        "from megabuf.low import alpha\n"
        "from megabuf import keep\n"
        'PATCH = "megabuf.low.beta.B"\n'
        'FILE = "megabuf/low/beta.py"\n'
        'ALLOW = ("low/beta.py", "f")\n'
        'NOT_A_MODULE = "megabuf.betamax"\n'
    ),
    "docs/a.md": "See `low/beta.py`, megabuf/low/alpha.py and `python -m megabuf.low.alpha`.\n",
}


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def relayer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("relayer", REPO / ".ci" / "relayer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(
        module, "MOVES", {"megabuf.alpha": "megabuf.low.alpha", "megabuf.beta": "megabuf.low.beta"}
    )
    monkeypatch.setattr(module, "STAY_AT_ROOT", ("megabuf", "megabuf.keep"))
    monkeypatch.setattr(module, "PACKAGES", {"megabuf.low": "The low layer."})
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "start")
    return module


def test_moves_and_rewrites_every_kind_of_reference(
    relayer: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert relayer.run(tmp_path, check=True) == 0
    assert "2 moves, 1 new packages, would change 4 files" in capsys.readouterr().out
    assert (tmp_path / "megabuf/alpha.py").exists()  # --check changed nothing
    assert relayer.run(tmp_path, check=False) == 0
    assert {name: (tmp_path / name).read_text() for name in EXPECTED} == EXPECTED
    assert not (tmp_path / "megabuf/alpha.py").exists()


def test_a_second_run_does_nothing(
    relayer: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    relayer.run(tmp_path, check=False)
    capsys.readouterr()
    assert relayer.run(tmp_path, check=False) == 0
    assert "0 moves, 0 new packages, changed 0 files" in capsys.readouterr().out
    assert {name: (tmp_path / name).read_text() for name in EXPECTED} == EXPECTED


def test_a_top_level_module_missing_from_the_table_fails_by_name(
    relayer: ModuleType, tmp_path: Path
) -> None:
    (tmp_path / "megabuf/gamma.py").write_text("")
    with pytest.raises(relayer.RelayerError, match=r"megabuf\.gamma .*neither MOVES nor"):
        relayer.run(tmp_path, check=True)


def test_a_mapped_module_that_no_longer_exists_fails_by_name(
    relayer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(relayer.MOVES, "megabuf.delta", "megabuf.low.delta")
    with pytest.raises(relayer.RelayerError, match=r"mapped module megabuf\.delta exists neither"):
        relayer.run(tmp_path, check=True)


def test_a_package_named_like_a_module_fails(
    relayer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(relayer.MOVES, "megabuf.beta", "megabuf.keep.beta")
    with pytest.raises(relayer.RelayerError, match=r"package megabuf\.keep .*collides"):
        relayer.run(tmp_path, check=True)


def test_this_repository_is_relayered(capsys: pytest.CaptureFixture[str]) -> None:
    """The table and the tree agree: every top-level module is placed, every mapped one is where
    the table says, and no file names a module by its old path (run the script to fix)."""
    spec = importlib.util.spec_from_file_location("relayer", REPO / ".ci" / "relayer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.run(REPO, check=True) == 0
    assert "0 moves, 0 new packages, would change 0 files" in capsys.readouterr().out
