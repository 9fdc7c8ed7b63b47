"""The shipped examples run end to end in `make test`: 2 steps each, with `--check` against
one-process training on the global batch. Each spawns its own ranks (2 for the GPT, 4 for MoE and
pipeline), so this module costs 30-50 s on 2 shared cores, run beside the rest of the suite
([Note: background jobs] in background_jobs.py); the examples' default step counts stay in `make
demo` and the README."""

from __future__ import annotations

import re
import sys

import pytest
from background_jobs import REPO, Job, Runner

# example argv -> lines it must print: its last step, its --check (the exit code says whether the
# check passed)
EXAMPLES = {
    "train_gpt": (
        ["examples/train_gpt.py", "--steps", "2", "--check"],
        r"done: loss \S+ -> \S+ in 2 steps",
        r"check vs 1 process: max loss diff \S+ \(relative\); .* -> OK",
    ),
    "train_moe": (
        ["examples/train_moe.py", "--steps", "2", "--check"],
        r"(?m)^step +1 ",
        r"--check: largest \|EP loss - one-process loss\| over 2 steps: \S+",
    ),
    "train_torch_ddp": (
        ["examples/train_torch_ddp.py", "--steps", "5", "--check"],
        r"\[megabuf\] done: loss \S+ -> \S+ in 5 steps on 2 ranks",
        r"check: megabuf vs torch DDP, 5 steps, params and losses on every rank: bitwise equal",
    ),
    "train_sharded_like_sharded_ddp": (
        ["examples/train_sharded.py", "--like", "sharded_ddp", "--steps", "3", "--check"],
        r"\[sharded_ddp -> optim_grads\] done: loss \S+ -> \S+ in 3 steps on 2 ranks",
        r"params bitwise equal: True",
        r"check vs 1 process: .* resumed bitwise: True -> OK",
    ),
    "train_sharded_like_fsdp": (
        ["examples/train_sharded.py", "--like", "fsdp", "--steps", "3", "--check"],
        r"\[fsdp -> optim_grads_params\] done: loss \S+ -> \S+ in 3 steps on 2 ranks",
        r"params bitwise equal: True",
        r"check vs 1 process: .* resumed bitwise: True -> OK",
    ),
    "rl_loop": (
        ["examples/rl_loop.py", "--steps", "2", "--check"],
        r"consumer received versions 1\.\.2",
        r"check: consumer weights == trainers' \(bf16\) at every version: True -> OK",
    ),
    "train_pipeline": (
        ["examples/train_pipeline.py", "--steps", "2", "--check"],
        r"(?m)^step +1 ",
        r"--check: largest \|pipeline loss - one-process loss\| over 2 steps: \S+",
    ),
}


JOBS = {
    name: Job(f"example {name}", (sys.executable, *argv), 300, (("PYTHONPATH", str(REPO)),))
    for name, (argv, *_) in EXAMPLES.items()
}


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.background(JOBS[name])) for name in EXAMPLES]
)
def test_example_trains_and_passes_its_check(name: str, background: Runner) -> None:
    _, *lines = EXAMPLES[name]
    proc = background.result(JOBS[name])  # [Note: background jobs]
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (name, proc.returncode, output[-4000:])
    assert "terminate called" not in output, (name, output[-4000:])  # an abort at exit (issue 48)
    for line in lines:
        assert re.search(line, output), (name, line, output[-4000:])
