"""bucket_size="auto" ([Note: auto bucket re-plan] in megabuf/replan/autobucket.py) on 2 gloo ranks:
the re-plan is bitwise invisible, agreed across ranks with asymmetric timings, and refuses by
name."""

from __future__ import annotations

from typing import Any

import pytest
from autobucket_cases import (
    checkpoint_case,
    hook_refused_case,
    measured_case,
    memory_kept_case,
    no_sync_deferral_case,
    quiet_step_case,
    replan_case,
    world_one_case,
    zero3_case,
    zero3_offload_refused_case,
)
from autobucket_loop_cases import torch_loop_case
from dist_pool import case_result, run_each
from matrix_cases import pp_ep_case

ZERO1 = {"data_parallel_sharding_strategy": "optim", "overlap_param_gather": True}
ZERO2 = {"data_parallel_sharding_strategy": "optim_grads"}
ZERO3 = {"data_parallel_sharding_strategy": "optim_grads_params"}
CASES: dict[str, tuple[Any, ...]] = {
    "megabuf_opt": (replan_case, {}, "megabuf", 1),
    "torch_opt_fp32_accum": (replan_case, {"grad_reduce_in_fp32": True}, "torch", 2),
    # [Note: sharded auto bucket re-plan]: the optimizer's state carried across new buffers
    "zero1_overlap_gather": (replan_case, ZERO1, "megabuf", 1),
    "zero2_fp32_accum": (replan_case, {**ZERO2, "grad_reduce_in_fp32": True}, "megabuf", 2),
    # ZeRO-3: the params gathered, rebuilt on the new plan, sharded again; asymmetric timings
    "zero3_units": (zero3_case, {"shard_units": ("_Block",)}, 1),
    "zero3_accum_no_prefetch": (
        zero3_case,
        {"prefetch_units": 0, "reshard_after_forward": False},
        2,
    ),
    "zero3_poisoned_fp32_accum": (
        zero3_case,
        {"verify_param_access": True, "grad_reduce_in_fp32": True},
        1,
    ),
    # bf16 without clipping: the clip norm sums per-shard partial norms that follow the plan, and
    # two plans can round it apart (1 bf16 ulp on this session's AMD EPYC without AVX-512, equal on
    # earlier sessions' machines)
    "zero3_bf16_fp32_main": (zero3_case, {"grad_reduce_in_fp32": True}, 2, 0.0, True),
    "zero3_offload_refused": (zero3_offload_refused_case,),
    "zero3_memory_kept": (memory_kept_case, ZERO3),
    "zero1_memory_kept": (memory_kept_case, ZERO1),
    "measured": (measured_case,),
    "zero3_measured": (measured_case, ZERO3),
    "hook_refused": (hook_refused_case,),
    "no_sync_deferral": (no_sync_deferral_case,),
    # [Note: quiet step]: injected numbers for and against reducing after backward
    "quiet_end": (quiet_step_case, 0.001),
    "quiet_overlap": (quiet_step_case, 0.050),
    "quiet_end_zero1": (quiet_step_case, 0.001, ZERO1),
    "quiet_none_zero2": (quiet_step_case, 0.001, ZERO2),
    # [Note: auto bucket re-plan in a torch-style loop]
    "torch_loop": (torch_loop_case, 1),
    "torch_loop_micro": (torch_loop_case, 2),
    "torch_loop_in_place_rank1": (torch_loop_case, 1, 1),
}
REPLAN = ("megabuf_opt", "torch_opt_fp32_accum", "zero1_overlap_gather", "zero2_fp32_accum")


@pytest.fixture(scope="module")
def results(pools: Any, tmp_path_factory: Any) -> list[dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("autobucket"))
    cases = {
        **CASES,
        "checkpoint": (checkpoint_case, root),
        "checkpoint_zero2": (checkpoint_case, root, ZERO2),
        "checkpoint_zero3": (checkpoint_case, root, ZERO3),
    }
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", REPLAN)
def test_replan_mid_training_is_bitwise_invisible(results: Any, name: str) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["auto_done"], res
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["max_diff"] == 0.0, f"rank {rank}: re-plan at step k changed the params: {res}"
        # another bucket plan only regroups the same 2-rank sums (the clip norm may round apart)
        assert res["vs_default"] <= 1e-6, f"rank {rank}: differs from the default plan: {res}"
        assert res["views_ok"], f"rank {rank}: a main_grad view or group membership was lost"
        assert res["ledger_ok"], f"rank {rank}: the ledger's grad shards are not the new ones"
        assert res["groups"] != res["default_groups"], "the re-plan changed nothing: no test"


