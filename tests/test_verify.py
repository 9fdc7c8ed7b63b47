"""The verify mode (issue 47, [Note: verify mode]): each check names a divergence of its class
planted on one rank, on every rank, and passes silently when nothing is wrong; the spike guards.
2 gloo ranks, one pool run (cases in verify_cases.py). The no-false-alarm run over the whole
combination matrix is tests/test_matrix2.py's (its cases run under verify="all")."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from verify_cases import (
    COUNTED,
    bucket_order_case,
    clean_case,
    expert_norm_case,
    sequence_case,
    size1_twice_case,
    spike_case,
    ulp_case,
)

import megabuf
import megabuf.verify
from megabuf.pure.verify_levels import VERIFY_LEVELS
from megabuf.verify.norms import Piece, ownership_sets
from megabuf.verify.replicas import digest

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _cases() -> dict[str, tuple[Any, ...]]:
    cases: dict[str, tuple[Any, ...]] = {}
    for s in STRATEGIES:
        cases |= {f"clean-{s}-{o}": (clean_case, s, o) for o in (False, True)}
        cases[f"order-{s}"] = (bucket_order_case, s)
    cases |= {f"sequence-{s}": (sequence_case, s) for s in ("no_shard", "optim")}
    cases |= {f"ulp-{s}": (ulp_case, s) for s in ("no_shard", "optim", "optim_grads")}
    cases |= {f"expert-{s}": (expert_norm_case, s) for s in ("no_shard", "optim")}
    cases |= {f"size1-{s}": (size1_twice_case, s) for s in ("no_shard", "optim")}
    cases["spike-raise"] = (spike_case, True, None)
    cases["spike-skip"] = (spike_case, "skip", None)
    cases["spike-threshold"] = (spike_case, False, 50.0)
    return cases


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, _cases())  # type: ignore[no-any-return]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_verify_all_passes_silently_and_checks_every_step(
    results: Any, strategy: str, overlap: bool
) -> None:
    """verify="all", 3 steps: no error; every grad sync compared the fingerprints of dp, every
    step checked the norm."""
    for rank, res in enumerate(case_result(results, f"clean-{strategy}-{overlap}")):
        assert res["counts"] == dict.fromkeys(COUNTED, 3), (rank, res)
        assert res["norm_checks"] == 3, (rank, res)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rank_issuing_its_buckets_in_another_order_is_named_before_issue(
    results: Any, strategy: str
) -> None:
    """Rank 1's chain reversed: both ranks raise before the first mismatched reduction, naming
    the bucket groups each side was about to issue and the ranks."""
    for rank, res in enumerate(case_result(results, f"order-{strategy}")):
        assert res["groups"] > 1, res
        error = res["error"]
        assert error is not None and "about to issue different collectives" in error, (rank, res)
        assert "ranks [0]: bucket group" in error and "ranks [1]: bucket group" in error, error


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_a_collective_only_one_rank_issued_is_named_at_the_grad_sync(
    results: Any, strategy: str
) -> None:
    """The fingerprints differ: every rank all-gathers the short logs and names the first
    differing collective, the group and the ranks on each side."""
    for rank, res in enumerate(case_result(results, f"sequence-{strategy}")):
        error = res["error"]
        assert error is not None and "issued on group dp since the last grad sync" in error, error
        pattern = r"first difference is collective #\d+: ranks \[0\]: [^;]+; ranks \[1\]: all_r"
        assert re.search(pattern + r"educe\(32 bytes\)", error), (rank, error)


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
def test_one_ulp_on_one_rank_is_named_with_the_param_and_ranks(results: Any, strategy: str) -> None:
    for rank, res in enumerate(case_result(results, f"ulp-{strategy}")):
        error = res["error"]
        assert error is not None and "param 'block.weight' differs" in error, (rank, error)
        assert "ranks [0] vs ranks [1]" in error, error


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_an_expert_param_left_out_of_the_norm_is_named(results: Any, strategy: str) -> None:
    for rank, res in enumerate(case_result(results, f"expert-{strategy}")):
        assert res["clean"], (rank, res)
        error = res["error"]
        assert error is not None and "set 'expert'" in error and "set 'dense'" not in error, error


@pytest.mark.parametrize("strategy", ["no_shard", "optim"])
def test_a_group_of_one_counted_twice_is_caught_by_the_norm(results: Any, strategy: str) -> None:
    for rank, res in enumerate(case_result(results, f"size1-{strategy}")):
        error = res["error"]
        assert error is not None and "not the fp64 norm over the exact ownership sets" in error
        assert "set 'expert'" in error, (rank, error)


def test_check_for_large_grads_raises_on_every_rank(results: Any) -> None:
    for res in case_result(results, "spike-raise"):
        assert res["applied"] == [True] * 6 and "check_for_large_grads" in res["error"], res


def test_check_for_large_grads_skip_and_the_threshold_skip_on_every_rank(results: Any) -> None:
    for name, reason in (
        ("spike-skip", "large_grads"),
        ("spike-threshold", "grad_norm_skip_threshold"),
    ):
        for res in case_result(results, name):
            assert res["error"] is None and res["applied"] == [True] * 6 + [False], res
            assert res["skipped"][reason] == 1 and sum(res["skipped"].values()) == 1, res


def test_the_digest_sees_one_ulp_anywhere() -> None:
    t = torch.randn(1000)
    base = digest(t)
    for i in (0, 1, 499, 999):
        u = t.clone()
        u.view(-1)[i : i + 1].view(torch.int32).add_(1)
        assert digest(u) != base, i
    assert digest(t.clone()) == base


def test_ownership_sets_name_a_gap_and_an_overlap() -> None:
    def piece(start: int, end: int, rank: int) -> Piece:
        return Piece("dense", (0, "w"), start, end, 10, 1.0, rank)

    sets = ownership_sets([piece(0, 5, 0), piece(5, 10, 1), piece(0, 5, 2), piece(5, 10, 3)])
    assert [(p.start, p.end) for p in sets[(0, "w")]] == [(0, 5), (5, 10)]  # replicas once
    with pytest.raises(megabuf.verify.VerifyError, match="left out of the norm"):
        ownership_sets([piece(0, 4, 0), piece(5, 10, 1)])
    with pytest.raises(megabuf.verify.VerifyError, match="counted twice"):
        ownership_sets([piece(0, 6, 0), piece(5, 10, 1)])


def test_verify_fields_are_checked_by_name() -> None:
    assert set(VERIFY_LEVELS) == {"off", "collectives", "replicas", "norms", "all"}
    with pytest.raises(ValueError, match="verify='everything' is not one of"):
        megabuf.DistributedDataParallelConfig(verify="everything")
    with pytest.raises(ValueError, match="check_for_large_grads='warn'"):
        megabuf.DistributedDataParallelConfig(check_for_large_grads="warn")
    with pytest.raises(ValueError, match="grad_norm_skip_threshold=0"):
        megabuf.DistributedDataParallelConfig(grad_norm_skip_threshold=0)
