"""examples/train_hybrid.py on 2 "nodes" x 2 ranks: two torchrun process trees on localhost joined
by the static rendezvous (`--nnodes 2 --node-rank i --master-addr 127.0.0.1`), each node a shard
group, checked against one process (issue 26)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from background_jobs import Call, Runner

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_nodes() -> tuple[list[int | None], list[str]]:
    """Both torchrun trees, their exit statuses and outputs (run beside the suite: [Note:
    background jobs] in background_jobs.py)."""
    port = str(_free_port())
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                *torchrun,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "examples/train_hybrid.py",
                "--steps",
                "2",
                "--check",
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    return [node.returncode for node in nodes], outs


NODES = Call("hybrid: two torchrun nodes", _two_nodes)


@pytest.mark.background(NODES)
def test_two_nodes_of_two_ranks_train_hybrid_and_match_one_process(background: Runner) -> None:
    codes, outs = background.result(NODES)
    assert codes == [0, 0], outs
    text = "\n".join(outs)
    # Each group is "name 1,234", parsed exactly: two ranks' lines run together still count twice.
    group = r"[a-z_]+ \d(?:[\d,]*\d)?"
    ranks = re.findall(
        rf"rank (\d): 2 replicas x 2-way shard; ring bytes per group: ({group}(?:, {group})*)", text
    )
    assert sorted(r for r, _ in ranks) == ["0", "1", "2", "3"], text
    assert all("dp_replicate" in groups and "dp_shard" in groups for _, groups in ranks), text
    assert len(re.findall(r"check vs 1 process: max param diff \S+ -> OK", text)) == 4, text
