"""megabuf.ft (issue 43): per-step fault tolerance through torchft.

Fast tier: one replica group of 2 gloo ranks (tests/dist_pool.py) with a fake Manager standing
for the other groups (tests/ft_fake_cases.py): the should_commit gate leaves everything as it
was, the cross-replica arithmetic equals the reference, every megabuf collective stays inside
the group, the layout fingerprint raises by name, healing state round-trips bitwise.
Slow tier (`slow`, still in `make test`): real torchft, an in-process lighthouse and groups of
processes (tests/ft_cases.py), groups killed hard in backward, in the step and during a heal, a
group stalled past the Manager's timeout; all replicas end bitwise equal to each other and to
the reference ([Note: ft test reference]).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from ft_cases import Scenario, run_scenario
from ft_fake_cases import STRATEGIES, all_cases, reference

REPO = Path(__file__).resolve().parents[1]
_SWEEP: dict[str, Any] = {}


def _sweep(pools: Any) -> list[dict[str, Any]]:
    if "results" not in _SWEEP:
        _SWEEP["results"] = pools(2).run(run_each, all_cases())
    return _SWEEP["results"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_voted_down_step_changes_nothing(pools: Any, strategy: str) -> None:
    for r in case_result(_sweep(pools), f"voted_down_{strategy}"):
        assert r == {"voted_none": True, "unchanged": True, "then_moves": True}


def test_voted_down_step_leaves_the_loss_scaler(pools: Any) -> None:
    for r in case_result(_sweep(pools), "voted_down_fp16_scaler"):
        assert r == {"voted_none": True, "unchanged": True, "then_moves": True}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cross_replica_average_over_participants_equals_reference(
    pools: Any, strategy: str
) -> None:
    assert case_result(_sweep(pools), f"reference_{strategy}") == [True, True]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_collective_crosses_replica_groups(pools: Any, strategy: str) -> None:
    for r in case_result(_sweep(pools), f"audit_{strategy}"):
        assert r["calls"] > 0
        assert r["foreign"] == 0 and not r["manager_pg"], r


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_layout_mismatch_is_a_named_error(pools: Any, strategy: str) -> None:
    for r in case_result(_sweep(pools), f"fingerprint_{strategy}"):
        assert "laid their buckets out differently" in r["raised"]
        assert r["unchanged"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_healed_state_steps_bitwise_equal(pools: Any, strategy: str) -> None:
    assert case_result(_sweep(pools), f"heal_{strategy}") == [True, True]


def test_import_megabuf_does_not_import_torchft() -> None:
    for path in (REPO / "megabuf").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "torchft" for n in names), path


def test_missing_torchft_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from megabuf import ft

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name)
    )
    with pytest.raises(ImportError, match=r"megabuf\[ft\]"):
        ft.require_torchft()


def test_config_spanning_groups_is_refused() -> None:
    from megabuf import DistributedDataParallelConfig
    from megabuf.ft.gate import _check_config

    with pytest.raises(ValueError, match="check_for_nan_in_grad"):
        _check_config(DistributedDataParallelConfig(check_for_nan_in_grad=True))


# ---- real torchft: processes, kills, heals ------------------------------------------------------


def _check_replicas(results: dict[int, list[Any]], sc: Scenario) -> None:
    """Every rank of every group equal to the same rank of group 0 (never killed), bitwise;
    and equal to the reference for the committed steps and their participant counts, read
    from every run's records (killed runs' included): every group that committed step s saw
    the same count, and steps 0..last were all committed by someone ([Note: ft test
    reference])."""
    records = results.pop(-1)[0]
    for strategy in sc.strategies:
        base = results[0]
        for g in results:
            for r, out in enumerate(results[g]):
                mine, theirs = out[strategy], base[r][strategy]
                for k, v in mine["params"].items():
                    assert torch.equal(v, theirs["params"][k]), (strategy, g, r, k)
                for a, b in zip(mine["mains"], theirs["mains"], strict=True):
                    assert torch.equal(a, b), (strategy, g, r, "main params")
        counts: dict[int, int] = {}
        for name, step, n, ok in records:
            if name == strategy and ok:
                assert counts.setdefault(step, n) == n, (strategy, step, n, counts[step])
        steps = sorted(counts)
        assert steps == list(range(len(steps))), (strategy, steps)
        want = reference([counts[s] for s in steps], sc.size, steps)
        got = list(base[0][strategy]["params"].values())
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (strategy, counts)


@pytest.mark.slow
def test_three_groups_of_one_killed_in_each_phase_and_stalled() -> None:
    sc = Scenario(
        groups=3, size=1, strategies=list(STRATEGIES), steps=4,
        kills=[
            {"group": 1, "strategy": "optim", "step": 2, "phase": "backward"},
            {"group": 1, "strategy": "optim", "step": 0, "phase": "heal", "restarts": 1},
            {"group": 2, "strategy": "optim_grads", "step": 2, "phase": "step"},
        ],
        stalls=[{"group": 2, "strategy": "no_shard", "step": 2, "seconds": 8.0}],
    )  # fmt: skip
    _check_replicas(run_scenario(sc, deadline_s=900.0), sc)


@pytest.mark.slow
def test_three_groups_of_two_every_strategy_killed() -> None:
    sc = Scenario(
        groups=3, size=2, strategies=list(STRATEGIES), steps=3,
        kills=[
            {"group": 2, "strategy": "no_shard", "step": 1, "phase": "backward", "rank": 1},
            {"group": 1, "strategy": "optim_grads_params", "step": 1, "phase": "step"},
        ],
    )  # fmt: skip
    _check_replicas(run_scenario(sc, deadline_s=900.0), sc)


@pytest.mark.slow
def test_example_kills_a_group_and_the_replicas_agree() -> None:
    """examples/train_ft.py --kill: group 1 dies mid-backward, restarts, heals; all agree."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "examples/train_ft.py", "--steps", "3", "--kill", "--timeout-s", "800"]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "group 1 was killed: restarting it" in output, output[-4000:]
    assert "replicas agree (params bitwise equal in all 3 groups): True" in output, output[-4000:]
