"""The pure bucket planner ([Note: auto bucket plan] in megabuf/pure/bucket_planner.py), the
layout's explicit boundaries, the measurement helpers of megabuf/replan/warmup.py and the config
refusals of bucket_size="auto". No process group (agreement runs over a fake MAX)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import megabuf
from megabuf.planning.model_plan import plan_model
from megabuf.planning.plan import build_plan
from megabuf.planning.replicas import param_specs
from megabuf.pure.bucket_planner import (
    MAX_SLOWDOWN,
    MIN_GAIN,
    BucketChoice,
    CollectiveModel,
    bucket_numel,
    calibrate,
    fit_collective_model,
    plan_buckets,
    predict_exposed,
    reduce_at_end,
    worth_changing,
)
from megabuf.pure.layout import compute_layout
from megabuf.pure.overlap import analyze
from megabuf.replan.autobucket import (
    AutoBucket,
    at_end,
    choose_buckets,
    current_choices,
    ends_of,
    placed,
)
from megabuf.replan.sharded_replan import ReplanListeners
from megabuf.replan.warmup import (
    Measurement,
    agree,
    backward_time,
    exposed_time,
    measured,
    quiet_times,
    ready_times,
)
from megabuf.testing.models import build_model

numels_st = st.lists(st.integers(1, 5000), min_size=1, max_size=12)


@st.composite
def planner_inputs(draw: st.DrawFn) -> dict:
    numels = draw(numels_st)
    n = len(numels)
    ready = draw(st.lists(st.floats(-0.05, 0.0), min_size=n, max_size=n))
    sharded = draw(st.booleans())
    return {
        "numels": numels,
        "ready": ready,
        "model": CollectiveModel(draw(st.floats(0.0, 1e-3)), draw(st.floats(0.0, 1e-7))),
        "cuts": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
        "align": 64 if sharded else 1,
        "pad": draw(st.sampled_from([128, 384])) if sharded else 1,
        "element_size": draw(st.sampled_from([2, 4])),
    }


def _plan(d: dict, **over: object):  # type: ignore[no-untyped-def]
    args = {**d, **over}
    return plan_buckets(
        args["numels"], args["ready"], 0.0, args["model"], element_size=args["element_size"],
        param_align=args["align"], pad_multiple=args["pad"], breaks_after=args["cuts"],
    )  # fmt: skip


def _ends(counts: tuple[int, ...]) -> list[int]:
    return list(itertools.accumulate(counts))


@settings(max_examples=60, deadline=None)
@given(planner_inputs())
def test_layout_rules_hold_for_any_measured_input(d: dict) -> None:
    choice = _plan(d)
    n = len(d["numels"])
    assert sum(choice.param_counts) == n and all(c > 0 for c in choice.param_counts)
    ends = _ends(choice.param_counts)
    for i, cut in enumerate(d["cuts"]):
        if cut and i + 1 < n:
            assert i + 1 in ends, f"forced boundary after param {i} not cut: {ends}"
    # the sizes the planner charged are the sizes compute_layout lays out (params never split)
    layout = compute_layout(
        list(reversed(d["numels"])), bucket_size=None, dp_size=max(1, d["pad"] // 128),
        sharded=d["align"] > 1, bucket_ends=ends,
    )  # fmt: skip
    if d["align"] > 1:  # pad 128 = lcm(1, 128), 384 = lcm(3, 128); unsharded: no padding
        assert tuple(b.numel for b in layout.buckets) == choice.bucket_numels
    assert len(layout.buckets) == len(choice.param_counts)
    for b, count in zip(layout.buckets, choice.param_counts):
        assert len(b.param_ids) == count


@settings(max_examples=40, deadline=None)
@given(planner_inputs())
def test_identical_inputs_give_identical_plans(d: dict) -> None:
    assert _plan(d) == _plan(dict(d, numels=list(d["numels"]), ready=list(d["ready"])))


@settings(max_examples=40, deadline=None)
@given(planner_inputs(), st.floats(0.0, 0.02), st.floats(1.0, 20.0))
def test_predicted_exposed_is_monotone_in_the_measured_tail(
    d: dict, later: float, slower: float
) -> None:
    base = _plan(d).predicted_exposed_s
    # grads ready later (a longer tail of backward) or a slower link never predict less
    shifted = [min(0.0, t + later) for t in d["ready"]]
    assert _plan(d, ready=shifted).predicted_exposed_s >= base - 1e-12
    m = d["model"]
    slow = CollectiveModel(m.latency_s * slower, m.seconds_per_byte * slower)
    assert _plan(d, model=slow).predicted_exposed_s >= base - 1e-12


@settings(max_examples=30, deadline=None)
@given(planner_inputs())
def test_plan_is_optimal_among_all_boundaries_of_small_inputs(d: dict) -> None:
    numels = d["numels"][:7]
    d = dict(d, numels=numels, ready=d["ready"][:7], cuts=[False] * len(numels))
    choice = _plan(d)
    n = len(numels)
    best = min(
        predict_exposed(
            [b - a for a, b in zip((0, *ends), (*ends, n))],
            numels,
            d["ready"],
            0.0,
            d["model"],
            element_size=d["element_size"],
            param_align=d["align"],
            pad_multiple=d["pad"],
        )
        for k in range(n)
        for ends in itertools.combinations(range(1, n), k)
    )
    assert choice.predicted_exposed_s <= best + 1e-6 + 1e-12


def test_nothing_to_overlap_keeps_one_bucket_and_a_slow_tail_gets_a_small_last_bucket() -> None:
    numels = [1_000_000] * 10
    ready = [-0.1 + 0.01 * i for i in range(10)]
    free = plan_buckets(numels, ready, 0.0, CollectiveModel(0.0, 0.0), element_size=4)
    assert free.param_counts == (10,)
    slow = plan_buckets(numels, ready, 0.0, CollectiveModel(1e-3, 1e-9), element_size=4)
    assert len(slow.param_counts) > 1 and slow.param_counts[-1] <= slow.param_counts[0]
    one = predict_exposed([10], numels, ready, 0.0, CollectiveModel(1e-3, 1e-9), element_size=4)
    assert slow.predicted_exposed_s < one


def test_bucket_numel_packs_as_the_sharded_layout() -> None:
    layout = compute_layout([100, 3, 70], bucket_size=None, sharded=True, dp_size=1)
    assert bucket_numel([70, 3, 100], param_align=64, pad_multiple=128) == layout.numel


def test_fit_collective_model_recovers_latency_and_bandwidth() -> None:
    m = fit_collective_model([(1000, 1e-4 + 1000e-9), (10**6, 1e-4 + 1e-3)])
    assert m.latency_s == pytest.approx(1e-4) and m.seconds_per_byte == pytest.approx(1e-9)
    with pytest.raises(ValueError, match="at least one"):
        fit_collective_model([])


def test_planner_input_errors_are_named() -> None:
    m = CollectiveModel(0.0, 0.0)
    with pytest.raises(ValueError, match="ready times"):
        plan_buckets([1, 2], [0.0], 0.0, m, element_size=4)
    with pytest.raises(ValueError, match="finite"):
        plan_buckets([1], [float("nan")], 0.0, m, element_size=4)
    with pytest.raises(ValueError, match="latency_s"):
        CollectiveModel(-1.0, 0.0)
    with pytest.raises(ValueError, match="bucket_ends"):
        compute_layout([1, 2], bucket_size=None, bucket_ends=[3])


def test_ready_times_take_the_median_of_measured_steps_relative_to_backward_end() -> None:
    events = [
        (0, "param_ready", 1.0), (1, "param_ready", 1.5), (-1, "backward_end", 2.0),  # skipped
        (1, "param_ready", 10.0), (0, "param_ready", 10.5), (-1, "backward_end", 11.0),
        (0, "param_ready", 20.2), (-1, "backward_end", 21.0),  # param 1 had no grad
        (1, "param_ready", 30.0), (0, "param_ready", 30.9), (-1, "backward_end", 31.0),
    ]  # fmt: skip
    ready, steps = ready_times(events, 2)
    assert steps == 3
    assert ready == pytest.approx([-0.5, -1.0])


class _MaxOver:
    """A fake all_reduce_max over made-up ranks' tensors."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others = others

    def all_reduce_max(self, tensor: torch.Tensor, group: object) -> None:
        for other in self.others:
            torch.maximum(tensor, other, out=tensor)


