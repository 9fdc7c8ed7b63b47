"""Streamed export and publishing of weights ([Note: streamed export], [Note: publish
protocol]): pure tests of the publish decision, and real gloo ranks (publish_cases.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from dist_pool import case_result, run_each
from publish_cases import (
    async_case,
    delta_case,
    dtype_switch_case,
    export_case,
    export_live_case,
    failure_case,
    hybrid_delta_case,
    late_join_case,
    publish_case,
    relayout_case,
    weight_transfer_case,
)

from megabuf.weights.transfer import (
    BucketEntry,
    ConsumerHeader,
    ParamEntry,
    TrainerHeader,
    decide,
    holding,
    send_range,
)

EXPORT = {s: (export_case, s) for s in ("optim", "optim_grads", "optim_grads_params")}
LIVE = {f"live-{m}": (export_live_case, m) for m in (1, 2)}
PUBLISH = {
    "no_shard": (publish_case, "no_shard", None, False),
    "optim-late": (publish_case, "optim", None, True),
    "optim_grads_params-bf16": (publish_case, "optim_grads_params", "bfloat16", False),
}
FAILURES = {k: (failure_case, k) for k in ("version", "death")}
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
SWITCH = {f"switch-{s}": (dtype_switch_case, s) for s in STRATEGIES}
DELTA = {f"delta-{s}": (delta_case, s) for s in STRATEGIES}
DELTA4 = {f"delta4-{s}": (delta_case, s, 4) for s in STRATEGIES}
ASYNC = {f"async-{s}": (async_case, s) for s in STRATEGIES}
HYBRID_STRATEGIES = STRATEGIES[1:]  # a split needs a sharded strategy
HYBRID = {
    f"hybrid-{s}{'-async' if a else ''}": (hybrid_delta_case, s, a)
    for s in HYBRID_STRATEGIES
    for a in (False, True)
}
LATE = {f"late-{s}": (late_join_case, s) for s in STRATEGIES}
RELAYOUT = {f"relayout-{s}": (relayout_case, s) for s in ("no_shard", "optim", STRATEGIES[3])}


@pytest.fixture(scope="module")
def exported(pools: Any) -> list[dict[str, Any]]:
    return pools(2).run(run_each, {**EXPORT, **LIVE})


@pytest.fixture(scope="module")
def published4(pools: Any) -> list[dict[str, Any]]:
    return pools(5).run(run_each, {**DELTA4, **HYBRID, **LATE})


@pytest.fixture(scope="module")
def published(pools: Any) -> list[dict[str, Any]]:
    cases = {**PUBLISH, **FAILURES, **SWITCH, **RELAYOUT, **DELTA, **ASYNC}
    return pools(3).run(run_each, {**cases, "transfer": (weight_transfer_case,)})


@pytest.mark.parametrize("name", list(EXPORT))
def test_export_after_overlapped_step_is_the_fresh_params(exported: Any, name: str) -> None:
    """Gathers were in flight when the export started (optim, optim_grads): it waited; the
    export equals the twin trained without overlap bitwise and differs from the pre-step
    params (a stale publish would equal those). The items are read after the whole export ran
    (`list()`): under ZeRO-3 too they hold the values (each owns its gathered memory), and the
    ledger's "weight_export" peak is the largest two consecutive groups (max_buckets=2)."""
    for out in case_result(exported, name):
        if name != "optim_grads_params":
            assert out["in_flight"] > 0
        got = {n: t for _, _, named in out["items"] for n, t in named}
        assert got.keys() == out["twin"].keys()
        for key, ref in out["twin"].items():
            assert torch.equal(got[key], ref), key
        assert any(not torch.equal(got[k], out["before"][k]) for k in got)
        assert [v for v, _, _ in out["items"]] == [2] * len(out["items"])  # applied updates
        assert [i for _, i, _ in out["items"]] == list(range(len(out["items"])))
        assert out["peak"] == out["formula_peak"]  # ZeRO-3: at most 2 groups gathered
        assert out["export_ledger_now"] == 0
        assert set(out["states_after_close"]) <= {"SHARDED"}


