"""The memory planner's pure core ([Note: memory planner] in megabuf/planning/budget.py), no
process group: what it predicts is the engine's formula, what it chooses fits the budget with
the margin, every alternative has a reason, a budget just below the least feasible one is
refused naming the bytes, and `megabuf plan` prints it."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from torch import nn

import megabuf
from megabuf.cli import main
from megabuf.planning.budget import (
    BudgetInputs,
    Candidate,
    candidate_config,
    candidates,
    plan_budget,
    usable,
)
from megabuf.planning.budget_agree import module_inputs
from megabuf.planning.budget_time import unit_gather_exposed
from megabuf.planning.plan import build_plan
from megabuf.sharding.formula import ADAM, DEVICE_CATEGORIES, SGD, persistent_bytes
from megabuf.testing.models import build_model

OVERLAP = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True)


def _inputs(budget: int, model: str = "gpt_tiny", dp: int = 4, **fields: object) -> BudgetInputs:
    fields = {"step_compute_s": 0.05, "reduce_scatter_scratch": True, **fields}
    return module_inputs(
        build_model(model, seed=0), OVERLAP, device_budget_nbytes=budget, dp_size=dp, **fields
    )


def test_persistent_prediction_is_the_formula_of_the_config_it_returns() -> None:
    """Every candidate's persistent categories are `persistent_bytes` of the plan its own config
    builds, on its busiest rank: the formula the ledger is tested against, not a second one."""
    inputs = _inputs(10**9)
    plan = plan_budget(inputs)
    for ev in plan.evaluations:
        cfg, c = ev.config, ev.candidate
        assert cfg is not None and cfg.sharding.name == c.strategy
        built = build_plan(
            inputs.specs, cfg, dp_size=c.shard_size, expt_dp_size=c.shard_size,
            expert_shares_dp_group=True,
            unit_of_param=inputs.unit_of_param if cfg.sharding.shards_params else None,
        )  # fmt: skip
        ranks = [
            persistent_bytes(built, c.strategy, ADAM, dp_rank=r, reduce_scatter_scratch=True)
            for r in range(c.shard_size)
        ]
        assert list(ev.persistent_per_rank) == ranks, c
        busiest = max(sum(f[k] for k in DEVICE_CATEGORIES) for f in ranks)
        assert sum(ev.device[k] for k in DEVICE_CATEGORIES) == busiest, c


def test_choice_fits_with_margin_and_is_least_comm_then_least_memory() -> None:
    plan = plan_budget(_inputs(2_000_000))
    chosen = plan.chosen
    assert chosen is not None and chosen.fits and chosen.reason == ""
    assert chosen.device_nbytes <= usable(2_000_000, 0.1)
    fitting = [e for e in plan.evaluations if e.fits]
    assert len(fitting) > 1
    for e in fitting:
        assert (e.exposed_comm_s, e.device_nbytes) >= (
            chosen.exposed_comm_s - 1e-6,
            chosen.device_nbytes if abs(e.exposed_comm_s - chosen.exposed_comm_s) < 1e-6 else 0,
        )


def test_every_rejected_candidate_has_its_reason_with_the_bytes() -> None:
    plan = plan_budget(_inputs(1_600_000))
    assert plan.rejected and all(e.reason for e in plan.rejected)
    room = usable(1_600_000, 0.1)
    for e in plan.rejected:
        if e.fits:
            assert e.reason.startswith("fits"), e.reason
            continue
        over = int(re.search(r"over by ([\d,]+) B", e.reason).group(1).replace(",", ""))  # type: ignore[union-attr]
        assert over == e.device_nbytes - room, e.reason
        largest = max(e.device, key=lambda k: e.device[k])
        assert f"largest category {largest} " in e.reason


def test_budget_just_below_the_least_feasible_is_refused_naming_the_bytes() -> None:
    low = plan_budget(_inputs(1000))
    need = low.needed_budget_nbytes
    assert low.chosen is None and need is not None
    at = plan_budget(_inputs(need))
    assert at.chosen is not None
    assert at.chosen.device_nbytes <= usable(need, 0.1)
    below = plan_budget(_inputs(need - 1))
    assert below.chosen is None and below.needed_budget_nbytes == need
    with pytest.raises(ValueError, match=f"smallest that would is {need:,} bytes"):
        _ = below.config


def test_margin_is_kept_free() -> None:
    """The chosen candidate's total at margin 0 is refused once a margin is asked for."""
    tight = plan_budget(_inputs(10**9, margin=0.0))
    assert tight.chosen is not None
    exact = tight.chosen.device_nbytes
    assert plan_budget(_inputs(exact, margin=0.0)).chosen is not None
    with_margin = plan_budget(_inputs(exact, margin=0.25))
    assert all(e.device_nbytes <= usable(exact, 0.25) for e in with_margin.evaluations if e.fits)
    assert all(not e.fits for e in with_margin.evaluations if e.device_nbytes > 0.75 * exact)


def test_activations_and_fixed_bytes_count_in_every_candidate() -> None:
    a = plan_budget(_inputs(10**9))
    b = plan_budget(_inputs(10**9, activation_nbytes=12345))
    for x, y in zip(a.evaluations, b.evaluations, strict=True):
        assert y.device_nbytes - x.device_nbytes == 12345
        assert y.device["activations"] == 12345


