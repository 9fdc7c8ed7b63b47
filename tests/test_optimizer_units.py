"""Pure tests (no process group): optimizer config, grad scalers, clipping arithmetic, builder
choices of torch optimizer class and arguments, the implementation choice and the state layout
that checkpoints check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import megabuf
from megabuf.optimizer import ConstantGradScaler, DynamicGradScaler
from megabuf.optimizer.builder import make_grad_scaler, optimizer_class_and_kwargs
from megabuf.optimizer.clip import clip_grads_
from megabuf.optimizer.implementation import TORCH_KWARGS, choose_implementation
from megabuf.optimizer.state_layout import (
    SCALAR,
    conform_scalars,
    describe_layout_problems,
    entry_kind,
    expected_layout,
    group_problems,
    layout_of,
    layout_problems,
    probe_state,
    restorable,
)

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
    assert cls is torch.optim.SGD
    assert kwargs == {"lr": 0.5, "weight_decay": 0.1, "momentum": 0.8, "foreach": True}
    cls, kwargs = optimizer_class_and_kwargs(cfg.replace(optimizer=torch.optim.Adagrad), CPU)
    assert cls is torch.optim.Adagrad and kwargs == {"lr": 0.5, "weight_decay": 0.1}


NONE: frozenset[str] = frozenset()
BOTH = frozenset({"apex", "transformer_engine"})
FUSED, FOREACH, FOR_LOOP = {"fused": True}, {"foreach": True}, {"foreach": False, "fused": False}
TE = "transformer_engine.pytorch.optimizers"


@pytest.mark.parametrize(
    ("implementation", "optimizer", "device", "importable", "class_path", "kwargs"),
    [
        ("auto", "adam", "cuda", NONE, "torch.optim.Adam", FUSED),
        ("auto", "adamw", "cuda", BOTH, "torch.optim.AdamW", FUSED),  # never apex/TE unasked
        ("auto", "sgd", "cuda", NONE, "torch.optim.SGD", FUSED),
        ("auto", "adam", "cpu", NONE, "torch.optim.Adam", FOREACH),
        ("auto", None, "cuda", NONE, None, {}),  # a user's class keeps its own default
        ("fused", "adamw", "cpu", NONE, "torch.optim.AdamW", FUSED),  # torch has CPU fused
        ("fused", None, "cpu", NONE, None, FUSED),
        ("foreach", "sgd", "cuda", NONE, "torch.optim.SGD", FOREACH),
        ("for_loop", "adam", "cuda", NONE, "torch.optim.Adam", FOR_LOOP),
        ("apex", "adamw", "cuda", BOTH, "apex.optimizers.FusedAdam", {"adam_w_mode": True}),
        ("apex", "adam", "cuda", BOTH, "apex.optimizers.FusedAdam", {"adam_w_mode": False}),
        ("apex", "sgd", "cuda", BOTH, "apex.optimizers.FusedSGD", {}),
        ("transformer_engine", "adam", "cuda", BOTH, f"{TE}.FusedAdam", {"adam_w_mode": False}),
        ("transformer_engine", "sgd", "cuda", BOTH, f"{TE}.FusedSGD", {}),
    ],
)
def test_implementation_choice_is_explicit(
    implementation: str, optimizer: str | None, device: str, importable: frozenset[str],
    class_path: str | None, kwargs: dict[str, bool],
) -> None:  # fmt: skip
    choice = choose_implementation(implementation, optimizer, device, importable)
    assert choice.class_path == class_path and dict(choice.kwargs) == kwargs


@pytest.mark.parametrize(
    ("implementation", "package"),
    [("apex", "NVIDIA apex"), ("transformer_engine", "pip install transformer_engine")],
)
def test_absent_nvidia_package_raises_naming_field_and_package(
    implementation: str, package: str
) -> None:
    others = BOTH - {implementation}
    with pytest.raises(ImportError, match=f"implementation='{implementation}'") as info:
        choose_implementation(implementation, "adam", "cuda", others)
    assert package in str(info.value)


def test_nvidia_implementations_refuse_cpu_params_and_user_classes() -> None:
    with pytest.raises(ValueError, match="runs on CUDA params only, and the params are on cpu"):
        choose_implementation("apex", "adam", "cpu", BOTH)
    with pytest.raises(ValueError, match="needs optimizer='adam', 'adamw' or 'sgd', not a class"):
        choose_implementation("transformer_engine", None, "cuda", BOTH)


def test_config_rejects_unknown_implementation() -> None:
    with pytest.raises(ValueError, match=r"OptimizerConfig.implementation='cuda' is not one of"):
        megabuf.OptimizerConfig(implementation="cuda")
    assert megabuf.OptimizerConfig().implementation == "auto"
    assert "implementation = 'auto'" in (megabuf.OptimizerConfig.__doc__ or "")


@pytest.mark.parametrize("implementation", ["auto", "fused", "foreach", "for_loop"])
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd"])
def test_builder_torch_kernels_run_on_cpu_with_one_state_layout(
    implementation: str, name: str
) -> None:
    """Every torch kernel builds and steps on CPU (fused included: torch 2.13 has it), with the
    flags asked for, and keeps the same per-param state layout."""
    cfg = megabuf.OptimizerConfig(optimizer=name, implementation=implementation)
    cls, kwargs = optimizer_class_and_kwargs(cfg, CPU)
    param = torch.nn.Parameter(torch.ones(3))
    opt = cls([param], **kwargs)
    param.grad = torch.full((3,), 0.5)
    opt.step()
    flags = {k: opt.param_groups[0][k] for k in ("fused", "foreach")}
    assert flags == {**{"fused": None, "foreach": None}, **dict(TORCH_KWARGS.get(
        "foreach" if implementation == "auto" else implementation, {}))}  # fmt: skip
    want = {"sgd": {"momentum_buffer": "elementwise torch.float32"}}.get(
        name, {"step": SCALAR, "exp_avg": "elementwise torch.float32",
               "exp_avg_sq": "elementwise torch.float32"},
    )  # fmt: skip
    assert layout_of(opt.state[param], 3) == want
    assert expected_layout(probe_state(opt, opt.param_groups[0]), 3) == want


def test_state_layout_kinds_and_problems() -> None:
    assert entry_kind([4, 3], torch.float32, 12) == "elementwise torch.float32"
    assert entry_kind([12], torch.bfloat16, 12) == "elementwise torch.bfloat16"  # flat
    assert entry_kind([], torch.float32, 12) == SCALAR  # a 0-d step tensor
    assert entry_kind(None, None, 12) == SCALAR  # a pickled Python number
    assert entry_kind([1], torch.float32, 1) == SCALAR  # 1-element params: kinds collapse
    adam = {"step": SCALAR, "exp_avg": "elementwise torch.float32"}
    assert layout_problems({}, adam) == []  # saved before any step
    assert layout_problems(adam, adam) == []
    assert layout_problems({"momentum_buffer": "elementwise torch.float32"}, adam) == [
        "state 'exp_avg' not saved", "state 'momentum_buffer' saved, this optimizer keeps none",
        "state 'step' not saved",
    ]  # fmt: skip
    bf16 = {**adam, "exp_avg": "elementwise torch.bfloat16"}
    assert layout_problems(bf16, adam) == [
        "state 'exp_avg' saved elementwise torch.bfloat16, this optimizer keeps elementwise "
        "torch.float32"
    ]
    text = describe_layout_problems({"a": ["x"], "b": ["x"], "c": ["x"], "d": ["y"]})
    assert text == "x (params a, b, +1 more); y (params d)"


def test_group_check_ignores_kernel_flags_and_names_algorithm_changes() -> None:
    p = [torch.nn.Parameter(torch.ones(2))]
    fused = torch.optim.Adam(p, fused=True).param_groups[0]
    for_loop = torch.optim.Adam(p, foreach=False).param_groups[0]
    adamw = torch.optim.AdamW(p).param_groups[0]
    sgd = torch.optim.SGD(p).param_groups[0]
    assert group_problems([fused], [for_loop]) == []
    assert group_problems([fused], [adamw]) == [
        "param group 0: decoupled_weight_decay=False saved, this optimizer has "
        "decoupled_weight_decay=True"
    ]
    (problem,) = group_problems([fused], [sgd])
    assert "['amsgrad', 'betas'" in problem and "['dampening', 'momentum'" in problem
    assert restorable({**fused, "lr": 0.5}) == {
        k: v for k, v in {**fused, "lr": 0.5}.items()
        if k not in {"params", "fused", "foreach", "capturable", "differentiable"}
    }  # fmt: skip


def test_scalars_take_the_form_the_loading_optimizer_keeps() -> None:
    tensor_step = {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}
    got = conform_scalars({"step": 3, "exp_avg": torch.ones(2)}, tensor_step)
    assert isinstance(got["step"], torch.Tensor) and got["step"].dtype == torch.float32
    assert got["step"].item() == 3.0 and got["step"].dim() == 0
    got = conform_scalars({"step": torch.tensor(5.0)}, {"step": 1})
    assert got["step"] == 5.0 and not isinstance(got["step"], torch.Tensor)


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


class _Broadcasts:
    """A fake collectives layer for `exchanged_state`: group rank `rank` of `len(pieces)`;
    broadcasting from `src` hands out that rank's pieces."""

    def __init__(self, pieces: list[list[dict[str, Any]]], rank: int) -> None:
        self.pieces, self._rank = pieces, rank

    def size(self, group: Any = None) -> int:
        return len(self.pieces)

    def rank(self, group: Any = None) -> int:
        return self._rank

    def broadcast_object(self, obj: Any, src: int, group: Any) -> Any:
        assert (obj is None) == (src != self._rank)  # only the source hands its pieces over
        return self.pieces[src]