@pytest.mark.parametrize("name", REPLAN)
def test_every_rank_plans_from_the_agreed_max_even_with_asymmetric_timings(
    results: Any, name: str
) -> None:
    per_rank = case_result(results, name)
    assert all(r["ends"] == per_rank[0]["ends"] for r in per_rank), per_rank
    for res in per_rank:
        assert res["worth_changing"], res  # the injected numbers favour a new plan clearly
        assert res["ends"] == res["expected_ends"], res


@pytest.mark.parametrize("name", ["measured", "zero3_measured"])
def test_measured_warmup_replans_the_same_on_every_rank(results: Any, name: str) -> None:
    for res in case_result(results, name):
        assert res["replanned"] and res["same_plan"] and res["ends"] is not None, res
        assert res["groups_last_step"] == res["groups"], res  # the timeline follows new groups
        assert res["replanned_before_step"] == 2, res  # warm-up of 2 steps
        assert "re-planned (bucket_size=auto) before step 2" in res["report_text"], res
        # the warm-up's two syncs were timed and calibrated the probe ([Note: calibrated
        # collective model]); the factor is logged with the plan
        assert res["synced_events"] == 2 and "the probe slowed" in res["summary"], res


def test_replan_with_a_comm_hook_registered_is_refused_by_name(results: Any) -> None:
    for res in case_result(results, "hook_refused"):
        assert "cannot register comm hook" in res["error"], res
        assert "re-plan" in res["error"] and "reduce" in res["error"].lower(), res
        # registered after the re-plan: every bucket of the new plan reduced once by the hook
        # (how many buckets follows the measured timings: one on a loaded machine, once seen)
        assert res["dispatches"] == [1] * res["buckets"] and res["buckets"] >= 1, res


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint_zero2", "checkpoint_zero3"])
def test_a_checkpoint_saved_after_the_replan_loads_into_a_model_that_never_replanned(
    results: Any, name: str
) -> None:
    for rank, res in enumerate(case_result(results, name)):
        assert res["replanned"] and res["plans"][0] is not None, res
        assert res["plans"][1] is None, res  # the loading model keeps its sized plan
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["loaded"] == 0.0, f"rank {rank}: {res}"
        # both continue on the same state; only the bucket regrouping of the clip norm differs
        assert res["continued"] <= 1e-6, f"rank {rank}: {res}"


ZERO3_DP2 = (
    "zero3_units",
    "zero3_accum_no_prefetch",
    "zero3_poisoned_fp32_accum",
    "zero3_bf16_fp32_main",
)


@pytest.fixture(scope="module")
def zero3_dp4(pools: Any) -> list[dict[str, Any]]:
    cases = {
        "zero3_dp4": (zero3_case, {"shard_units": ("_Block",)}, 2),
        # hybrid (2 replicas x 2-way shards): bitwise without clipping; with it the norm's
        # per-shard sums follow the plan's shards and two plans round it apart here (ZeRO-2
        # too), before the re-plan as after it
        "zero3_dp4_hybrid": (zero3_case, {"num_distributed_optimizer_instances": 2}, 1, 0.0),
    }
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


def _zero3_result(results: Any, zero3_dp4: Any, name: str) -> list[dict[str, Any]]:
    return case_result(zero3_dp4 if name.startswith("zero3_dp4") else results, name)


@pytest.mark.parametrize("name", [*ZERO3_DP2, "zero3_dp4", "zero3_dp4_hybrid"])
def test_zero3_replan_is_bitwise_invisible_and_agreed_with_asymmetric_timings(
    results: Any, zero3_dp4: Any, name: str
) -> None:
    """[Note: sharded auto bucket re-plan] under optim_grads_params: N AdamW steps with the
    re-plan at step k == N steps on a model built on that plan from the start, bitwise; every
    rank (rank 0's injected timings wildly unlike the others') ends with the plan chosen from
    the agreed MAX, one bucket per shard unit, not the default's."""
    per_rank = _zero3_result(results, zero3_dp4, name)
    for rank, res in enumerate(per_rank):
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["max_diff"] == 0.0, f"rank {rank}: re-plan at step k changed the params: {res}"
        assert res["changed"] and res["same_plan"], (rank, res)
        assert res["ends"] == res["expected_ends"] == per_rank[0]["ends"], (rank, res)
        assert len(res["ends"][0]) == res["units"], (rank, res)  # the planner cut at unit ends


@pytest.mark.parametrize("name", [*ZERO3_DP2, "zero3_dp4", "zero3_dp4_hybrid"])
def test_zero3_ledger_after_the_replan_equals_a_fresh_model_on_that_plan(
    results: Any, zero3_dp4: Any, name: str
) -> None:
    """Old param shards, gathered params and grad shards leave the ledger (no leak, nothing
    freed twice): right after the re-plan it holds what a model built on the new plan holds,
    the old bucket groups are garbage (nothing keeps their storage alive), and after training
    the storage walk of both (model and optimizer) is the same."""
    for rank, res in enumerate(_zero3_result(results, zero3_dp4, name)):
        assert res["ledger"] == res["fresh_ledger"], (rank, res)
        assert res["old_groups_alive"] == 0, (rank, res)
        assert res["ledger"]["param_shard"] > 0 and res["ledger"]["grad_shard"] > 0, res
        assert res["walk"][0] == res["walk"][1], (rank, res)