@pytest.mark.parametrize("name", list(LIVE))
def test_zero3_export_holds_at_most_max_buckets_groups_in_real_memory(
    exported: Any, name: str
) -> None:
    """Issue 44, defect 2 ([Note: streamed export]): with a consumer that keeps nothing past its
    turn, at every gather of a ZeRO-3 export the gathered groups still alive (weak references,
    not the ledger) number at most `max_buckets`, their storages' bytes at most the largest
    `max_buckets` consecutive groups; the values are the params bitwise."""
    max_buckets = int(name.split("-")[1])
    for out in case_result(exported, name):
        assert out["groups"] > max_buckets  # several gathers, so a held group would show
        assert out["live_groups"] == max_buckets
        assert out["live_nbytes"] <= out["formula"]
        assert out["bitwise"]


@pytest.mark.parametrize("name", list(EXPORT))
def test_export_cast_and_name_map(exported: Any, name: str) -> None:
    for out in case_result(exported, name):
        cast = dict(out["cast"])
        for key, ref in out["twin"].items():
            if ref.dim() == 2:
                top, bottom = ref.to(torch.bfloat16).chunk(2, dim=0)
                assert torch.equal(cast[f"consumer.{key}.top"], top)
                assert torch.equal(cast[f"consumer.{key}.bottom"], bottom)
            else:
                assert torch.equal(cast[f"consumer.{key}"], ref.to(torch.bfloat16))


@pytest.mark.parametrize("name", list(PUBLISH))
def test_consumer_receives_every_version_bitwise(published: Any, name: str) -> None:
    """Versions 1 (all buckets), 2 (changed-only, nothing changed: nothing sent), 3
    (changed-only after a step that left the first layer alone: only the others sent)."""
    trainer0, trainer1, consumer = case_result(published, name)
    dtype = torch.bfloat16 if "bf16" in name else None
    for v in range(3):
        ref = trainer0["versions"][v]
        assert all(torch.equal(ref[k], trainer1["versions"][v][k]) for k in ref)
        got = consumer["versions"][v]
        assert got.keys() == {f"inference.{k}" for k in ref}
        for key, tensor in ref.items():
            want = tensor.to(dtype) if dtype is not None else tensor
            assert torch.equal(got[f"inference.{key}"], want), (v, key)
    every = tuple(range(trainer0["buckets"]))
    assert trainer0["sent"][0] == every and consumer["sent"][0] == every
    assert trainer0["sent"][1] == ()
    assert () < trainer0["sent"][2] < every  # some buckets (the first layer's) did not change
    assert consumer["sent"] == trainer0["sent"] == trainer1["sent"]
    for trainer in (trainer0, trainer1):  # at most one slice copy held: the largest
        assert trainer["publish_peak"] == trainer["publish_peak_formula"]


@pytest.mark.parametrize("name", list(SWITCH))
def test_dtype_switch_under_changed_only_sends_every_bucket(published: Any, name: str) -> None:
    """Issue 44, defect 1 ([Note: what a consumer holds]): fp32, then bf16 with changed_only,
    then fp32 with changed_only after a step; the frozen first layer's values are exact in
    bf16, so its slices compare equal across each switch. The consumer's copy is bitwise the
    trainers' params in the version's dtype every time (never the zeros of its reallocated
    copy): a switch sends every bucket."""
    trainer0, trainer1, consumer = case_result(published, name)
    every = tuple(range(trainer0["buckets"]))
    for v in range(3):
        ref = trainer0["versions"][v]
        assert all(torch.equal(ref[k], trainer1["versions"][v][k]) for k in ref)
        got = consumer["versions"][v]
        assert got.keys() == ref.keys()
        for key, tensor in ref.items():
            assert got[key].dtype == tensor.dtype, (v, key)
            assert torch.equal(got[key], tensor), (v, key)
        assert trainer0["sent"][v] == every, v


