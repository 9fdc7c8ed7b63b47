"""Rank-side code of test_fp8_peers.py (runs inside DistPool workers, 2 gloo ranks).

- `fsdp2_case`: FSDP2 + torchao float8 all-gather ([Note: float8 peers]) trains the demo GPT for
  `STEPS` AdamW steps, each rank on its half of every global batch, and compares the full params
  with two single-process float8 models on the same data: `micro` runs the global batch as dp
  micro-batches (rank r's half as micro-batch r, grads summed, then divided by dp), `global` runs
  it as one batch.
- `wire_case`: the bench's rows (fp8_peers.rank_rounds) on gpt_tiny: param all-gather bytes
  counted per step, with FSDP2's formula.
- `band_case`: megabuf_curve in one precision under one strategy ([Note: FP8 loss band]), with
  the param all-gather bytes per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import megabuf
from megabuf.bench.fp8_curves import BAND_STEPS, megabuf_curve
from megabuf.bench.fp8_peers import Fp8Run, plan_rows, rank_rounds, row_label
from megabuf.bench.fp8_systems import build_fsdp2, is_float8_weight, to_float8
from megabuf.bench.settings import OPTIMIZER_KWARGS
from megabuf.testing import PRESETS, build_model, corpus_tokens, gpt_loss, lm_batches

STEPS = 4
GLOBAL_BATCH = 8
SEQ_LEN = PRESETS["gpt_tiny"].seq_len  # type: ignore[union-attr]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = corpus_tokens(10_000, PRESETS["gpt_tiny"].vocab_size, seed=0)  # type: ignore[union-attr]
    return [lm_batches(tokens, GLOBAL_BATCH, SEQ_LEN, step) for step in range(STEPS)]


def _reference(micro: int) -> dict[str, torch.Tensor]:
    """Single-process float8 model after STEPS steps, each global batch in `micro` pieces."""
    model = to_float8(build_model("gpt_tiny", seed=0))
    opt = torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)  # type: ignore[arg-type]
    size = GLOBAL_BATCH // micro
    for x, y in _batches():
        for m in range(micro):
            gpt_loss(model(x[m * size : (m + 1) * size]), y[m * size : (m + 1) * size]).backward()
        for p in model.parameters():
            if p.grad is not None and micro > 1:
                p.grad.div_(micro)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> dict[str, Any]:
    unequal = [n for n in want if not torch.equal(got[n], want[n])]
    worst = max(float((got[n] - want[n]).abs().max()) for n in want)
    return {"unequal": unequal, "max_abs": worst}


def fsdp2_case() -> dict[str, Any]:
    pgs = megabuf.ProcessGroups.default_local()
    module = build_model("gpt_tiny", seed=0)
    fsdp2 = build_fsdp2(module, pgs, float8=True)
    local = GLOBAL_BATCH // pgs.dp_size
    lo, hi = pgs.dp_rank * local, (pgs.dp_rank + 1) * local
    for x, y in _batches():
        fsdp2.zero_grad()
        gpt_loss(fsdp2.model(x[lo:hi]), y[lo:hi]).backward()
        fsdp2.optimizer.step()
        fsdp2.after_step()
    float8 = sum(is_float8_weight(p) for p in module.parameters())
    got = {n: p.full_tensor().detach().clone() for n, p in module.named_parameters()}
    return {
        "float8_weights": float8,
        "micro": _diff(got, _reference(pgs.dp_size)),
        "global": _diff(got, _reference(1)),
        "lr": OPTIMIZER_KWARGS["lr"],
    }


def wire_case() -> list[dict[str, Any]]:
    pgs = megabuf.ProcessGroups.default_local()
    run = Fp8Run("gpt_tiny", 2, plan_rows(["optim", "optim_grads_params"], True), 1, 2)
    rows = rank_rounds(run, pgs)
    return [{**r, "label": row_label(*run.rows[i]), "rounds": run.rounds}
            for i, r in enumerate(rows)]  # fmt: skip


def band_case(strategy: str, precision: str) -> dict[str, Any]:
    pgs = megabuf.ProcessGroups.default_local()
    curve = megabuf_curve(precision, strategy, BAND_STEPS, pgs)
    dist.barrier()
    return {"losses": curve.losses, "gather_nbytes": curve.gather_ring_nbytes_per_step}