def test_zero3_replan_with_cpu_offload_is_refused_by_name_and_training_goes_on(
    results: Any,
) -> None:
    for res in case_result(results, "zero3_offload_refused"):
        assert "cpu_offload" in res["error"] and "bucket_size" in res["error"], res
        assert res["kept"] and res["ends"] is None, res  # nothing rebuilt: the old plan trains


@pytest.mark.parametrize("name", ["zero3_memory_kept", "zero1_memory_kept"])
def test_a_sharded_replan_that_would_not_fit_keeps_the_plan_on_every_rank(
    results: Any, name: str
) -> None:
    """[Note: sharded auto bucket re-plan]: one rank short of device memory for the new
    buffers beside the old (ZeRO-3: the whole params twice): both ranks keep the old plan (no
    hang, no OOM), warn naming the memory and the int bucket_size way out, and train on."""
    for res in case_result(results, name):
        assert res["kept"] and res["auto_kept"] and res["finite"], res
        assert len(res["warnings"]) == 1 and "device memory" in res["warnings"][0], res
        assert "int bucket_size" in res["summary"], res


@pytest.fixture(scope="module")
def pp_results(pools: Any) -> list[dict[str, Any]]:
    cases = {
        f"pp2_ep{ep}_{strategy}": (pp_ep_case, strategy, ep, False, False, False, True)
        for strategy, ep in PP_CASES
    }
    return pools(4).run(run_each, cases)  # type: ignore[no-any-return]


PP_CASES = (("no_shard", 1), ("no_shard", 2), ("optim_grads", 2), ("optim_grads_params", 2))