@pytest.mark.parametrize("name", list(RELAYOUT))
def test_publisher_follows_a_bucket_replan(published: Any, name: str) -> None:
    """[Note: what a consumer holds], a layout change: a Publisher built before the engine
    re-planned its buckets (bucket_size="auto" after its warm-up) publishes the new buckets;
    the consumer's copy is the trainers' params bitwise at every version, the first publish
    after the re-plan sends every new bucket, and the next changed-only publish sends only
    changed ones again."""
    trainer0, trainer1, consumer = case_result(published, name)
    if "optim_grads_params" not in name:  # ZeRO-3: a bucket per layer either way (new buffers)
        assert trainer0["buckets"][0] > trainer0["buckets"][1] == 1  # the re-plan took effect
    for v in range(3):
        ref = trainer0["versions"][v]
        assert all(torch.equal(ref[k], trainer1["versions"][v][k]) for k in ref)
        assert consumer["versions"][v].keys() == ref.keys()
        for key, tensor in ref.items():
            assert torch.equal(consumer["versions"][v][key], tensor), (v, key)
    assert trainer0["sent"][1] == tuple(range(trainer0["buckets"][1]))  # new layout: in full
    assert trainer0["sent"][2]  # a step: the trainers see their new buckets change


@pytest.mark.parametrize("name", list(DELTA))
def test_element_deltas_keep_the_consumer_bitwise(published: Any, name: str) -> None:
    """[Note: element deltas]: the consumer's copy is bitwise the trainers' params (bf16) at
    every version; versions 2, 3 and 6 go as deltas and send fewer bytes than a whole publish,
    version 1 (a new consumer), 4 (the anchor, anchor_every=3) and 5 (a restarted consumer)
    whole."""
    _check_deltas(case_result(published, name))


@pytest.mark.parametrize("name", list(DELTA4))
def test_element_deltas_keep_the_consumer_bitwise_at_dp4(published4: Any, name: str) -> None:
    """The same at dp 4 (4 trainers, each sending its quarter's changed elements)."""
    _check_deltas(case_result(published4, name))


def _check_deltas(ranks: list[dict[str, Any]]) -> None:
    *trainers, consumer = ranks
    lead = trainers[0]
    for v in range(6):
        ref = lead["versions"][v]
        assert all(torch.equal(ref[k], t["versions"][v][k]) for t in trainers for k in ref)
        assert consumer["versions"][v].keys() == ref.keys()
        for key, tensor in ref.items():
            assert torch.equal(consumer["versions"][v][key], tensor), (v, key)
    as_delta = [bool(d) for d in lead["deltas"]]
    assert as_delta == [False, True, True, False, False, True]
    for v, trainer in itertools.product((1, 2, 5), trainers):
        assert trainer["nbytes"][v] < trainer["whole_nbytes"], v  # this trainer's slices whole
    assert all(0 < d < 0.5 for d in lead["density"]), lead["density"]