def test_agree_takes_the_elementwise_max_of_every_rank() -> None:
    mine = Measurement(
        (-0.5, -0.1), CollectiveModel(1e-5, 1e-9), 2, exposed_s=0.004, backward_s=0.05,
        quiet_backward_s=0.01, quiet_exposed_s=0.004,
    )  # fmt: skip
    # ready x2, latency, seconds per byte, exposed, backward, quiet backward, quiet exposed, steps
    theirs = torch.tensor(
        [-0.9, -0.01, 3e-5, 1e-10, 0.009, 0.02, 0.03, 0.001, 2.0], dtype=torch.float64
    )
    agreed = agree(mine, _MaxOver([theirs]), None, torch.device("cpu"))  # type: ignore[arg-type]
    assert agreed.ready_s == pytest.approx((-0.5, -0.01))
    assert (agreed.model.latency_s, agreed.model.seconds_per_byte) == pytest.approx((3e-5, 1e-9))
    assert agreed.steps == 2 and agreed.exposed_s == pytest.approx(0.009)
    assert (agreed.backward_s, agreed.quiet_backward_s, agreed.quiet_exposed_s) == pytest.approx(
        (0.05, 0.03, 0.004)
    )


def test_exposed_time_is_the_least_synced_minus_backward_end_after_the_first_step() -> None:
    events = [
        (-1, "backward_end", 1.0), (-1, "synced", 1.9),  # the first step: skipped
        (-1, "backward_end", 10.0), (-1, "synced", 10.2),
        (-1, "backward_end", 20.0), (-1, "synced", 20.5),
        (-1, "backward_end", 30.0), (-1, "synced", 30.3),
    ]  # fmt: skip
    assert exposed_time(events) == pytest.approx(0.2)
    assert exposed_time(events[:2]) == 0.0  # nothing measured: the probe stays as it is


