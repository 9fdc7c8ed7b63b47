"""Tests for megabuf.testing: model factories, batches, the corpus and the spawn launcher.

Pure (no process group in this process); the spawn tests start 2 short-lived CPU processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megabuf.testing import (
    GPT,
    PRESETS,
    GPTConfig,
    ManySmallParams,
    build_model,
    corpus_tokens,
    gpt_loss,
    gpt_medium,
    gpt_small,
    gpt_tiny,
    lm_batches,
    loss_fn,
    make_batch,
    many_small,
    mlp_34m,
    mlp_tiny,
    model_from_config,
    spawn,
)
from megabuf.testing.corpus import VOCAB, corpus_text
from megabuf.testing.launch import SpawnError


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_build_is_deterministic_and_ignores_global_seed(name: str) -> None:
    torch.manual_seed(123)
    a = build_model(name, seed=5)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    b = build_model(name, seed=5)
    assert torch.equal(torch.get_rng_state(), state), "building must not consume the global RNG"
    _assert_same_params(a, b)
    c = build_model(name, seed=6)
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters(), strict=True))


@pytest.mark.parametrize(
    ("factory", "low", "high"),
    [
        (gpt_tiny, 50_000, 200_000),
        (gpt_small, 15_000_000, 20_000_000),
        (gpt_medium, 35_000_000, 50_000_000),
        (mlp_tiny, 1_000, 10_000),
        (mlp_34m, 32_000_000, 36_000_000),
        (many_small, 100_000, 1_000_000),
    ],
)
def test_preset_param_counts(factory: Callable[[], nn.Module], low: int, high: int) -> None:
    model = factory()
    assert low <= _numel(model) <= high


def test_presets_match_build_model() -> None:
    _assert_same_params(gpt_tiny(seed=3), build_model("gpt_tiny", seed=3))
    _assert_same_params(mlp_tiny(seed=3), build_model("mlp_tiny", seed=3))
    _assert_same_params(many_small(seed=2), model_from_config(PRESETS["many_small"], seed=2))


def test_many_small_every_param_gets_a_gradient() -> None:
    model = build_model("many_small", seed=0)
    params = list(model.parameters())
    assert len(params) >= 2000
    x, y = make_batch("many_small", batch_size=4, seed=0)
    loss_fn("many_small")(model(x), y).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) > 0, name


def test_many_small_odd_count_and_bad_args() -> None:
    assert len(list(ManySmallParams(7, width=4).parameters())) == 7
    with pytest.raises(ValueError, match="n_tensors"):
        ManySmallParams(0)


def test_tied_embeddings_share_storage() -> None:
    model = gpt_tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    x, y = make_batch(model, 2, seed=0)
    gpt_loss(model(x), y).backward()
    assert model.tok_emb.weight.grad is not None

    untied_cfg = GPTConfig(**{**PRESETS["gpt_tiny"].__dict__, "tie_embeddings": False})
    untied = GPT(untied_cfg)
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    assert _numel(untied) == _numel(model) + untied.lm_head.weight.numel()


def test_gpt_is_causal_and_shapes() -> None:
    model = gpt_tiny()
    cfg = model.config
    x, y = make_batch("gpt_tiny", batch_size=3, seed=1)
    assert x.shape == y.shape == (3, cfg.seq_len) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    logits = model(x)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % cfg.vocab_size
    logits2 = model(x2)
    assert torch.equal(logits[:, :10], logits2[:, :10])
    assert not torch.equal(logits[:, 10:], logits2[:, 10:])
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_dtype_and_batches() -> None:
    model = gpt_tiny(torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    x, y = make_batch(model, 2, seed=0)
    assert torch.isfinite(gpt_loss(model(x), y))
    mlp = mlp_tiny(torch.bfloat16)
    xm, ym = make_batch(mlp, 4, seed=0)
    assert xm.dtype == ym.dtype == torch.bfloat16 and xm.shape == (4, 32)
    a, b = make_batch("mlp_34m", 2, seed=9), make_batch("mlp_34m", 2, seed=9)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], make_batch("mlp_34m", 2, seed=10)[0])
    with pytest.raises(ValueError, match="unknown model"):
        build_model("gpt_huge", seed=0)


def test_corpus_is_deterministic_and_in_vocab() -> None:
    a = corpus_tokens(5000, vocab_size=128, seed=0)
    assert a.dtype == torch.long and a.shape == (5000,)
    assert torch.equal(a, corpus_tokens(5000, vocab_size=128, seed=0))
    assert not torch.equal(a, corpus_tokens(5000, vocab_size=128, seed=1))
    assert torch.equal(a[:100], corpus_tokens(100, vocab_size=128, seed=0))
    assert int(a.max()) < len(VOCAB) and int(a.min()) >= 0
    assert corpus_text(12, seed=0).startswith(corpus_text(6, seed=0))
    with pytest.raises(ValueError, match="vocab_size"):
        corpus_tokens(10, vocab_size=len(VOCAB) - 1, seed=0)


def test_lm_batches_shift_and_slice() -> None:
    tokens = corpus_tokens(2000, vocab_size=128, seed=0)
    x, y = lm_batches(tokens, batch_size=8, seq_len=16, step=3)
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    # A rank's slice of the global batch is independent of how the batch is split.
    x2, _ = lm_batches(tokens, batch_size=8, seq_len=16, step=3)
    assert torch.equal(x, x2)
    first = lm_batches(tokens, batch_size=4, seq_len=16, step=6)[0]
    assert torch.equal(first, x[:4])
    wrapped = lm_batches(tokens, batch_size=4, seq_len=16, step=10_000)[0]
    assert wrapped.shape == (4, 16)


def test_gpt_tiny_learns_the_corpus() -> None:
    model = gpt_tiny(seed=0)
    cfg = model.config
    tokens = corpus_tokens(20_000, cfg.vocab_size, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        x, y = lm_batches(tokens, batch_size=16, seq_len=cfg.seq_len, step=step)
        loss = gpt_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0 and sum(losses[-5:]) / 5 < 3.0, losses


# -- launcher -------------------------------------------------------------------------------------


def _rank_worker(out_dir: str) -> int:
    """Runs in a spawned child: write env, a model snapshot and an all-reduce result to files."""
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    lines = [f"{k}={os.environ[k]}" for k in keys]
    lines += [f"threads={torch.get_num_threads()}", f"sum={total.item()}"]
    lines += [f"malloc={os.environ.get('MALLOC_MMAP_THRESHOLD_')}"]
    Path(out_dir, f"rank{rank}.txt").write_text("\n".join(lines))
    torch.save(build_model("gpt_tiny", seed=11).state_dict(), Path(out_dir, f"rank{rank}.pt"))
    return rank * 10


def _failing_worker() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("boom from rank 1")


def test_spawn_two_ranks(tmp_path: Path) -> None:
    parent_env = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    assert spawn(_rank_worker, 2, str(tmp_path), timeout_s=120) == [0, 10]
    assert os.environ.get("MALLOC_MMAP_THRESHOLD_") == parent_env  # parent env restored
    info = [
        dict(line.split("=", 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines())
        for r in range(2)
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for rank, d in enumerate(info):
        assert (d["RANK"], d["LOCAL_RANK"], d["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert d["sum"] == "3.0" and d["threads"] == str(max(1, (cores or 1) // 2))
        assert d["malloc"] is not None and int(d["malloc"]) >= 1 << 30
    assert info[0]["MASTER_PORT"] == info[1]["MASTER_PORT"]
    # Two processes building the same name + seed get bitwise identical params.
    here = build_model("gpt_tiny", seed=11).state_dict()
    for r in range(2):
        theirs = torch.load(tmp_path / f"rank{r}.pt")
        assert all(torch.equal(here[k], theirs[k]) for k in here)


def test_spawn_propagates_child_failure() -> None:
    with pytest.raises(SpawnError, match="boom from rank 1") as info:
        spawn(_failing_worker, 2, timeout_s=120)
    assert info.value.rank == 1
    assert "Traceback" in info.value.detail


def test_spawn_under_torchrun_calls_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert spawn(max, 4, 3, 9) == [9]
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="world_size"):
        spawn(max, 0)