@pytest.mark.parametrize(("strategy", "ep"), PP_CASES)
def test_pipeline_chunks_and_expert_buffers_replan_per_chunk_and_match_the_whole_model(
    pp_results: Any, strategy: str, ep: int
) -> None:
    """pp 2 on 4 ranks (1F1B, 3 micro-batches; the experts of stage 0 in a buffer of their own,
    reduced over expert dp 1 at ep 2): each chunk re-plans after its 2 warm-up syncs from
    numbers agreed over its own dp group (both ranks of a stage end with the same plan,
    measured, not injected), and the 4 clipped SGD steps still give the whole model's norm and
    params on every rank; under "optim_grads" and "optim_grads_params" on new buffers ([Note:
    sharded auto bucket re-plan])."""
    per_rank = case_result(pp_results, f"pp2_ep{ep}_{strategy}")
    for rank, res in enumerate(per_rank):
        assert res["replanned"] and res["ends"] is not None, (rank, res)
        # one boundary list per buffer: stage 0 holds the dense and the expert buffer
        assert len(res["ends"]) == (2 if res["pp_rank"] == 0 else 1), res
        assert len(res["norms"]) == 4, res
        for step, norm in enumerate(res["norms"]):
            assert abs(norm["got"] - norm["want"]) <= 1e-5 * norm["want"], (rank, step, norm)
        worst = max(res["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-6, (rank, worst)
    for stage in (0, 1):
        ends = {str(r["ends"]) for r in per_rank if r["pp_rank"] == stage}
        assert len(ends) == 1, (stage, ends)  # one plan per stage, on both of its dp ranks


def test_at_world_one_the_replan_keeps_the_plan_that_ran(pools: Any) -> None:
    """Nothing crosses a link at dp 1: the plan must not fragment buckets (issue 30's world-1
    target), and a rebuild would only cost memory ([Note: auto bucket plan at dp 1]); on both
    paths the plan that ran stays, on the same buffers, and the log says why."""
    (out,) = case_result(pools(1).run(run_each, {"w1": (world_one_case,)}), "w1")
    for path, res in out.items():
        assert res["replanned"] and res["kept"] and res["same_buffers"], (path, res)
        assert res["after"] == res["before"], (path, res)
        assert "nothing to overlap" in res["summary"], (path, res)
        # the warm-up's timeline stops growing: a kept plan's grad syncs still call it
        assert len(set(res["events_after_replan"])) == 1, (path, res)


def test_a_due_replan_waits_for_a_zero_grad_buffer_outside_no_sync(results: Any) -> None:
    for res in case_result(results, "no_sync_deferral"):
        assert not res["inside"] and res["after"], res
        assert res["require"] and res["same_grads"], res  # the new grad sync reduces


@pytest.mark.parametrize("name", ["quiet_end", "quiet_overlap", "quiet_end_zero1"])
def test_the_last_warmup_step_is_quiet_and_reduces_the_same_grads_bitwise(
    results: Any, name: str
) -> None:
    """[Note: quiet step]: with 3 warm-up steps the third reduces after backward (no group is
    ready during it; the second, overlapped, had some, and so have the steps after the
    re-plan), its numbers are measured, one
    overlapped step is, and the run equals one on the chosen plan from the start, bitwise."""
    for rank, res in enumerate(case_result(results, name)):
        ready = res["ready_per_step"]
        # the first step learns the arrivals, as does the first on rebuilt groups; then overlap
        assert ready[0] == 0 and ready[1] > 0 and ready[2] == 0 and ready[-1] > 0, (rank, ready)
        assert res["real"]["steps"] == 1 and min(res["real"]["quiet"]) > 0, (rank, res["real"])
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["max_diff"] == 0.0, (rank, res)


def test_reducing_after_backward_is_chosen_only_where_the_quiet_step_says_it_pays(
    results: Any,
) -> None:
    """Quiet backward 1 ms against 10 ms overlapped: one bucket per buffer at backward's end,
    the same on both ranks, the comparison logged; quiet backward 50 ms: overlap stays."""
    for name in ("quiet_end", "quiet_end_zero1"):
        per_rank = case_result(results, name)
        for res in per_rank:
            assert res["at_end"] and res["buckets"] == [1] * len(res["buckets"]), res
            assert res["default_buckets"] != res["buckets"], "one bucket already: no test"
            assert "-> reduce each buffer after backward" in res["summary"], res["summary"]
        assert per_rank[0]["buckets"] == per_rank[1]["buckets"]
    for res in case_result(results, "quiet_overlap"):
        assert not res["at_end"] and max(res["buckets"]) > 1, res
        assert "quiet step: overlapped: backward 10.0 ms" in res["summary"], res["summary"]
        assert "quiet backward 50.0 ms" in res["summary"] and "-> overlap" in res["summary"]


def test_no_quiet_step_where_the_grads_are_sharded(results: Any) -> None:
    """optim_grads: reducing after backward would hold every full grad bucket to the end, the
    memory the strategy saves: every warm-up step overlaps and nothing is weighed."""
    for res in case_result(results, "quiet_none_zero2"):
        ready = res["ready_per_step"]  # (the 4th step relearns arrivals on rebuilt groups)
        assert ready[1] > 0 and ready[2] > 0 and res["real"]["quiet"] == (0.0, 0.0), res
        assert not res["at_end"] and "quiet step" not in res["summary"], res
        assert res["max_diff"] == 0.0, res


def test_a_torch_style_loop_gets_the_quiet_step_and_the_replan_bitwise(results: Any) -> None:
    """optimizer.zero_grad() and backward's own sync, never zero_grad_buffer(): the third
    warm-up step is quiet, the re-plan runs at the next forward, the same on both ranks, and
    the run equals that plan from the start bitwise."""
    for rank, res in enumerate(case_result(results, "torch_loop")):
        assert res["replanned"] and not res["kept"] and res["same_plan"], res
        assert res["groups"] != res["default_groups"], "the re-plan changed nothing: no test"
        ready = res["ready_per_step"]
        assert ready[0] == 0 and ready[1] > 0 and ready[2] == 0 and ready[-1] > 0, (rank, ready)
        assert res["real"]["steps"] == 1 and min(res["real"]["quiet"]) > 0, (rank, res["real"])
        assert res["warnings"] == [] and res["hooks_left"] == 0, res
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["max_diff"] == 0.0, (rank, res)


@pytest.mark.parametrize("name", ["torch_loop_micro", "torch_loop_in_place_rank1"])
def test_a_loop_with_no_iteration_start_keeps_the_default_plan_and_says_how(
    results: Any, name: str
) -> None:
    """Micro-batches whose first forward runs inside no_sync(), or one rank zeroing grads in
    place: no forward starts an iteration with every rank's grads cleared, so no rank
    re-plans (no hang, one plan); after 2 syncs past the warm-up the default plan is kept on
    every rank with a warning naming the ways, the warm-up's hooks gone, training bitwise that
    of the default plan."""
    per_rank = case_result(results, name)
    for rank, res in enumerate(per_rank):
        assert res["replanned"] and res["kept"] and res["same_plan"], res
        assert res["groups"] == res["default_groups"], res
        assert len(res["warnings"]) == 1, res["warnings"]
        text = res["warnings"][0]
        assert f"rank {rank}" in text and "5 grad syncs" in text, text
        assert "model.zero_grad()" in text and "set every .grad to None" in text, text
        assert res["hooks_left"] == 0 and res["events_left"] == 0, res
        assert res["moved"] > 1e-3, "training did not move the params: the test proves nothing"
        assert res["vs_default"] == 0.0, (rank, res)