def _tail_plan_exposed(model: CollectiveModel) -> float:
    """A plan's predicted exposed time: two buckets, the last ready at backward end."""
    return predict_exposed([1, 1], [1000, 1000], [-0.01, 0.0], 0.0, model, element_size=4)


def test_calibrate_slows_the_probe_to_the_measured_exposed_time_and_never_speeds_it() -> None:
    probe = CollectiveModel(1e-5, 1e-9)
    assert calibrate(probe, _tail_plan_exposed, 0.0) == (probe, 1.0)  # already pessimistic
    measured = 20 * _tail_plan_exposed(probe)
    model, factor = calibrate(probe, _tail_plan_exposed, measured)
    assert 1.0 < factor < MAX_SLOWDOWN
    assert model.seconds_per_byte == pytest.approx(probe.seconds_per_byte * factor)
    assert model.latency_s == pytest.approx(probe.latency_s * factor)
    assert measured <= _tail_plan_exposed(model) <= measured * (1 + 1e-6)  # the least factor
    capped, top = calibrate(probe, _tail_plan_exposed, 1e6)
    assert top == MAX_SLOWDOWN and capped.seconds_per_byte == probe.seconds_per_byte * top


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"bucket_size": "big"}, "bucket_size"),
        ({"bucket_size": "auto"}, "overlap_grad_reduce"),
        ({"bucket_size": "auto", "overlap_grad_reduce": True, "deterministic_reduction": True},
         "deterministic_reduction"),
        ({"bucket_size": "auto", "overlap_grad_reduce": True, "comm_hook": {"name": "reduce"}},
         "comm_hook"),
        ({"bucket_size": "auto", "overlap_grad_reduce": True, "auto_bucket_warmup_steps": 1},
         "auto_bucket_warmup_steps"),
        ({"bucket_size": "auto", "overlap_grad_reduce": True, "whole_param_owners": True,
          "use_distributed_optimizer": True}, "whole_param_owners"),
    ],
)  # fmt: skip
def test_auto_bucket_config_refusals_name_the_field(flags: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        megabuf.DistributedDataParallelConfig(**flags)


def test_auto_bucket_config_is_accepted_on_the_all_reduce_path() -> None:
    cfg = megabuf.DistributedDataParallelConfig(bucket_size="auto", overlap_grad_reduce=True)
    assert cfg.bucket_size == "auto" and cfg.auto_bucket_warmup_steps == 3
    for strategy in ("optim", "optim_grads", "optim_grads_params"):  # [Note: sharded auto ...]
        sharded = megabuf.DistributedDataParallelConfig(
            bucket_size="auto", overlap_grad_reduce=True, data_parallel_sharding_strategy=strategy
        )
        assert sharded.bucket_size == "auto", strategy


def test_overlap_report_says_before_which_step_the_buckets_were_replanned() -> None:
    def step(t: float, groups: int) -> list[tuple[int, str, float]]:
        ev = [(g, "ready", t + 0.1 * g) for g in range(groups)]
        ev += [(g, "dispatch", t + 0.1 * g + 0.01) for g in range(groups)]
        ev += [(-1, "backward_end", t + 1.0)]
        return ev + [(g, "finish", t + 1.1) for g in range(groups)]

    events = step(0.0, 4) + step(2.0, 4) + [(-1, "replan", 3.5)] + step(4.0, 2) + step(6.0, 2)
    report = analyze(events)
    assert report.replanned_before_step == 2 and len(report.steps[-1].groups) == 2
    assert "before step 2" in report.format()
    assert analyze(events, skip_steps=1).replanned_before_step == 1
    assert analyze(step(0.0, 3)).replanned_before_step is None


def test_inspect_shows_the_auto_start_plan_and_a_logged_re_plan() -> None:
    from megabuf.inspect import format_inspection, inspect_model
    from megabuf.pure.bucket_planner import parse_bucket_ends

    cfg = megabuf.DistributedDataParallelConfig(bucket_size="auto", overlap_grad_reduce=True)
    model = build_model("gpt_tiny")
    assert "auto:" in format_inspection(inspect_model(model, cfg, 2))
    info = inspect_model(model, cfg, 2, bucket_ends=parse_bucket_ends("14,21,26"))
    assert [len(b.layout.buckets) for b in info.buffers] == [3]
    assert "bucket_ends 14,21,26" in format_inspection(info)
    with pytest.raises(ValueError, match="bucket-ends"):
        parse_bucket_ends("14,x")


def test_a_new_plan_must_be_predicted_to_save_min_gain_of_the_backward() -> None:
    """The model leaves out per-bucket costs during backward: more buckets must be predicted to
    save MIN_GAIN of the backward's length, else the boundaries that ran are kept (many_small,
    BENCHMARKS.md); fewer buckets are taken when not predicted worse."""
    current = (BucketChoice((10,), (1000,), 0.010),)
    backward = 0.100
    small = (BucketChoice((5, 5), (500, 500), 0.010 - 0.5 * MIN_GAIN * backward),)
    large = (BucketChoice((5, 5), (500, 500), 0.010 - 2.0 * MIN_GAIN * backward),)
    assert not worth_changing(small, current, backward)  # more buckets for a small gain
    assert worth_changing(large, current, backward)
    fewer = (BucketChoice((10,), (1000,), 0.010),)
    two = (BucketChoice((5, 5), (500, 500), 0.010),)
    assert worth_changing(fewer, two, backward)  # fewer buckets, no worse: take it
    assert not worth_changing(fewer, (BucketChoice((5, 5), (500, 500), 0.009),), backward)


def test_two_live_optimizers_on_one_model_refuse_the_sharded_replan_by_name() -> None:
    """[Note: sharded auto bucket re-plan]: one optimizer carries its state across; two would
    each need to, so the re-plan raises. A dropped optimizer is neither kept alive nor called."""

    class Optimizer:
        def __init__(self) -> None:
            self.calls = 0

        def around(self, rebuild: Any) -> None:
            self.calls += 1
            rebuild()

    listeners = ReplanListeners(rank=1)
    first, second = Optimizer(), Optimizer()
    listeners.add(first.around)
    listeners.add(second.around)
    with pytest.raises(RuntimeError, match=r"2 megabuf optimizers .*rank 1"):
        listeners.run(lambda: None)
    del second
    rebuilt: list[int] = []
    listeners.run(lambda: rebuilt.append(1))
    assert rebuilt == [1] and first.calls == 1


def test_under_zero3_the_planner_counts_a_unit_ready_with_its_last_grad_and_cuts_at_unit_ends() -> (
    None
):
    """[Note: auto bucket re-plan]: a unit's bucket group is reduced once all of its grads are
    in, so every param of a unit gets the unit's latest ready time; the chosen ends cut at every
    unit end and the plan built from them is unit-aligned (no bucket spans two units)."""

    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, data_parallel_sharding_strategy="optim_grads_params"
    )
    planned = plan_model(
        build_model("gpt_tiny"), cfg, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True
    )
    plan, units = planned.plan, planned.plan.unit_of_spec
    assert units is not None and len(set(units)) == 3
    n = len(units)
    measured = Measurement(
        tuple(-0.01 * (i + 1) / n for i in range(n)), CollectiveModel(2e-5, 2e-9), 2
    )
    order, ready, unit_ends = placed(plan, plan.buffers[0], measured)
    for i, t in zip(order, ready):
        assert t == max(measured.ready_s[j] for j in range(n) if units[j] == units[i])
    assert sum(unit_ends) == 3 and unit_ends[-1]
    choices = choose_buckets(
        plan, [s.numel for s in param_specs(planned.trainable)], [False] * n, measured
    )
    cut_at = set(ends_of(choices[0]))
    assert {p + 1 for p, end in enumerate(unit_ends) if end} <= cut_at
    new = build_plan(
        param_specs(planned.trainable), cfg, dp_size=2, expt_dp_size=2,
        expert_shares_dp_group=True, unit_of_param=units, bucket_ends=[ends_of(choices[0])],
    )  # fmt: skip
    for bucket in new.buffers[0].layout.buckets:
        assert len({units[new.buffers[0].param_ids[p]] for p in bucket.param_ids}) == 1
    assert len(new.groups) == 3 and new.unit_of_spec == units


