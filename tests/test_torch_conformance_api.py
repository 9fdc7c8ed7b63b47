"""torch DDP's API where torch's own DDP tests (torch/testing/_internal/distributed/
distributed_test.py) found megabuf differing (issue 40), on 2 gloo ranks: torch's comm-hook call
form `register_comm_hook(state, hook)` and its registration checks under every sharding strategy,
an untrainable module, and training under torch.distributed.autograd."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from background_jobs import Call, Runner
from dist_pool import case_result, run_each
from torch import nn
from torch_conformance_cases import (
    STRATEGIES,
    dist_autograd_case,
    registration_checks,
    torch_form_trains_like_torch_ddp,
    torch_names_case,
    untrainable_refused,
)

import megabuf
from megabuf.optimizer import MuonAdamW, OptimizerConfig, muon_param_groups
from megabuf.planning.model_plan import trainable_params
from megabuf.testing.launch import spawn
from megabuf.transport import torch_compat

FORMS = ("builtin", "annotated", "keywords")


@pytest.fixture(scope="module")
def results(pools: Any) -> list[dict[str, Any]]:
    cases: dict[str, tuple[Any, ...]] = {
        **{f"form_{f}": (torch_form_trains_like_torch_ddp, f) for f in FORMS},
        **{f"checks_{s}": (registration_checks, s) for s in STRATEGIES},
        "untrainable": (untrainable_refused,),
        "torch_names": (torch_names_case,),
    }
    return pools(2).run(run_each, cases)  # type: ignore[no-any-return]


@pytest.mark.parametrize("form", FORMS)
def test_torch_call_form_registers_and_trains_like_torch_ddp(results: Any, form: str) -> None:
    """`model.register_comm_hook(None, hook)` (torch's builtin allreduce_hook, an annotated hook
    of one's own, or keywords state=/hook=) on megabuf is from_torch(hook, None) for all buffers:
    grads equal torch DDP's with the same call bit for bit, every step; a second registration is
    refused as torch refuses it."""
    for rank, res in enumerate(case_result(results, f"form_{form}")):
        assert res["same"] == [True] * 3, (rank, res)
        assert res["hook_names"]["dense"].startswith("from_torch("), res
        cls, msg = res["twice"]
        assert cls == "CommHookRegistrationError" and "already registered" in msg, res
        assert res["twice_ref"] is not None and res["twice_ref"][0] == "RuntimeError", res


CHECKS = {
    "not_callable": ("TypeError", "must be callable as hook(state, bucket), got {}"),
    "bad_bucket": ("ValueError", "bad_bucket_hook's bucket annotation should be dist.GradBucket"),
    "bad_return": ("ValueError", "return annotation should be torch.futures.Future[torch.Tensor]"),
    "one_arg": ("TypeError", "one_arg_hook(bucket: "),
    "three_args": ("TypeError", "call it as register_comm_hook(hook, buffers=...)"),
    "from_torch_bad_bucket": ("ValueError", "from_torch: torch hook bad_bucket_hook's bucket"),
    "torch_hook_in_megabuf_form": ("CommHookModeError", "register_comm_hook(state, hook)"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("check", list(CHECKS))
def test_torch_registration_checks_refuse_by_name_under_every_strategy(
    results: Any, strategy: str, check: str
) -> None:
    """What torch DDP checks when a hook is registered (callable, the `bucket` and return
    annotations), plus a hook that cannot take (state, bucket) and a call of neither form, raise
    at registration naming the hook and what is wrong, under every strategy, on every rank."""
    cls, text = CHECKS[check]
    for rank, res in enumerate(case_result(results, f"checks_{strategy}")):
        assert res[check] is not None, (rank, check)
        assert res[check][0] == cls and text in res[check][1], (rank, res[check])
        assert res[check][1].startswith("megabuf: "), res[check]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_refused_registrations_attach_nothing(results: Any, strategy: str) -> None:
    """After the refused calls, a right torch-form call registers under no_shard and is refused
    by mode under the sharded strategies (a torch hook only all-reduces), naming the way out;
    megabuf's own form `register_comm_hook(hook=..., buffers=...)` still registers."""
    for res in case_result(results, f"checks_{strategy}"):
        if strategy == "no_shard":
            assert res["right"] is None and res["hooks_after"] == ["dense"], res
        else:
            cls, msg = res["right"]
            assert cls == "CommHookModeError" and "reduce_scatter" in msg, res
            assert res["hooks_after"] == [], res
        assert res["string_annotations"] is None, res  # resolved, right
        assert res["megabuf_form"] is None and res["megabuf_form_hooks"] == ["dense"], res


@pytest.mark.parametrize("name", ["empty", "frozen"])
def test_untrainable_module_is_refused_by_name_before_any_collective(
    results: Any, name: str
) -> None:
    """`DistributedDataParallel(nn.Module())` or of a module whose params are all frozen raises
    a RuntimeError (as torch DDP does) on every rank naming the module and the rank; no rank
    is left in a collective, so the next wrap and backward work."""
    for rank, res in enumerate(case_result(results, "untrainable")):
        cls, msg = res[name]
        assert cls == "RuntimeError" == res[f"{name}_torch"][0], res
        assert msg.startswith("megabuf: DistributedDataParallel got a "), msg
        assert f"no parameter that requires a gradient (rank {rank})" in msg, msg
        assert ("no params" if name == "empty" else "all 2 of its params are frozen") in msg, msg
        assert res["then_trains"], res


def test_trainable_params_refuses_none_without_a_process_group() -> None:
    """The check is pure (the engine runs it before its first collective): no process group."""
    assert [n for n, _ in trainable_params(nn.Linear(2, 2))] == ["weight", "bias"]
    with pytest.raises(RuntimeError, match="Sequential with no parameter that requires a grad"):
        trainable_params(nn.Sequential(nn.ReLU()))


# ---- Muon: torch.optim.Muon's refusals and the recipe's split (pure) ---------------------------
def test_unknown_muon_adjust_lr_fn_is_refused_listing_the_valid_values() -> None:
    """torch.optim.Muon refuses an unknown adjust_lr_fn; so do OptimizerConfig and MuonAdamW
    (its defaults and a group's own key), instead of training with no LR adjustment."""
    weight = nn.Parameter(torch.ones(3, 3))
    with pytest.raises(ValueError, match="not supported"):
        torch.optim.Muon([weight], adjust_lr_fn="match_rms_adam")
    valid = "\\(None, 'original', 'match_rms_adamw'\\)"
    with pytest.raises(
        ValueError, match=f"muon_adjust_lr_fn='match_rms_adam' is not one of {valid}"
    ):
        OptimizerConfig(optimizer="muon", muon_adjust_lr_fn="match_rms_adam")
    with pytest.raises(ValueError, match=f"group 0: adjust_lr_fn='orignal' is not one of {valid}"):
        MuonAdamW([{"params": [weight], "use_muon": True}], adjust_lr_fn="orignal")
    with pytest.raises(ValueError, match="group 1: adjust_lr_fn='x'"):
        MuonAdamW([{"params": [nn.Parameter(torch.ones(2))]},
                   {"params": [weight], "use_muon": True, "adjust_lr_fn": "x"}])  # fmt: skip
    for fn in (None, "original", "match_rms_adamw"):
        MuonAdamW([{"params": [weight], "use_muon": True}], adjust_lr_fn=fn)
        OptimizerConfig(optimizer="muon", muon_adjust_lr_fn=fn)


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)  # untied output head


