"""`make test-gpu` / `make bench-gpu` choose their interpreter (Makefile, issue 24): a `python3`
that already imports a CUDA build of torch runs them directly with the repository on PYTHONPATH,
installing nothing (the offline GPU machine); any other builds `.venv-gpu` as before. Checked
with `make -n` and a fake interpreter whose probe answers as told, on a copy of the Makefile (the
checkout's own `.venv-gpu`, if any, plays no part)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FAKE = """#!/bin/sh
# a fake python3: `-c PROBE` succeeds iff FAKE_CUDA=1; every call is logged
echo "$*" >> "$FAKE_LOG"
if [ "$1" = "-c" ]; then [ "$FAKE_CUDA" = 1 ]; exit $?; fi
exit 0
"""

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _dry_run(tmp_path: Path, target: str, cuda: bool) -> tuple[str, str]:
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, "FAKE_CUDA": "1" if cuda else "0", "FAKE_LOG": str(log)}
    out = subprocess.run(
        ["make", "-n", target, f"PY={fake}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return out, log.read_text() if log.exists() else ""


@pytest.mark.parametrize("target", ["test-gpu", "bench-gpu"])
def test_cuda_python_runs_directly_installing_nothing(tmp_path: Path, target: str) -> None:
    out, calls = _dry_run(tmp_path, target, cuda=True)
    assert "using it directly, installing nothing" in out
    module = "-m pytest -q -rs -m gpu" if target == "test-gpu" else "-m megabuf.bench --device cuda"
    assert re.search(rf"PYTHONPATH={re.escape(str(tmp_path))}\S* \S*python3 {module}", out), out
    assert "--repeat 3" in out or target == "test-gpu"
    for absent in ("venv", "pip install", ".venv-gpu"):
        assert absent not in out, f"{absent!r} in the offline path:\n{out}"
    assert "import torch" in calls and ("import pytest" in calls) == (target == "test-gpu")


@pytest.mark.parametrize("target", ["test-gpu", "bench-gpu"])
def test_other_python_builds_the_gpu_venv(tmp_path: Path, target: str) -> None:
    out, _ = _dry_run(tmp_path, target, cuda=False)
    assert "-m venv --system-site-packages .venv-gpu" in out
    assert "pip install -q torch==2.13.0" in out
    assert re.search(r"^\.venv-gpu/bin/python -m (pytest|megabuf\.bench)", out, re.M), out
    assert "PYTHONPATH=" not in out


def test_other_targets_never_probe(tmp_path: Path) -> None:
    """`make test` and the rest pay nothing for the probe (it imports torch)."""
    _, calls = _dry_run(tmp_path, "test", cuda=True)
    assert "import torch" not in calls


@pytest.mark.skipif(bool(torch.version.cuda), reason="this torch is a CUDA build")
def test_probe_rejects_this_cpu_build_of_torch() -> None:
    probe = re.search(r"^CUDA_TORCH_PROBE := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert probe is not None
    assert subprocess.run([sys.executable, "-c", probe.group(1)], timeout=120).returncode == 1


def test_gpu_session_script_runs_the_tier_then_the_bench_offline(tmp_path: Path) -> None:
    """examples/gpu_session.sh with a fake CUDA python3: the tier and then the bench, both on
    the direct path (nothing installed), with the bench's repeat, shape and log file, and a
    summary in $OUT."""
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log, out = tmp_path / "calls.log", tmp_path / "logs"
    env = {**os.environ, "FAKE_CUDA": "1", "FAKE_LOG": str(log), "OUT": str(out), "PY": str(fake)}
    done = subprocess.run(
        ["bash", str(ROOT / "examples" / "gpu_session.sh")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    tier = [i for i, c in enumerate(calls) if c.startswith("-m pytest -v -rs -m gpu")]
    bench = [i for i, c in enumerate(calls) if c.startswith("-m megabuf.bench --device cuda")]
    assert len(tier) == 1 and len(bench) == 1 and tier[0] < bench[0], calls
    assert "--repeat 3" in calls[bench[0]] and "--gpt-width 1024" in calls[bench[0]]
    assert f"--out {out}/bench-gpu.jsonl" in calls[bench[0]]
    for name in ("env.txt", "tier.log", "bench.log", "summary.txt"):
        assert (out / name).exists(), name
    assert "installing nothing" in (out / "tier.log").read_text()
    assert "venv" not in "\n".join(calls)