# ---- [Note: quiet step] (megabuf/replan/warmup.py) -----------------------------------------------
QUIET_EVENTS = [
    (0, "param_ready", 1.0), (1, "param_ready", 1.5), (-1, "backward_end", 2.0),  # learns
    (-1, "synced", 2.5),
    (1, "param_ready", 10.0), (0, "param_ready", 10.5), (-1, "backward_end", 11.0),
    (-1, "synced", 11.25),  # overlapped: backward 1.0 from the first grad, exposed 0.25
    (-1, "quiet", 11.5),
    (1, "param_ready", 20.2), (0, "param_ready", 20.4), (-1, "backward_end", 21.0),
    (-1, "synced", 21.75),  # quiet: backward 0.8, exposed 0.75
]  # fmt: skip


def test_the_quiet_step_is_left_out_of_the_overlapped_numbers_and_read_on_its_own() -> None:
    ready, steps = ready_times(QUIET_EVENTS, 2)
    assert steps == 1 and ready == pytest.approx([-0.5, -1.0])  # the overlapped step's only
    assert exposed_time(QUIET_EVENTS) == pytest.approx(0.25)
    assert backward_time(QUIET_EVENTS) == pytest.approx(1.0)
    assert quiet_times(QUIET_EVENTS) == pytest.approx((0.8, 0.75))
    plain = [e for e in QUIET_EVENTS if e[1] != "quiet"]  # no marker: three ordinary steps
    assert quiet_times(plain) == (0.0, 0.0) and ready_times(plain, 2)[1] == 2
    m = measured(QUIET_EVENTS, 2, CollectiveModel(1e-5, 1e-9))
    assert (m.steps, m.quiet_backward_s, m.quiet_exposed_s) == pytest.approx((1, 0.8, 0.75))


