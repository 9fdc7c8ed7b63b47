"""Exact memory accounting on real gloo ranks (dp 1/2/4): after two steps, each rank's
`memory_report()` equals the pure formula ([Note: memory formula]) category by category, and
equals an independent walk over unique storages ([Note: storage walk]) in total; transient
categories are empty between steps and their peaks stay within `transient_bounds`.

Adding a strategy to the sweep is one line of STRATEGIES."""

from __future__ import annotations

from typing import Any

import pytest
from dist_pool import case_result, run_each
from memory_cases import memory_case, offload_case

from megabuf.sharding.formula import DEVICE_CATEGORIES, HOST_CATEGORIES

STRATEGIES = [
    "no_shard",
    "optim",
    "optim_grads",
    "optim_grads_params",
]
VARIANTS: dict[str, dict[str, Any]] = {
    "adam_fp32": {"optimizer": "adam"},
    "sgd_bf16_buckets": {"optimizer": "sgd", "bf16": True, "bucket_size": 100},
    "adam_bf16_expert": {"optimizer": "adam", "bf16": True, "expert": True},
    "sgd_fp32_expert_buckets": {"optimizer": "sgd", "expert": True, "bucket_size": 200},
}
CASES = {f"{s}-{v}": {"strategy": s, **spec} for s in STRATEGIES for v, spec in VARIANTS.items()}


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"dp{n}")
def results(request: Any, pools: Any) -> tuple[int, list[dict[str, Any]]]:
    cases = {name: (memory_case, case) for name, case in CASES.items()}
    return request.param, pools(request.param).run(run_each, cases)


def _per_rank(results: Any, name: str) -> list[dict[str, Any]]:
    return case_result(results[1], name)


@pytest.mark.parametrize("name", CASES)
def test_report_equals_formula(results: Any, name: str) -> None:
    """Params, grads, fp32 main params, optimizer state and reduce-scatter scratch: the report
    equals the formula from the padded plan, exactly, on every rank; frozen params and module
    buffers are reported as they are; nothing is on a host (CPU params)."""
    for rank, got in enumerate(_per_rank(results, name)):
        where = f"dp={results[0]} rank {rank} {name}"
        report = {c: got["persistent"][c] for c in DEVICE_CATEGORIES}
        assert report == {c: got["formula"][c] for c in DEVICE_CATEGORIES}, where
        assert all(got["formula"][c] == 0 for c in HOST_CATEGORIES), where
        assert got["host"] == {}, where
        assert got["persistent"]["frozen_params"] == got["frozen_nbytes"], where
        assert got["persistent"]["module_buffers"] == got["buffer_nbytes"], where
        assert got["persistent"]["optimizer_state"] > 0 or "sgd" not in name, where


@pytest.mark.parametrize("name", CASES)
def test_report_equals_storage_walk(results: Any, name: str) -> None:
    """Every byte the walk finds is in the report, and nothing else: persistent + transient
    held now (e.g. bf16 `.grad` copies exposed under no_shard) == unique storages."""
    for rank, got in enumerate(_per_rank(results, name)):
        reported = sum(got["persistent"].values()) + sum(got["transient_now"].values())
        assert got["walk"] == {"cpu": reported}, f"dp={results[0]} rank {rank} {name}"


@pytest.mark.parametrize("name", CASES)
def test_transients_released_and_within_bounds(results: Any, name: str) -> None:
    """Between steps every released storage is released (the ledger's transient categories
    hold 0 bytes), and their high-water marks stay within the formula's bounds."""
    for rank, got in enumerate(_per_rank(results, name)):
        where = f"dp={results[0]} rank {rank} {name}"
        held = {c: n for c, n in got["transient_now"].items() if c != "grad_copies"}
        assert all(n == 0 for n in held.values()), (where, held)
        for category, peak in got["transient_peak"].items():
            assert peak <= got["bounds"].get(category, 0), (where, category, peak)
        for category in ("grad_buckets", "unsharded_params"):  # released storage is recorded
            if category in got["bounds"]:
                assert got["transient_peak"].get(category, 0) > 0, (where, category)


OFFLOAD_STRATEGIES = ["optim", "optim_grads", "optim_grads_params"]


@pytest.fixture(scope="module")
def offload_results(pools: Any) -> list[dict[str, Any]]:
    cases = {s: (offload_case, s) for s in OFFLOAD_STRATEGIES}
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strategy", OFFLOAD_STRATEGIES)
def test_cpu_offload_on_cpu_params_warns_once_and_changes_nothing(
    offload_results: Any, strategy: str
) -> None:
    """[Note: cpu offload]: with CPU params cpu_offload=True is a no-op with one UserWarning
    (per optimizer), and three AdamW steps give bitwise the main params and state of
    cpu_offload=False; nothing is reported as host memory."""
    for rank, got in enumerate(case_result(offload_results, strategy)):
        assert got["cpu_offload"] is True, rank
        assert len(got["warnings"]) == 1, (rank, got["warnings"])
        category, message = got["warnings"][0]
        assert category == "UserWarning" and "no-op" in message, (rank, message)
        assert got["bitwise"] and got["n_tensors"] > 0, rank
        assert got["host"] == {}, rank
