"""Pure tests (no process group): optimizer config, grad scalers, clipping arithmetic, builder
choices of torch optimizer class and arguments."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megabuf
from megabuf.optimizer import ConstantGradScaler, DynamicGradScaler
from megabuf.optimizer.builder import make_grad_scaler, optimizer_class_and_kwargs
from megabuf.optimizer.clip import clip_grads_

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_config_rejects_contradictions_and_unknown_fields() -> None:
    with pytest.raises(ValueError, match="fp16 and bf16"):
        megabuf.OptimizerConfig(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="'lamb' is not one of"):
        megabuf.OptimizerConfig(optimizer="lamb")
    with pytest.raises(ValueError, match=r"unknown OptimizerConfig field\(s\) \['betas'\]"):
        megabuf.OptimizerConfig.from_dict({"betas": (0.9, 0.95)})
    with pytest.raises(ValueError, match="clip_grad=-1"):
        megabuf.OptimizerConfig(clip_grad=-1.0)


def test_config_from_toml_reads_the_optimizer_table() -> None:
    cfg = megabuf.OptimizerConfig.from_toml(REPO / "configs" / "distopt_overlap.toml")
    assert cfg.optimizer == "adamw" and cfg.weight_decay == 0.01
    ddp = megabuf.DistributedDataParallelConfig.from_toml(REPO / "configs" / "distopt_overlap.toml")
    assert ddp.use_distributed_optimizer and ddp.overlap_param_gather


def test_builder_maps_names_to_torch_semantics() -> None:
    cfg = megabuf.OptimizerConfig(lr=0.5, weight_decay=0.1, adam_beta2=0.95, sgd_momentum=0.8)
    cls, kwargs = optimizer_class_and_kwargs(cfg, CPU)
    assert cls is torch.optim.Adam and kwargs["betas"] == (0.9, 0.95)
    cls, _ = optimizer_class_and_kwargs(cfg.replace(optimizer="adamw"), CPU)
    assert cls is torch.optim.AdamW
    cls, kwargs = optimizer_class_and_kwargs(cfg.replace(optimizer="sgd"), CPU)
    assert cls is torch.optim.SGD and kwargs == {"lr": 0.5, "weight_decay": 0.1, "momentum": 0.8}
    cls, kwargs = optimizer_class_and_kwargs(cfg.replace(optimizer=torch.optim.Adagrad), CPU)
    assert cls is torch.optim.Adagrad and kwargs == {"lr": 0.5, "weight_decay": 0.1}


def test_builder_grad_scaler_choice() -> None:
    assert make_grad_scaler(megabuf.OptimizerConfig(bf16=True), CPU) is None
    dynamic = make_grad_scaler(megabuf.OptimizerConfig(fp16=True, initial_loss_scale=8.0), CPU)
    assert isinstance(dynamic, DynamicGradScaler) and dynamic.scale.item() == 8.0
    constant = make_grad_scaler(megabuf.OptimizerConfig(fp16=True, loss_scale=128.0), CPU)
    assert isinstance(constant, ConstantGradScaler) and constant.scale.item() == 128.0


def test_dynamic_scaler_hysteresis_backoff_growth_and_floor() -> None:
    s = DynamicGradScaler(16.0, min_scale=4.0, growth_interval=3, hysteresis=2, backoff_factor=0.5)
    seen = []
    for found_inf in [True, True, True, True, False, False, False, True]:
        s.update(found_inf)
        seen.append(s.scale.item())
    # 1st inf spends hysteresis, 2nd backs off, 3rd/4th hit the floor 4, three good steps grow
    # (and refill hysteresis), so the next inf only spends hysteresis again.
    assert seen == [16.0, 8.0, 4.0, 4.0, 4.0, 4.0, 8.0, 8.0]
    assert s.inv_scale.item() == 1 / 8.0


def test_dynamic_scaler_state_dict_round_trip() -> None:
    a = DynamicGradScaler(64.0, growth_interval=5, hysteresis=3)
    for found_inf in [False, False, True]:
        a.update(found_inf)
    b = DynamicGradScaler(1.0, growth_interval=5, hysteresis=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict() == {
        "scale": 64.0, "growth_tracker": 0, "hysteresis_tracker": 2,
    }  # fmt: skip


def test_clip_matches_torch_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g)]
    params = [torch.zeros_like(t, requires_grad=True) for t in grads]
    for p, t in zip(params, grads, strict=True):
        p.grad = t.clone()
    norm = float(torch.linalg.vector_norm(torch.cat([t.flatten() for t in grads])))
    torch.nn.utils.clip_grad_norm_(params, 0.5)
    factor = clip_grads_(grads, 0.5, norm)
    assert factor < 1.0
    for p, t in zip(params, grads, strict=True):
        torch.testing.assert_close(t, p.grad, rtol=1e-6, atol=0)
    assert clip_grads_(grads, 100.0, norm) == 1.0  # no clipping below the threshold