def test_search_set_hybrid_prefetch_offload() -> None:
    flat = candidates(_inputs(10**9))
    shards = {c.shard_size for c in flat if c.strategy != "no_shard"}
    assert shards == {2, 4}  # hybrid 2 x 2 and flat 4; a 1-rank shard is not searched
    assert {c.prefetch_units for c in flat if c.strategy == "optim_grads_params"} == {0, 1, 2}
    assert not any(c.cpu_offload for c in flat)
    gpu = candidates(_inputs(10**9, accelerator=True))
    assert {c.strategy for c in gpu if c.cpu_offload} == {"optim", "optim_grads",
                                                         "optim_grads_params"}  # fmt: skip


def test_offload_moves_state_to_host_and_a_host_budget_refuses_it() -> None:
    inputs = _inputs(10**9, dp=2, accelerator=True, reduce_scatter_scratch=False)
    inputs = replace(inputs, strategies=("optim",), bucket_sizes=(None,))
    plan = plan_budget(inputs)
    on, off = (
        [e for e in plan.evaluations if e.candidate.cpu_offload],
        [e for e in plan.evaluations if not e.candidate.cpu_offload],
    )
    assert on[0].device["optimizer_state"] == 0 and on[0].host["host_optimizer_state"] > 0
    assert on[0].device_nbytes < off[0].device_nbytes
    budget = (on[0].device_nbytes + off[0].device_nbytes) // 2
    squeezed = plan_budget(replace(inputs, device_budget_nbytes=budget, margin=0.0))
    assert squeezed.chosen is not None and squeezed.chosen.candidate.cpu_offload
    no_host = plan_budget(
        replace(inputs, device_budget_nbytes=budget, margin=0.0, host_budget_nbytes=1000)
    )
    assert no_host.chosen is None
    assert any(e.reason.startswith("host needs") for e in no_host.evaluations)


def test_half_params_grad_reduce_in_fp32_varied_only_when_allowed() -> None:
    model = build_model("gpt_tiny", seed=0).to(torch.bfloat16)
    kw = dict(device_budget_nbytes=10**9, dp_size=2, optimizer=SGD)
    fixed = module_inputs(model, OVERLAP, **kw)  # type: ignore[arg-type]
    assert {c.grad_reduce_in_fp32 for c in candidates(fixed)} == {False}
    varied = module_inputs(model, OVERLAP, vary_grad_reduce_in_fp32=True, **kw)  # type: ignore[arg-type]
    plan = plan_budget(varied)
    assert {c.grad_reduce_in_fp32 for c in candidates(varied)} == {False, True}
    assert plan.chosen is not None and not plan.chosen.candidate.grad_reduce_in_fp32


def test_candidate_config_resets_options_the_strategy_does_not_read() -> None:
    base = megabuf.DistributedDataParallelConfig(
        data_parallel_sharding_strategy="optim_grads_params", prefetch_units=2,
        overlap_grad_reduce=True,
    )  # fmt: skip
    cfg = candidate_config(base, Candidate("no_shard", 4, False, None, 1, False), 4)
    assert cfg.sharding.name == "no_shard" and cfg.overlap_grad_reduce
    hybrid = candidate_config(base, Candidate("optim", 2, False, 100, 1, False), 4)
    assert hybrid.num_distributed_optimizer_instances == 2 and hybrid.bucket_size == 100


def test_deterministic_and_meta_device() -> None:
    """Identical inputs, identical choice; a model on the meta device plans the same."""
    with torch.device("meta"):
        meta = build_model("gpt_tiny", seed=0)
    a = plan_budget(_inputs(2_000_000))
    b = plan_budget(
        module_inputs(
            meta,
            OVERLAP,
            device_budget_nbytes=2_000_000,
            dp_size=4,
            step_compute_s=0.05,
            reduce_scatter_scratch=True,
        )
    )
    assert a.chosen is not None and b.chosen is not None
    assert a.chosen.candidate == b.chosen.candidate and a.chosen.device == b.chosen.device


def test_unit_gather_model() -> None:
    gathers, compute = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]
    assert unit_gather_exposed(gathers, compute, 0) == pytest.approx(3.0)
    assert unit_gather_exposed(gathers, compute, 1) == pytest.approx(1.0)
    assert unit_gather_exposed([0.0] * 3, compute, 2) == 0.0


def test_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="budget must be > 0"):
        plan_budget(_inputs(0))
    with pytest.raises(ValueError, match="margin"):
        plan_budget(_inputs(10, margin=1.0))
    empty = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable params"):
        plan_budget(module_inputs(empty, OVERLAP, device_budget_nbytes=10, dp_size=1))


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "gpt_tiny", "--budget", "2MB", "--dp-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "reason" in out
    assert main(["plan", "gpt_tiny", "--budget", "1000", "--dp-size", "4", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["chosen"] is None and data["needed_budget_nbytes"] > 1000
    assert len(data["rejected"]) == len(candidates(_inputs(1000)))