@pytest.mark.parametrize("name", list(HYBRID))
def test_element_deltas_under_a_2x2_split(published4: Any, name: str) -> None:
    """[Note: element deltas] under [Note: publishing from replicas]: ranks 0-3 train as 2
    replicas x 2 shards, ranks 0 and 1 send bf16 deltas of their shards to rank 4, whose copy
    is bitwise every trainer's params at every version: 1 whole, 2 and 3 deltas, 4 the anchor
    (anchor_every=3), 5 a delta, each delta version fewer bytes than a whole one. `-async`
    (fp32 on the wire, the whole slices views of the model's shard): each version
    start_publish()ed while all four ranks ran the next step at once (which moved the params)
    and a slowed consumer had not received yet ([Note: asynchronous publish])."""
    *trainers, consumer = case_result(published4, name)
    for v in range(5):
        ref = trainers[0]["versions"][v]
        assert all(torch.equal(ref[k], t["versions"][v][k]) for t in trainers for k in ref), v
        assert consumer["versions"][v].keys() == ref.keys()
        for key, tensor in ref.items():
            assert torch.equal(consumer["versions"][v][key], tensor), (v, key)
        if name.endswith("-async"):
            after = trainers[0]["after"][v]
            assert any(not torch.equal(after[k], ref[k]) for k in ref), v
    for trainer in trainers[:2]:
        assert [bool(d) for d in trainer["deltas"]] == [False, True, True, False, True]
        sparse = [v for v in (1, 2, 4) if any(k > 0 for row in trainer["deltas"][v] for k in row)]
        assert sparse == [1, 2, 4], trainer["deltas"]  # element patches, not whole slices
        assert all(trainer["nbytes"][v] < trainer["whole_nbytes"] for v in (1, 2, 4))
    assert trainers[2]["deltas"] == trainers[3]["deltas"] == []  # replica 1 sends nothing


@pytest.mark.parametrize("name", list(LATE))
def test_a_consumer_joining_late_gets_an_anchor_then_deltas(published4: Any, name: str) -> None:
    """[Note: element deltas]: rank 2 consumes from version 1 (deltas from 2), rank 3 joins at
    version 4 (`use_group` to a group with both). Version 4 is whole for both (the joiner
    holds nothing: a delta would patch its zeros), 5 and 6 deltas again; both copies are
    bitwise the trainers' params at every version each received, every strategy at dp 2."""
    trainer0, trainer1, early, late, _ = case_result(published4, name)
    assert list(early["versions"]) == [1, 2, 3, 4, 5, 6] and list(late["versions"]) == [4, 5, 6]
    for consumer in (early, late):
        for v, got in consumer["versions"].items():
            ref = trainer0["versions"][v]
            assert all(torch.equal(ref[k], trainer1["versions"][v][k]) for k in ref)
            assert got.keys() == ref.keys()
            for key, tensor in ref.items():
                assert torch.equal(got[key], tensor), (v, key)
    assert trainer0["deltas"] == trainer1["deltas"] == [False, True, True, False, True, True]


def test_four_phase_receiver_loads_every_version_into_a_stand_in_engine(published: Any) -> None:
    """[Note: four-phase receiver]: an engine speaking init / start / update / finish gets the
    trainers' weights (bf16 values, deltas after the first) in its own model at every version,
    and a call out of order is refused naming the phase."""
    trainer0, _, engine = case_result(published, "transfer")
    assert engine["finished"] == [1, 2, 3]
    for v in range(3):
        ref = trainer0["versions"][v]
        for key, tensor in ref.items():
            assert torch.equal(engine["versions"][v][key], tensor.float()), (v, key)
    assert "update_weights() called between updates" in engine["refused"]


@pytest.mark.parametrize("name", list(ASYNC))
def test_asynchronous_publish_sends_the_version_not_the_next_step(
    published: Any, name: str
) -> None:
    """[Note: asynchronous publish]: the trainers ran the next step while a slowed consumer had
    not received yet; it still gets each version bitwise (whole, then a delta), never the
    next step's values; the snapshot is in the ledger until wait()."""
    trainer0, trainer1, consumer = case_result(published, name)
    for v in range(2):
        ref = trainer0["versions"][v]
        assert all(torch.equal(ref[k], trainer1["versions"][v][k]) for k in ref)
        for key, tensor in ref.items():
            assert torch.equal(consumer["versions"][v][key], tensor), (v, key)
        after = trainer0["after"][v]
        assert any(not torch.equal(after[k], ref[k]) for k in ref)  # the step moved them
    for trainer in (trainer0, trainer1):
        assert trainer["held"][0] > 0 and trainer["held_after"] == [0, 0]


def test_version_mismatch_raises_on_every_rank(published: Any) -> None:
    for out in case_result(published, "version"):
        assert "consumer rank 2 expects version 99" in out["raised"]


