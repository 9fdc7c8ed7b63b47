"""The `--device` flags of the GPT example and the benchmark, without starting ranks: CPU (and so
gloo, see tests/test_process_groups.py) unless asked, and cuda carried to every rank's job. Runs
with --device cuda are in tests/test_gpu.py."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from types import ModuleType

import pytest
import torch

from megabuf.bench.main import make_jobs
from megabuf.bench.options import parse_options
from megabuf.bench.report import Progress

REPO = Path(__file__).resolve().parent.parent


def _train_gpt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "train_gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_gpt_defaults_to_cpu() -> None:
    assert _train_gpt().parse_args([]).device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without CUDA")
def test_train_gpt_device_cuda_without_cuda_stops_before_starting_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _train_gpt().parse_args(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA device here" in capsys.readouterr().err


def test_bench_device_defaults_to_cpu_and_reaches_every_job() -> None:
    assert parse_options(["--quick"]).device == "cpu"
    # (--world-size given: its default on cuda is the visible GPUs, none here)
    argv = ["--quick", "--device", "cuda", "--world-size", "2", "--systems", "no_comm,torch_ddp"]
    opts = parse_options(argv)
    assert opts.device == "cuda"
    jobs = make_jobs(opts, dict.fromkeys(opts.models), Progress(1, stream=io.StringIO()))  # type: ignore[arg-type]
    assert len(jobs) == 2 * len(opts.models)
    assert {job.device for job in jobs} == {"cuda"}
    with pytest.raises(SystemExit):
        parse_options(["--device", "tpu"])
