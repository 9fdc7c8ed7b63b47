"""Issue 42's peers: FSDP2 + torchao float8 all-gather on CPU gloo against single-process float8
models, param all-gather bytes of megabuf and FSDP2 (bf16 and float8), and the FP8 loss band
through megabuf under every sharding strategy ([Note: float8 peers], [Note: FP8 loss band]).
Rank-side code: fp8_peer_cases.py. Every test but the import one skips without torchao."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from megabuf.bench.fp8_curves import BAND_STEPS, LOSS_BAND, gaps
from megabuf.bench.fp8_systems import torchao_unavailable_reason

NO_TORCHAO = torchao_unavailable_reason()
needs_torchao = pytest.mark.skipif(NO_TORCHAO is not None, reason=str(NO_TORCHAO))
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


_RUNS: dict[str, list[dict[str, Any]]] = {}


def _case(pools: Any, name: str, *args: Any) -> list[Any]:
    """Case `name` of fp8_peer_cases.py (its function `{name}_case`) on 2 gloo ranks, run once
    per session; one pool run per case, so each has the pool's whole timeout."""
    import fp8_peer_cases
    from dist_pool import case_result, run_each

    key = "_".join([name, *map(str, args)])
    if key not in _RUNS:
        fn = getattr(fp8_peer_cases, f"{name}_case")
        _RUNS[key] = pools(2).run(run_each, {key: (fn, *args)})
    return case_result(_RUNS[key], key)


def test_bench_modules_import_and_skip_float8_rows_without_torchao(monkeypatch: Any) -> None:
    """Without torchao the bench still imports, names the reason and plans only bf16 rows."""
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)
    from megabuf.bench.fp8_peers import plan_rows
    from megabuf.bench.fp8_systems import torchao_unavailable_reason as reason

    assert "torchao" in (reason() or "")
    rows = plan_rows(["optim"], reason() is None)
    assert rows == (("megabuf_bf16", "optim"), ("fsdp2_bf16", "-"))


@needs_torchao
def test_fsdp2_float8_all_gather_is_bitwise_a_micro_batched_single_process_model(
    pools: Any,
) -> None:
    """FSDP2 (dp 2, float8 all-gather, scales precomputed after each step) after 4 AdamW steps
    equals, bit for bit, one process running each global batch as 2 micro-batches (rank r's half
    as micro-batch r): the weight scale is agreed (amax all-reduced: the max is exact), each
    rank's input and grad-output scales are those of its own half, the same micro-batch's, and at
    dp 2 the reduce-scatter's sum of two halves is the micro-batches' sum (divided by 2: exact).
    Against one batch of 8 the activation and grad scales differ (tensorwise over 8 samples, not
    4), so the fp8 casts round differently: bounded by 2 lr per step (AdamW moves an element by
    about lr per step)."""
    for rank, res in enumerate(_case(pools, "fsdp2")):
        assert res["float8_weights"] == 8, rank  # 2 blocks x (qkv, proj, fc, fc_out)
        assert res["micro"]["unequal"] == [], (rank, res["micro"])
        assert res["global"]["max_abs"] > 0.0, rank  # the casts of one batch of 8 differ
        assert res["global"]["max_abs"] <= 2 * res["lr"] * 4, (rank, res["global"])


@needs_torchao
def test_param_gather_bytes_counted_per_system(pools: Any) -> None:
    """FSDP2's counted all-gather bytes equal its formula (float8 weights at 1 byte, the rest
    at fp32; bf16: 2 bytes), float8 gathers fewer bytes than bf16; megabuf's bf16 rows gather
    bytes, and its FP8 rows fewer than those (the FP8 param kind gathers 1 byte per float8
    weight element; before it landed they were twice bf16's, full width)."""
    for rank, rows in enumerate(_case(pools, "wire")):
        by = {r["label"]: r for r in rows}
        for name in ("fsdp2_bf16", "fsdp2_fp8"):
            row = by[name]
            assert row["ring_nbytes"] == row["formula_nbytes"] * row["rounds"], (rank, row)
        assert by["fsdp2_fp8"]["ring_nbytes"] < by["fsdp2_bf16"]["ring_nbytes"], rank
        for strategy in ("optim", "optim_grads_params"):
            bf16 = by[f"megabuf_bf16[{strategy}]"]["ring_nbytes"]
            fp8 = by[f"megabuf_fp8[{strategy}]"]["ring_nbytes"]
            assert bf16 > 0, (rank, strategy)
            assert fp8 < bf16, (rank, strategy, fp8, bf16)  # the FP8 kind: 1 byte per element


@needs_torchao
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp8_loss_stays_within_the_band_of_bf16_through_megabuf(pools: Any, strategy: str) -> None:
    """30 steps of the demo GPT at dp 2 through megabuf under `strategy`: the FP8 loss (torchao
    float8 model) stays within LOSS_BAND of the bf16 loss at every step, and both learn."""
    curves, wire = {}, {}
    for precision in ("fp8", "bf16"):  # one pool run each: each has the pool's whole timeout
        per_rank = _case(pools, "band", strategy, precision)
        assert per_rank[0]["losses"] == per_rank[1]["losses"]  # global-batch, all-reduced
        curves[precision] = per_rank[0]["losses"]
        wire[precision] = per_rank[0]["gather_nbytes"]
    assert len(curves["fp8"]) == BAND_STEPS
    gap = gaps(curves["fp8"], curves["bf16"])
    assert wire["fp8"] < wire["bf16"], wire  # gathered as FP8 bytes, not at full width
    assert gap["max_abs_gap"] <= LOSS_BAND, gap
    for precision, losses in curves.items():
        assert losses[-1] < losses[0] - 0.5, (precision, losses[0], losses[-1])