def test_trainer_death_mid_publish_raises_within_the_timeout(published: Any) -> None:
    trainer0, trainer1, consumer = case_result(published, "death")
    assert "trainer 1 died" in trainer1["raised"]
    assert "did not finish within 3s" in consumer["raised"]
    assert trainer0["raised"] is None or "did not finish within 3s" in trainer0["raised"]


def _manifest(n: int) -> tuple[BucketEntry, ...]:
    return tuple(BucketEntry(8, "torch.float32", (ParamEntry(f"p{i}", (8,), 0),)) for i in range(n))


def _trainer(dp: int, version: int = 2, previous: int | None = 1, **kw: Any) -> TrainerHeader:
    fields: dict[str, Any] = {"changed": (True, False, False), "changed_only": True}
    fields |= kw
    manifest = _manifest(3) if dp == 0 else None
    return TrainerHeader(dp, version, previous, fields["changed"], manifest, "torch.float32",
                         fields["changed_only"], fields.get("counts", ()),
                         fields.get("anchor_due", False))  # fmt: skip


def test_decide_sends_the_union_of_changed_slices_to_up_to_date_consumers() -> None:
    t0, t1 = _trainer(0), _trainer(1, changed=(False, False, True))
    fp32 = holding(_manifest(3), "torch.float32")
    assert decide([t0, t1, ConsumerHeader(2, 1, None, fp32)]).send == (0, 2)
    assert decide([t1, ConsumerHeader(2, None, None), t0]).send == (0, 1, 2)  # a new consumer
    assert decide([t0, t1, ConsumerHeader(2, 0, None, fp32)]).send == (0, 1, 2)  # a lagging one
    plain = [_trainer(0, changed_only=False), _trainer(1, changed_only=False)]
    assert decide([*plain, ConsumerHeader(2, 1, None, fp32)]).send == (0, 1, 2)


def test_decide_skips_only_for_consumers_holding_this_layout() -> None:
    """[Note: what a consumer holds]: a consumer at the previous version whose copy is in
    another wire dtype (a dtype switch) or another manifest (a re-plan) gets every bucket; one
    holding this publish's layout gets the changed ones. "" (each bucket's own dtype) and the
    same dtype named are one layout."""
    t0, t1 = _trainer(0), _trainer(1, changed=(False, False, True))
    fp32 = holding(_manifest(3), "torch.float32")
    assert fp32 == holding(_manifest(3), "")
    assert decide([t0, t1, ConsumerHeader(2, 1, None, fp32)]).send == (0, 2)
    bf16 = holding(_manifest(3), "torch.bfloat16")
    assert decide([t0, t1, ConsumerHeader(2, 1, None, bf16)]).send == (0, 1, 2)
    other = holding(_manifest(2), "torch.float32")
    assert decide([t0, t1, ConsumerHeader(2, 1, None, other)]).send == (0, 1, 2)
    both = [ConsumerHeader(2, 1, None, fp32), ConsumerHeader(3, 1, None, bf16)]
    assert decide([t0, t1, *both]).send == (0, 1, 2)