class _LanguageModel(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mlp = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.mix = nn.Linear(8, 8)  # registered after the head: registration order is no guide
        if tied:
            self.lm_head.weight = self.embed.weight


def _split(module: nn.Module) -> tuple[list[str], list[str]]:
    names = {p: n for n, p in module.named_parameters()}
    chunk = SimpleNamespace(module=module, engine=SimpleNamespace(param_to_name=names))
    muon, adam = muon_param_groups([chunk])  # type: ignore[list-item]  # what it reads of a chunk
    assert muon["use_muon"] and not adam["use_muon"]
    return [names[p] for p in muon["params"]], [names[p] for p in adam["params"]]


@pytest.mark.parametrize("model", ["classifier", "lm_untied", "lm_tied"])
def test_muon_param_groups_sends_the_output_head_to_adamw(model: str) -> None:
    """The Muon recipe (and the docstring): Muon for hidden matrices only; embeddings, the output
    head (tied or untied), biases and norms go to AdamW."""
    module = {"classifier": _Classifier, "lm_untied": lambda: _LanguageModel(tied=False),
              "lm_tied": lambda: _LanguageModel(tied=True)}[model]()  # fmt: skip
    muon, adam = _split(module)
    if model == "classifier":
        assert muon == ["hidden.weight"], muon
        assert "head.weight" in adam, adam
    else:
        assert muon == ["mlp.weight", "mix.weight"], muon
        assert "embed.weight" in adam, adam
        assert ("lm_head.weight" in adam) == (model == "lm_untied"), adam  # tied: one param


def _dist_autograd_ranks() -> list[Any]:
    """Both ranks' reports, spawned beside the suite ([Note: background jobs] in
    background_jobs.py)."""
    return spawn(dist_autograd_case, 2, timeout_s=180)


DIST_AUTOGRAD = Call("torch DDP API: dist_autograd", _dist_autograd_ranks)


@pytest.mark.background(DIST_AUTOGRAD)
def test_training_forward_under_dist_autograd_is_refused_not_silently_local(
    background: Runner,
) -> None:
    """Under torch.distributed.autograd (real RPC, 2 processes), torch DDP reduces the grads
    dist_autograd.backward puts in the context ([3, 3, 3, 3] on both ranks, the mean of
    [2, ...] and [4, ...]); megabuf refuses the training forward inside the context on every rank,
    naming why and the alternatives, instead of leaving each rank its local grad. Outside the
    context the same model's plain backward gives torch DDP's grad."""
    per_rank = background.result(DIST_AUTOGRAD)
    want = torch.full((1, 4), 3.0)
    for rank, res in enumerate(per_rank):
        assert torch.equal(res["torch_grad"], want), (rank, res["torch_grad"])
        msg = res["refused"]
        assert msg is not None and msg.startswith("megabuf: a training forward ran inside"), res
        assert f"(rank {rank})" in msg and "not into megabuf's grad buffers" in msg, msg
        assert "plain loss.backward()" in msg and "torch.nn.parallel.DistributedDataParallel" in msg
        assert res["no_grad_forward_runs"], res
        assert torch.equal(res["plain_grad"], want), (rank, res["plain_grad"])


# ---- every public name of torch DDP: the porting guide's table ---------------------------------
GUIDE = Path(__file__).resolve().parents[1] / "docs" / "porting-from-torch-ddp.md"
UNEVEN_INPUTS = {"join", "join_hook", "join_device", "join_process_group"}  # Join's own tests


def torch_ddp_public_names() -> set[str]:
    """What a torch DDP user can reach beyond nn.Module: the class's public names and the
    constructor's arguments."""
    cls = torch.nn.parallel.DistributedDataParallel
    names = {n for n in set(dir(cls)) - set(dir(nn.Module)) if not n.startswith("_")}
    return names | (set(inspect.signature(cls.__init__).parameters) - {"self"})


def guide_table() -> dict[str, tuple[str, str]]:
    """The guide's "Every public name of torch DDP" table: name -> (status, how)."""
    text = GUIDE.read_text()
    section = text.split("## Every public name of torch DDP", 1)[1].split("\n\n| torch attr", 1)[0]
    rows: dict[str, tuple[str, str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                rows[name] = (cells[1], cells[2])
    return rows


def test_porting_guide_lists_every_public_name_of_torch_ddp() -> None:
    """Every public name of the installed torch's DDP (class names beyond nn.Module's and the
    constructor's arguments) has a row saying supported / refused / not applicable: a torch
    upgrade that adds a name fails here until the guide says what megabuf does."""
    rows = guide_table()
    missing = sorted(torch_ddp_public_names() - set(rows))
    assert not missing, f"add rows to {GUIDE.name} for torch DDP's {missing}"
    assert {status for status, _ in rows.values()} <= {"supported", "refused", "not applicable"}


def test_guide_rows_say_what_megabuf_does() -> None:
    """A refused name (a constructor argument) raises a ValueError with the message the guide
    quotes (its pieces between "..."); a supported one is a constructor argument megabuf takes
    or a name of megabuf.DistributedDataParallel; a name not applicable is none of these."""
    megabuf_args = set(torch_compat.TORCH_DDP_ARGS) | {"module"}
    for name, (status, how) in guide_table().items():
        has = name in megabuf_args or hasattr(megabuf.DistributedDataParallel, name)
        if status == "refused":
            with pytest.raises(ValueError) as exc:
                torch_compat.resolve(nn.Linear(2, 2), None, None, {name: object()})
            message = str(exc.value)
            assert message.startswith("megabuf: ") and name in message, (name, message)
            quoted = re.findall(r'"([^"]+)"', how)
            assert quoted, (name, how)
            for piece in quoted[0].split("..."):
                assert piece.strip() in message, (name, piece, message)
        elif status == "supported" and name not in UNEVEN_INPUTS:
            assert has, name
        elif status == "not applicable":
            assert not has, name


def test_broadcast_buffers_and_will_sync_module_buffers_read_like_torch_ddp(results: Any) -> None:
    """`model.broadcast_buffers` reads and sets the flag, `will_sync_module_buffers()` follows it
    and the sync flag, as on torch DDP; with the flag set off a training forward leaves each
    rank's buffers its own."""
    for rank, res in enumerate(case_result(results, "torch_names")):
        assert res["megabuf"] == res["torch"], res
        assert res["megabuf"] == [True, True, False, True, False, False, 1.0 + rank], res
        assert res["no_buffers"] is False, res