def _piece(key: str, start: int, end: int) -> dict[str, Any]:
    values = torch.arange(start, end, dtype=torch.float32)
    return {
        "key": key, "start": start, "end": end, "numel": 10, "shape": [10],
        "state": {"main": values, "exp_avg": -values, "step": torch.tensor(3.0)},
    }  # fmt: skip


def test_exchanged_state_keeps_only_the_overlap_with_the_ranges_stepped_now() -> None:
    """[Note: sharded auto bucket re-plan] step 3: old pieces of three ranks (a replica's copy
    among them), new ranges that cut across them: each rank keeps exactly its new ranges'
    elements, once, with values from the right offsets; scalars are kept whole."""
    from types import SimpleNamespace

    from megabuf.optimizer.model_space import assemble_range, exchanged_state

    old = [
        [_piece("a", 0, 6), _piece("b", 0, 2)],
        [_piece("a", 6, 10), _piece("b", 2, 10)],
        [_piece("a", 6, 10)],  # a replica of rank 1's piece of "a"
    ]
    new = [SimpleNamespace(key="a", param_start=4, param_end=8),
           SimpleNamespace(key="b", param_start=0, param_end=3)]  # fmt: skip
    parts = SimpleNamespace(main_params=new)
    fake = _Broadcasts(old, rank=1)
    state = exchanged_state(parts, old[1], {"format": "x"}, fake, None)  # type: ignore[arg-type]
    assert state["common"] == {"format": "x"}
    spans = sorted((p["key"], p["start"], p["end"]) for p in state["pieces"])
    assert spans == [("a", 4, 6), ("a", 6, 8), ("b", 0, 2), ("b", 2, 3)]
    kept = sum(p["state"]["main"].numel() for p in state["pieces"])
    assert kept == 4 + 3  # the new ranges' elements: nothing else of the old state is held
    for mp in new:
        got = assemble_range(mp.key, mp.param_start, mp.param_end, state["pieces"])
        want = torch.arange(mp.param_start, mp.param_end, dtype=torch.float32)
        assert torch.equal(got["main"], want) and torch.equal(got["exp_avg"], -want)
        assert float(got["step"]) == 3.0