def test_decide_sends_deltas_only_to_current_consumers_between_anchors() -> None:
    """[Note: element deltas]: per trainer and bucket a count (k changed elements) or WHOLE;
    a delta only when it is fewer bytes (8-element fp32 slices of 4 elements: k * 8 < 16), never
    for a consumer that does not hold the previous version in this layout, nor at an anchor.
    Buckets nobody changed are not sent."""
    fp32 = holding(_manifest(3), "torch.float32")
    t0 = _trainer(0, counts=(1, 0, -1), changed_only=False)
    t1 = _trainer(1, counts=(2, 0, 0), changed_only=False)
    got = decide([t0, t1, ConsumerHeader(2, 1, None, fp32)])
    assert got.deltas == ((1, -1), (0, 0), (-1, 0)) and got.send == (0, 2)
    assert decide([t0, t1, ConsumerHeader(2, None, None)]).deltas == ()  # a new consumer
    assert decide([t0, t1, ConsumerHeader(2, 1, None, "other")]).deltas == ()  # other layout
    due = [_trainer(r, counts=(1, 0, 0), anchor_due=True, changed_only=False) for r in (0, 1)]
    assert decide([*due, ConsumerHeader(2, 1, None, fp32)]).deltas == ()
    with pytest.raises(ValueError, match="disagree on changed_only, delta"):
        decide([t0, _trainer(1, counts=(1, 0, 0), anchor_due=True, changed_only=False)])


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([_trainer(0), _trainer(1, version=3)], "disagree on the version"),
        ([_trainer(0, version=1), _trainer(1, version=1)], "versions must increase"),
        ([_trainer(0), _trainer(1, changed_only=False)], "disagree on changed_only"),
        ([_trainer(0), _trainer(1), ConsumerHeader(2, 1, 5)], "consumer rank 2 expects version 5"),
        ([_trainer(1)], "trainer dp ranks 0..n-1"),
    ],
)
def test_decide_refuses_by_name(headers: list[Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decide(headers)


def test_send_ranges_tile_the_bucket_and_match_shards() -> None:
    for numel in (1, 7, 64):
        for size in (1, 2, 3):
            ranges = [send_range(numel, r, size) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == numel
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert send_range(64, 1, 2) == (32, 64)  # a padded bucket: the dp shard


def test_publisher_refuses_replicas_past_the_first_by_name() -> None:
    """Issue 26 x 27 ([Note: publishing from replicas]): under a replicate x shard split only
    replicate rank 0's shard group publishes (the replicas hold the same shards); a Publisher
    on another replica, or with trainers that are not that shard group, is refused by name."""
    from types import SimpleNamespace

    from megabuf.weights import Publisher

    def topo(replica: int, shard: int) -> SimpleNamespace:
        return SimpleNamespace(
            pp_size=1, ep_size=1, dp_size=4, dp_rank=2 * replica + shard, rank=2 * replica + shard,
            dp_replicate_size=2, dp_replicate_rank=replica, dp_shard_size=2, dp_shard_rank=shard,
        )  # fmt: skip

    def model(t: SimpleNamespace) -> Any:
        return SimpleNamespace(engine=SimpleNamespace(process_groups=SimpleNamespace(topology=t)))

    with pytest.raises(ValueError, match=r"hybrid-sharded \(2 replicas x 2\) and this rank is"):
        Publisher(model(topo(1, 0)), SimpleNamespace(trainers=(0, 1)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be replicate rank 0's shard group, 2 ranks"):
        Publisher(model(topo(0, 1)), SimpleNamespace(trainers=(0, 1, 2, 3)))  # type: ignore[arg-type]


def test_use_group_refuses_other_trainers_and_a_publish_in_flight() -> None:
    """A consumer joins through a new group with the same trainers (`Publisher.use_group`);
    other trainers, or a switch while a start_publish() is in flight, are refused by name."""
    from types import SimpleNamespace

    from megabuf.weights import Publisher

    publisher = object.__new__(Publisher)  # the refusals read only these fields
    topology = SimpleNamespace(rank=0)
    publisher.model = SimpleNamespace(  # type: ignore[assignment]
        engine=SimpleNamespace(process_groups=SimpleNamespace(topology=topology))
    )
    publisher.group = SimpleNamespace(trainers=(0, 1))  # type: ignore[assignment]
    publisher._in_flight = SimpleNamespace(finished=False)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"trainers \[0, 2\] must be this publisher's \[0, 1\]"):
        publisher.use_group(SimpleNamespace(trainers=(0, 2)))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="use_group on rank 0 while the previous start_publish"):
        publisher.use_group(SimpleNamespace(trainers=(0, 1)))  # type: ignore[arg-type]
