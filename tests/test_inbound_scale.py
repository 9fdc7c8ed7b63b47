"""[Note: scale on the way in] (megabuf/buckets/grad_math.py): the pure bookkeeping of
`InboundScale`, and on 2 and 3 gloo ranks (rank 0 leaves a param unused) the grads of a model whose
large params are scaled on their way into `main_grad` against the bucket pass (bitwise: the same
products reach the all-reduce) and a single-process reference; which params took the path is
observed (`.grad` None after megabuf's hook), including a param with two arrivals per backward
(a reentrant checkpoint), micro-batches and a comm hook that wants unscaled grads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from inbound_scale_cases import check_large_grads_scaled, check_unscaled_paths, run_cases

from megabuf.buckets.grad_math import InboundScale


def _strategy(reduction: str, prescales: bool) -> Any:
    return SimpleNamespace(reduction=reduction, prescales=lambda dtype: prescales)


def _bucket(factor: float, n: int = 2) -> Any:
    return SimpleNamespace(gradient_scaling_factor=factor, params_list=[None] * n,
                           grad_data=torch.zeros(4))  # fmt: skip


def test_only_prescaled_all_reduce_groups_of_one_factor_scale_inbound() -> None:
    flat = _strategy("all_reduce", True)
    assert InboundScale.of([_bucket(0.5), _bucket(0.5)], flat).factor == 0.5
    assert len(InboundScale.of([_bucket(0.5), _bucket(0.5, 3)], flat).scaled) == 5
    for buckets, strategy in (
        ([_bucket(0.5)], _strategy("reduce_scatter", False)),  # scaled after the collective
        ([_bucket(0.5)], _strategy("all_reduce", False)),
        ([_bucket(0.5), _bucket(0.25)], _strategy("all_reduce", True)),  # experts' factor
        ([_bucket(1.0)], _strategy("all_reduce", True)),  # nothing to scale
    ):
        assert InboundScale.of(buckets, strategy).factor is None


def test_a_param_enters_at_its_first_grad_only_and_stays_for_the_iteration() -> None:
    scale = InboundScale(3, 0.5)
    assert scale.factor_for(0, first=False, allowed=True) == 1.0  # accumulating: stays unscaled
    assert scale.factor_for(1, first=True, allowed=False) == 1.0  # no_sync / a comm hook
    assert scale.factor_for(2, first=True, allowed=True) == 0.5
    assert scale.factor_for(2, first=False, allowed=False) == 0.5  # every later grad too
    assert (bytes(scale.scaled), scale.count) == (b"\x00\x00\x01", 1)
    assert InboundScale(2, None).factor_for(0, first=True, allowed=True) == 1.0


def test_dispatch_scales_what_did_not_come_in_scaled_then_forgets() -> None:
    flat = torch.full((6,), 4.0)
    params = [SimpleNamespace(main_grad=flat[0:2]), SimpleNamespace(main_grad=flat[2:6])]
    scale = InboundScale(2, 0.5)
    scale.prescale([flat], [0.5], params)  # nothing came in scaled: the whole bucket
    assert flat.tolist() == [2.0] * 6
    scale.factor_for(1, first=True, allowed=True)
    scale.prescale([flat], [0.5], params)
    assert flat.tolist() == [1.0, 1.0, 2.0, 2.0, 2.0, 2.0] and scale.count == 0
    assert bytes(scale.scaled) == b"\x00\x00"


@pytest.fixture(scope="module", params=[2, 3], ids=lambda dp: f"dp{dp}")
def results(pools: Any, request: Any) -> list[dict[str, Any]]:
    world = request.param
    return case_result(pools(world).run(run_each, {"inbound": (run_cases,)}), "inbound")


def test_large_grads_go_in_scaled_and_equal_the_bucket_pass_and_the_reference(results: Any) -> None:
    check_large_grads_scaled(results)


def test_microbatches_and_a_hook_wanting_unscaled_grads_keep_the_bucket_pass(results: Any) -> None:
    check_unscaled_paths(results)