def test_reducing_after_backward_must_save_min_gain_of_the_overlapped_backward() -> None:
    # many_small's measured numbers (ms): overlapped 63.2 backward + 3.0 exposed; after
    # backward 54.5 + ~3; mlp_34m's: 183.6 + 29.7 overlapped, 140.6 + ~106 after
    assert reduce_at_end(63.2 + 3.0, 54.5 + 3.0, 63.2)
    assert not reduce_at_end(183.6 + 29.7, 140.6 + 106.0, 183.6)
    backward = 100.0
    assert not reduce_at_end(110.0, 110.0 - 0.5 * MIN_GAIN * backward, backward)  # too small
    assert reduce_at_end(110.0, 110.0 - MIN_GAIN * backward, backward)


def _no_shard_plan(bucket_size: int):  # type: ignore[no-untyped-def]
    cfg = megabuf.DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=bucket_size)
    planned = plan_model(
        build_model("gpt_tiny"), cfg, dp_size=2, expt_dp_size=2, expert_shares_dp_group=True
    )
    return planned.plan, [s.numel for s in param_specs(planned.trainable)]


def test_at_end_is_the_fewest_buckets_with_the_model_calibrated_on_the_quiet_step() -> None:
    """Each buffer one bucket (but for params with a bucket of their own), predicted with the
    probe slowed until the plan that ran, reduced after backward, takes the quiet exposed time."""
    plan, numels = _no_shard_plan(20_000)
    assert len(plan.buffers[0].layout.buckets) > 2
    n = len(numels)
    m = Measurement(tuple(-0.001 * i for i in range(n)), CollectiveModel(1e-5, 1e-10), 1,
                    quiet_backward_s=0.01, quiet_exposed_s=0.004)  # fmt: skip
    end = at_end(plan, numels, [False] * n, m)
    assert [c.param_counts for c in end] == [(n,)]
    own = [i == n // 2 for i in range(n)]  # a param with a bucket of its own: cut both sides
    assert len(at_end(plan, numels, own, m)[0].param_counts) == 3
    # the calibrated model: the plan that ran, all after backward, takes 4 ms; one bucket saves
    # the latencies of the others, so it is predicted below that
    assert 0 < end[0].predicted_exposed_s < 0.004
    fast = replace(m, quiet_exposed_s=0.0)  # the probe already predicts more: kept as it is
    ran = current_choices(plan, numels, replace(fast, ready_s=(0.0,) * n))
    probe_end = at_end(plan, numels, [False] * n, fast)[0].predicted_exposed_s
    assert probe_end <= sum(c.predicted_exposed_s for c in ran)


class _Size:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self, group: object = None) -> int:
        return self.n


