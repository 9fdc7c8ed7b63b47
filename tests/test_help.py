"""`help()` tells the truth (pure: no process group): config fields documented, the wrapper's
constructor arguments documented, collective methods say so, malformed param groups named."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import megabuf
from megabuf.optimizer.param_groups import resolve_param_groups

CONFIGS = [megabuf.DistributedDataParallelConfig, megabuf.OptimizerConfig]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_help_of_a_config_documents_every_field(cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    lines = [line.removeprefix(" |  ") for line in text.splitlines()]
    for field in dataclasses.fields(cls):
        heads = [i for i, line in enumerate(lines) if line.startswith(f"{field.name} = ")]
        assert heads, f"{cls.__name__}.{field.name} is not in help()"
        explanation = lines[heads[0] + 1]
        assert explanation.startswith("    ") and len(explanation.strip()) > 10, field.name


def test_wrapper_docstring_documents_every_constructor_argument() -> None:
    doc = inspect.getdoc(megabuf.DistributedDataParallel) or ""
    args = [p for p in inspect.signature(megabuf.DistributedDataParallel).parameters]
    missing = [a for a in args if f"{a}:" not in doc]
    assert not missing, missing
    assert "nn.Module" not in doc.splitlines()[0]  # its own summary, not nn.Module's


@pytest.mark.parametrize(
    "method",
    ["start_grad_sync", "finish_grad_sync", "broadcast_params", "load_state_dict",
     "reset_iter_state"],
)  # fmt: skip
def test_methods_that_issue_collectives_say_every_rank_must_call_them(method: str) -> None:
    doc = (inspect.getdoc(getattr(megabuf.DistributedDataParallel, method)) or "").lower()
    assert "every dp rank" in doc or "every rank" in doc, (method, doc)


@pytest.mark.parametrize("method", ["publish_params", "state_dict"])
def test_rank_local_methods_say_one_rank_may_call_them(method: str) -> None:
    """They only wait for gathers every rank dispatched in step() (test_drop_in.py runs them on
    rank 0 alone)."""
    doc = (inspect.getdoc(getattr(megabuf.DistributedDataParallel, method)) or "").lower()
    assert "not collective" in doc and "rank 0" in doc, (method, doc)


def test_malformed_param_groups_name_the_group_and_the_format() -> None:
    weight = nn.Parameter(torch.zeros(2))
    chunk = SimpleNamespace(engine=SimpleNamespace(param_to_name={weight: "w"}))
    with pytest.raises(ValueError, match=r"param group 0 holds a list.*\{'params'"):
        resolve_param_groups([chunk], [[weight]])  # type: ignore[list-item]
    hparams, group_of = resolve_param_groups([chunk], [{"params": [weight], "lr": 0.5}])
    assert hparams == [{"lr": 0.5}] and group_of == {weight: 0}