@pytest.mark.parametrize(
    ("flags", "dp", "quiet_at"),
    [
        ({}, 2, 2),  # the third of 3 warm-up steps
        ({"auto_bucket_warmup_steps": 5}, 2, 4),
        ({"auto_bucket_warmup_steps": 2}, 2, None),  # 2: one measured step, which overlaps
        ({"data_parallel_sharding_strategy": "optim"}, 2, 2),
        ({"data_parallel_sharding_strategy": "optim_grads"}, 2, None),
        ({"data_parallel_sharding_strategy": "optim_grads_params"}, 2, None),
        ({}, 1, None),  # nothing to overlap
    ],
)
def test_the_quiet_step_is_the_last_warmup_step_where_grads_are_not_sharded(
    flags: dict, dp: int, quiet_at: int | None
) -> None:
    cfg = megabuf.DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size="auto", **flags
    )
    param = torch.nn.Parameter(torch.zeros(2))
    owner = _Size(dp)  # any object that takes a weak reference
    auto = AutoBucket([("w", param)], cfg, _Size(dp), None, torch.device("cpu"), owner)  # type: ignore[arg-type]
    seen = []
    for syncs in range(cfg.auto_bucket_warmup_steps + 1):
        auto.syncs = syncs
        if auto.quiet_next:
            seen.append(syncs)
            auto.begin_quiet()
            auto.begin_quiet()  # zero_grad_buffer() twice: one marker
    assert seen == ([] if quiet_at is None else [quiet_at])
    assert sum(e[1] == "quiet" for e in auto.timeline.events) == len(seen)
    auto.close()
