"""Mutation check (`make mutants`): does the test suite catch small planted bugs?

Each mutant is one exact text patch of one file under `megabuf/` that breaks one core rule. For
each, `megabuf/` is copied to a temporary directory, the patch applied (the old text must occur
exactly once there: the list fails loudly when it drifts from the code), and pytest runs against
the copy (`PYTHONPATH=<tmp>`, `python -P` so the working tree's own `megabuf` is not imported):
first the mutant's most relevant test files, then, if they all pass, the rest of the suite. A
mutant is "caught" when a test fails, "survived" when everything passes. Exit status 1 if any
mutant survived (or its run errored).

    python tests/mutants.py                # every mutant; survivors cost a full suite run each
    python tests/mutants.py --quick        # relevant test files only (a survivor may be a miss)
    python tests/mutants.py --only NAME... # some mutants; --list prints them
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    rule: str  # the core rule the patch breaks
    path: str  # relative to the repository root, under megabuf/
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple[str, ...] = ()  # most relevant test files, run first to fail fast


MUTANTS = (
    Mutant(
        "hybrid-replicate-all-reduce-skipped",
        "hybrid: each reduced shard is all-reduced across the replicate group once per step",
        "megabuf/sharding/replicate.py",
        "        self.owed = self.across is not None and final and not self.crossed\n",
        "        self.owed = False\n",
        ("tests/test_hybrid.py",),
    ),
    Mutant(
        "hybrid-replicate-every-microbatch",
        "hybrid: nothing crosses the replicate group before the step's last micro-batch",
        "megabuf/sharding/replicate.py",
        "        self.owed = self.across is not None and final and not self.crossed\n",
        "        self.owed = self.across is not None\n",
        ("tests/test_hybrid.py",),
    ),
    Mutant(
        "hybrid-replicate-over-wrong-group",
        "hybrid: the second level runs over the replicate group, not the shard group",
        "megabuf/transport/process_groups.py",
        "else ReplicateGroup(self.dp_replicate)",
        "else ReplicateGroup(self.shard_group(False))",
        ("tests/test_hybrid.py",),
    ),
    Mutant(
        "hybrid-hook-second-level-skipped",
        "hybrid: a registered comm hook also reduces the shard across the replicate group",
        "megabuf/sharding/replicate.py",
        "[HookWork(self.hook, b, self.timeout_s) for b in self.hook_buckets]",
        "[]",
        ("tests/test_hybrid_hooks.py",),
    ),
    Mutant(
        "hybrid-deterministic-second-level-backend-order",
        "hybrid deterministic mode: the second level is the fixed-order sum, not the backend's",
        "megabuf/sharding/replicate.py",
        "        if self.hook is not None:  # every stage now",
        "        if self.hook is not None and not getattr(self.hook, 'deterministic', False):  #",
        ("tests/test_hybrid_hooks.py",),
    ),
    Mutant(
        "hybrid-deterministic-second-level-rank-dependent-order",
        "hybrid deterministic mode: every rank sums the replicas in replicate-rank order",
        "megabuf/comm_hooks/fixed_order.py",
        "    sum_chunks(received, total)  # fp32, group-rank order\n",
        "    sum_chunks(received if bucket.params else received.view(size, -1).roll(\n"
        "        -bucket.group_rank, 0).reshape(-1), total)\n",
        ("tests/test_hybrid_hooks.py",),
    ),
    Mutant(  # issue 46: the hybrid row of the extended matrix
        "hybrid-replicate-sums-under-average",
        "hybrid with average_in_collective: the replicate level averages, it does not sum",
        "megabuf/sharding/replicate.py",
        "average=self.average,",
        "average=False,",
        ("tests/test_matrix2.py", "tests/test_hybrid.py"),
    ),
    Mutant(
        "hybrid-hook-replica-level-sums-under-average",
        "hybrid comm hook with average_in_collective: the second level's view averages too",
        "megabuf/sharding/replica_hooks.py",
        '        "gradient_scaling_factor": 1.0,\n',
        '        "gradient_scaling_factor": 1.0, "average": False,\n',
        ("tests/test_matrix2.py", "tests/test_hybrid_hooks.py"),
    ),
    Mutant(  # issue 46: the weight-lifecycle row
        "offload-leaves-expert-buffers",
        "offload releases the expert-parallel buffers as well as the dense ones",
        "megabuf/weights/offload.py",
        "        buffers = chunk.engine.buffers\n",
        "        buffers = chunk.engine.dense_buffers\n",
        ("tests/test_matrix2.py", "tests/test_weights.py"),
    ),
    Mutant(
        "weight-version-counts-skipped-steps",
        "the weight version counts applied updates: a skipped step does not move it",
        "megabuf/optimizer/base.py",
        "        self._release_grads()\n        for chunk in self.model_chunks:\n"
        "            chunk.engine.hooks.notify_comm_hooks_step_skipped()\n",
        "        self._release_grads()\n        self._completed_steps += 1\n"
        "        for chunk in self.model_chunks:\n"
        "            chunk.engine.hooks.notify_comm_hooks_step_skipped()\n",
        ("tests/test_matrix2.py", "tests/test_weights_publish.py"),
    ),
    Mutant(  # issue 46: the whole-param owners row
        "muon-adamw-constructor-overrides-group-keys",
        "MuonAdamW: keys given in a param group override the constructor's",
        "megabuf/optimizer/muon.py",
        "                group.setdefault(key, value)\n",
        "                group[key] = value\n",
        ("tests/test_matrix2.py", "tests/test_muon.py"),
    ),
    Mutant(  # issue 46: the counted-arrivals row
        "counted-arrivals-count-inside-no-sync",
        "counted arrivals: inside no_sync() a group passes its arrivals and is not made ready",
        "megabuf/buckets/arrivals.py",
        "            if not (self.total and group.counts_arrivals):\n",
        "            if not self.total:\n",
        ("tests/test_matrix2.py",),
    ),
    Mutant(  # issue 46: the auto re-plan row
        "replan-buckets-rescale-under-average",
        "the in-place re-plan keeps each buffer's gradient_scaling_factor (1 under averaging)",
        "megabuf/buckets/buffer.py",
        "        self._grad_data.zero_()\n        self.buckets = [",
        "        self._grad_data.zero_()\n"
        "        self.gradient_scaling_factor = 1.0 / self.dp_size\n        self.buckets = [",
        ("tests/test_matrix2.py",),
    ),
    Mutant(
        "expert-norm-not-over-ep",
        "global grad norm: expert parts are summed over expt_dp, ep and pp",
        "megabuf/optimizer/distributed.py",
        "(pgs.shard_group(True), pgs.ep, pgs.pp)",
        "(pgs.shard_group(True), pgs.pp)",
        ("tests/test_moe.py", "tests/test_optimizer_contract.py"),
    ),
    Mutant(
        "dispatch-in-readiness-order",
        "bucket groups are dispatched in chain order on every rank",
        "megabuf/buckets/dispatch.py",
        "and self.groups[self.next_index].all_ready:\n"
        "            self.groups[self.next_index].start_grad_sync()\n"
        "            self.next_index += 1\n",
        "and False:\n"
        "            pass\n"
        "        for group in self.groups:\n"
        "            if group.all_ready and group.grad_state is GradSyncState.IDLE:\n"
        "                group.start_grad_sync()\n",
        ("tests/test_bucket_state.py", "tests/test_grad_contract.py"),
    ),
    Mutant(
        "tokens-not-summed-over-dp",
        "per-token loss: the token count is summed over dp",
        "megabuf/training/finalize.py",
        "    collectives.all_reduce(total, pgs.dp, async_op=False)\n",
        "    total *= pgs.dp_size\n",
        ("tests/test_asymmetric.py", "tests/test_pipeline.py", "tests/test_moe.py"),
    ),
    Mutant(
        "no-grad-copy-for-bf16",
        "grad contract: params whose dtype differs from the grad dtype get a .grad copy",
        "megabuf/sync/grads.py",
        "            param.grad = copy\n",
        "            continue\n",
        ("tests/test_grad_contract.py", "tests/test_ddp_grads.py"),
    ),
    Mutant(
        "set-to-none-keeps-old-grads",
        "a .grad the user set to None starts that param fresh at the next backward",
        "megabuf/sync/grads.py",
        "            if param.grad is None:\n                self._mark_fresh(param)\n"
        "            elif param.grad is not main_grad:",
        "            if param.grad is None:\n                param.grad = main_grad\n"
        "            elif param.grad is not main_grad:",
        ("tests/test_drop_in.py",),
    ),
    Mutant(
        "no-sync-at-backward-end",
        "with sync_grads_at_backward_end, backward returns with the grads reduced",
        "megabuf/sync/backward_sync.py",
        "        if self.param_grads and self.wanted():\n            self.param_grads = False\n"
        "            self._finish()\n",
        "        pass\n",
        ("tests/test_drop_in.py",),
    ),
    Mutant(
        "require-backward-grad-sync-ignored",
        "require_backward_grad_sync=False makes backward only accumulate",
        "megabuf/sync/grad_sync.py",
        "        self.backward_end.set_require_sync(bool(value))\n",
        "        pass\n",
        ("tests/test_drop_in.py",),
    ),
    Mutant(
        "dense-scale-not-1-over-dp",
        "gradient scaling: every buffer ends at 1/dp_size",
        "megabuf/core/assembly.py",
        "    return 1.0 / dp_size, 1.0 / dp_size\n",
        "    return 1.0, 1.0 / dp_size\n",
        ("tests/test_ddp_grads.py",),
    ),
    Mutant(
        "expert-scale-1-over-expt-dp",
        "gradient scaling: expert grads too are scaled by 1/dp_size, not 1/expt_dp_size",
        "megabuf/core/assembly.py",
        "    return 1.0 / dp_size, 1.0 / dp_size\n",
        "    return 1.0 / dp_size, 1.0 / pgs.topology.expt_dp_size\n",
        ("tests/test_moe.py", "tests/test_accumulate.py"),
    ),
    Mutant(
        "pre-scale-skipped",
        "gradient scaling: all-reduced buckets are scaled before the sum",
        "megabuf/buckets/grad_math.py",
        "        torch._foreach_mul_(same, factor)\n",
        "        pass\n",
        ("tests/test_ddp_grads.py",),
    ),
    Mutant(
        "avg-never-divided",
        "an emulated AVG (gloo) is a SUM then a divide by the group size",
        "megabuf/transport/collectives.py",
        "        return dist.ReduceOp.SUM, size\n",
        "        return dist.ReduceOp.SUM, 1\n",
        ("tests/test_ddp_grads.py", "tests/test_accumulate.py"),
    ),
    Mutant(
        "shard-piece-off-by-one",
        "ranges: a rank's shard pieces cover its shard exactly",
        "megabuf/pure/layout.py",
        "start, end = max(slot.start, lo), min(slot.end, hi)",
        "start, end = max(slot.start, lo), min(slot.end, hi - 1)",
        ("tests/test_layout.py", "tests/test_optimizer_distributed.py"),
    ),
    Mutant(
        "bucket-pad-ignores-dp",
        "padding: sharded buckets are padded to a multiple of lcm(dp_size, 128)",
        "megabuf/pure/layout.py",
        "    multiple = math.lcm(dp_size, BUCKET_ALIGN_NUMEL)\n",
        "    multiple = BUCKET_ALIGN_NUMEL\n",
        ("tests/test_layout.py", "tests/test_plan.py"),
    ),
    Mutant(
        "param-start-not-aligned",
        "padding: with the distributed optimizer each param starts at a multiple of 64",
        "megabuf/pure/layout.py",
        "start = _round_up(cursor, PARAM_ALIGN_NUMEL) if sharded else cursor",
        "start = cursor",
        ("tests/test_layout.py", "tests/test_plan.py"),
    ),
    Mutant(
        "ready-after-first-arrival",
        "readiness: a group is ready after each param's learned number of arrivals",
        "megabuf/buckets/readiness.py",
        "if expected is None or self.arrivals[i] != expected[i]:",
        "if expected is None or self.arrivals[i] != 1:",
        ("tests/test_grad_contract.py", "tests/test_bucket_state.py"),
    ),
    Mutant(
        "unwritten-grads-not-zeroed",
        "zeroing: a param without a grad this iteration reduces zeros, not stale values",
        "megabuf/buckets/grad_math.py",
        "            torch._foreach_zero_(same_dtype)\n",
        "            pass\n",
        ("tests/test_grad_contract.py", "tests/test_bucket_state.py"),
    ),
    Mutant(
        "first-grad-added-not-copied",
        "zeroing: the first grad after zero_grad_buffer() overwrites main_grad",
        "megabuf/sync/hooks.py",
        "                main_grad.copy_(grad)\n",
        "                main_grad.add_(grad)\n",
        ("tests/test_ddp_grads.py", "tests/test_grad_contract.py"),
    ),
    Mutant(
        "clip-never-applied",
        "clipping: grads are scaled by max_norm / (norm + eps) when that is below 1",
        "megabuf/optimizer/clip.py",
        "            torch._foreach_mul_(list(grads), coef)\n",
        "            pass\n",
        ("tests/test_optimizer_units.py", "tests/test_optimizer_distributed.py"),
    ),
    Mutant(
        "loss-scale-not-unscaled",
        "loss scaling: grads are multiplied by 1/scale before the step",
        "megabuf/optimizer/grad_scaler.py",
        "        return self._scale.double().reciprocal().float()\n",
        "        return torch.ones_like(self._scale)\n",
        ("tests/test_optimizer_units.py", "tests/test_optimizer_distributed.py"),
    ),
    Mutant(
        "found-inf-not-over-dp",
        "a non-finite step is skipped on every rank (inf flag max-reduced over dp)",
        "megabuf/optimizer/base.py",
        "            for group in (self.process_groups.dp, self.process_groups.pp):\n",
        "            for group in (self.process_groups.pp,):\n",
        ("tests/test_optimizer_distributed.py", "tests/test_optimizer_contract.py"),
    ),
    Mutant(
        "force-sync-returns-on-a-gather-in-flight",
        "start_param_sync(force_sync=True) returns with every param gathered (issue 23)",
        "megabuf/buckets/param_gather.py",
        "        if force_sync and self.state is ParamSyncState.DISPATCHED:\n",
        "        if False:\n",
        ("tests/test_param_sync.py",),
    ),
    Mutant(
        "unhooked-forward-reads-mid-gather",
        "a forward with the pre-hooks disabled waits for every param gather in flight",
        "megabuf/sync/param_sync.py",
        "        if hooks.at_root or (self.overlap and not hooks.enabled):\n",
        "        if hooks.at_root:\n",
        ("tests/test_param_sync.py",),
    ),
    # issue 29: checkpoints where features meet (tests/test_checkpoint_combos.py)
    Mutant(
        "torch-optim-common-rank0-only",
        "checkpoint: a plain torch optimizer's param groups are saved for every stage / ep rank",
        "megabuf/checkpoint/torch_optim.py",
        "    if chunks[0].process_groups.topology.expt_dp_rank != 0:\n",
        "    if chunks[0].process_groups.topology.rank != 0:\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "torch-optim-common-per-dp-not-expt-dp",
        "checkpoint: the torch optimizer's param groups of each ep rank are written (expt_dp rank"
        " 0, not dp rank 0: only one ep rank's ranks hold its experts)",
        "megabuf/checkpoint/torch_optim.py",
        "    if chunks[0].process_groups.topology.expt_dp_rank != 0:\n",
        "    if chunks[0].process_groups.topology.dp_rank != 0:\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "torch-optim-expert-state-by-dp-rank-0",
        "checkpoint: a torch optimizer's expert-param state is written by expt_dp rank 0",
        "megabuf/checkpoint/torch_optim.py",
        "    return pgs.topology.data_parallel(is_expert_parallel(param))[0] == 0\n",
        "    return pgs.topology.dp_rank == 0\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "torch-optim-lost-state-loads-fresh",
        "checkpoint: a param whose torch optimizer state was saved but is missing is refused",
        "megabuf/checkpoint/torch_optim.py",
        "    lost = [w[0] for w in wanted if w[0] in stateful and w[0] not in saved]\n",
        "    lost: list[str] = []\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "expert-model-entries-by-dp-rank-0",
        "checkpoint: expert params are written by expt_dp rank 0 of each ep rank",
        "megabuf/checkpoint/model_state.py",
        "pgs.topology.dp_rank == 0, pgs.topology.expt_dp_rank == 0\n",
        "pgs.topology.dp_rank == 0, pgs.topology.dp_rank == 0\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "scaler-growth-tracker-not-saved",
        "checkpoint: the dynamic loss scaler's growth tracker is saved",
        "megabuf/optimizer/grad_scaler.py",
        '            "growth_tracker": self.growth_tracker,\n',
        "",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "scaler-hysteresis-not-saved",
        "checkpoint: the dynamic loss scaler's hysteresis tracker is saved",
        "megabuf/optimizer/grad_scaler.py",
        '            "hysteresis_tracker": self.hysteresis_tracker,\n',
        "",
        ("tests/test_checkpoint_combos.py",),
    ),
    Mutant(
        "local-sgd-averaged-at-not-saved",
        "checkpoint: LocalSGD's averaging step is saved with its step counter",
        "megabuf/comm_hooks/local_sgd.py",
        '            replicated["averaged_at"] = self.averaged_at\n',
        "            pass\n",
        ("tests/test_checkpoint_combos.py",),
    ),
    # ---- issue 29, the combination matrix: bugs visible only where groups differ (ep 2 on 4
    # ranks: expert dp 2 != dp 4), in one micro-batch, or on a later pipeline stage
    Mutant(
        "nan-check-agrees-over-expert-dp",
        "NaN check: the flags are agreed over dp, so a NaN in one expert stops every rank",
        "megabuf/core/engine.py",
        "            self.all_bucket_groups, self.collectives, pgs.dp,\n"
        "            dp_rank=pgs.dp_rank, dp_size=pgs.dp_size, rank=self.rank,\n",
        "            self.all_bucket_groups, self.collectives, pgs.expt_dp,\n"
        "            dp_rank=pgs.topology.expt_dp_rank,\n"
        "            dp_size=pgs.topology.expt_dp_size, rank=self.rank,\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "nan-flags-of-last-microbatch-only",
        "NaN check under reduce_each_microbatch: a NaN in any micro-batch is flagged",
        "megabuf/buckets/grad_math.py",
        "            flags = torch.maximum(flags, self.flags)\n",
        "            pass\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "finish-skipped-when-groups-synced",
        "finish_grad_sync runs the NaN/unused agreement once per iteration on every rank",
        "megabuf/sync/grad_sync.py",
        "and self.phase is SyncPhase.SYNCED and self.unsynced_group() is None:\n",
        "and self.unsynced_group() is None:\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "dense-norm-over-expert-dp",
        "global grad norm: dense shards are summed over dp (not the expert-dp group)",
        "megabuf/optimizer/distributed.py",
        "return (pgs.shard_group(False), pgs.pp)",
        "return (pgs.expt_dp, pgs.pp)",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "zero3-expert-shard-by-ep-rank",
        "ZeRO-3: an expert param shard is cut at the rank's expert-dp rank",
        "megabuf/core/assembly.py",
        "        rank=ctx.pgs.topology.rank, poison=ctx.config.verify_param_access,\n"
        "        dp_rank=dp_rank, dp_size=dp_size,\n",
        "        rank=ctx.pgs.topology.rank, poison=ctx.config.verify_param_access,\n"
        "        dp_rank=ctx.pgs.dp_rank % dp_size, dp_size=dp_size,\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "local-sgd-averages-experts-over-dp",
        "PeriodicAverager averages each bucket's params over that bucket's group",
        "megabuf/comm_hooks/local_sgd.py",
        "        groups.setdefault(id(bucket.group), []).append(bucket)\n",
        "        groups.setdefault(0, []).append(bucket)\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "interleaved-grad-sync-not-delayed-by-stage",
        "interleaved: stage s launches a chunk's grad sync s backward steps after its last",
        "megabuf/pipeline/schedules.py",
        "        k = act.index - self.pp_rank\n",
        "        k = act.index\n",
        ("tests/test_pipeline.py",),
    ),
    Mutant(
        "deferred-skips-microbatch-reduction",
        "reduce_each_microbatch: a no_sync backward reduces its micro-batch even when deferred",
        "megabuf/sync/backward_sync.py",
        "        return self.every_backward\n",
        "        return self.every_backward and not self.defer_depth\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "found-inf-not-over-pp",
        "a non-finite step is skipped on every pipeline stage (inf flag max-reduced over pp)",
        "megabuf/optimizer/base.py",
        "            for group in (self.process_groups.dp, self.process_groups.pp):\n",
        "            for group in (self.process_groups.dp,):\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "nan-check-not-agreed-over-pp",
        "NaN check under a pipeline: every stage raises when one stage saw a non-finite grad",
        "megabuf/sync/nan_check.py",
        "    if pp_size == 1:\n",
        "    if True:\n",
        ("tests/test_matrix.py",),
    ),
    Mutant(
        "owner-shard-splits-a-matrix",
        "whole-param owners: every param lies whole inside its owner's shard (Muon never "
        "orthogonalises a partial matrix)",
        "megabuf/pure/owners.py",
        "shard = _round_up(max((end for _, end in offsets), default=0), align)",
        "shard = _round_up(-(-sum(end for _, end in offsets) // dp_size), align)",
        ("tests/test_owners.py", "tests/test_muon.py"),
    ),
    Mutant(
        "stale-param-from-owner",
        "whole-param owners: the owner steps the param's own memory (or writes its copy back), "
        "so the gather publishes the updated value",
        "megabuf/optimizer/main_params.py",
        "            main = main.view(param.shape)\n",
        "            main = main.reshape(param.shape).clone()\n",
        ("tests/test_muon.py",),
    ),
    Mutant(
        "owner-differs-across-ranks",
        "whole-param owners: every rank chooses the same owner for every param",
        "megabuf/pure/owners.py",
        "        return worst, loads[r], r\n",
        '        return worst, loads[r], (r + __import__("os").getpid()) % len(loads)\n',
        ("tests/test_muon.py",),
    ),
    Mutant(
        "restore-zeroes-kept-grads",
        "offload(keep_grads=True) / restore brings every storage back bitwise",
        "megabuf/weights/stash.py",
        "                if e.host is not None:",
        '                if e.host is not None and e.category != "grads":',
        ("tests/test_weights.py",),
    ),
    Mutant(
        "offload-forgets-optimizer-state",
        "offload releases the optimizer's state with the model (bytes = the formula)",
        "megabuf/weights/offload.py",
        '    yield "optimizer_state", state, True',
        '    yield "optimizer_state", [], True',
        ("tests/test_weights.py",),
    ),
    Mutant(
        "step-not-guarded-while-offloaded",
        "every entry point of an offloaded engine raises EngineOffloadedError",
        "megabuf/optimizer/base.py",
        '        self._check_resident("optimizer step()")\n',
        "",
        ("tests/test_weights.py",),
    ),
    Mutant(
        "export-skips-gather-wait",
        "exported weights are the last step's, never a param whose gather is in flight",
        "megabuf/weights/export.py",
        "        chunk.engine.param_side.publish()  # no param is read mid-gather\n",
        "",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "export-fresh-gather-not-counted",
        "the ledger counts an export's ZeRO-3 gathers (peak = max_buckets consecutive groups)",
        "megabuf/weights/export.py",
        "        ledger.alloc(EXPORT_CATEGORY, nbytes)\n",
        "",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "export-frame-holds-previous-group",
        "a ZeRO-3 export holds at most max_buckets gathered groups in real memory, not only in "
        "the ledger",
        "megabuf/weights/export.py",
        "_item(*groups[index], gathered.pop(index), version,",
        "_item(*groups[index], (held := gathered.pop(index)), version,",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "replan-exchange-keeps-whole-pieces",
        "a sharded re-plan keeps only the old state overlapping the ranges a rank steps now",
        "megabuf/optimizer/model_space.py",
        'kept[(piece["key"], lo, hi)] = trimmed(piece, lo, hi)',
        'kept[(piece["key"], lo, hi)] = piece',
        ("tests/test_optimizer_units.py", "tests/test_autobucket.py"),
    ),
    Mutant(
        "zero3-replan-memory-not-agreed",
        "every dp rank decides alike whether a sharded re-plan fits (MAX of the shortfalls)",
        "megabuf/replan/sharded_replan.py",
        "    collectives.all_reduce_max(short, group)\n",
        "",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-dp1-rebuilds",
        "at dp 1 the auto re-plan keeps the plan that ran (a rebuild only costs memory)",
        "megabuf/replan/autobucket.py",
        "        if dp_size == 1:  # [Note: auto bucket plan at dp 1]\n",
        "        if dp_size == 0:\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "small-grads-not-zeroed",
        "zero_grad_buffer() zeroes the small grads that the next backward accumulates into",
        "megabuf/sync/grads.py",
        "            torch._foreach_zero_(self._small_runs)\n",
        "            pass\n",
        ("tests/test_small_grads.py",),
    ),
    Mutant(
        "small-grads-link-over-user-grad",
        "a .grad the user set before backward is kept (backward adds to it)",
        "megabuf/sync/grads.py",
        "        for param, main_grad in self.small:\n            if param.grad is None:\n",
        "        for param, main_grad in self.small:\n            if True:\n",
        ("tests/test_small_grads.py",),
    ),
    Mutant(
        "small-grads-run-spans-large",
        "a run of small grads never covers a large param's main_grad",
        "megabuf/sync/grads.py",
        "            if view.numel() <= max_numel:\n",
        "            if True:\n",
        ("tests/test_small_grads.py",),
    ),
    Mutant(
        "bookkeeping-gate-not-reopened-at-backward-end",
        "the engine's per-backward bookkeeping runs again in the next backward over a kept graph",
        "megabuf/sync/grad_sync.py",
        "    def _backward_over(self) -> None:\n        self.in_backward[0] = False\n",
        "    def _backward_over(self) -> None:\n        pass\n",
        ("tests/test_small_grads.py",),
    ),
    Mutant(
        "changed-only-trusts-dp-rank-0",
        "changed-only publish sends every bucket whose slice changed on any trainer",
        "megabuf/weights/transfer.py",
        "if any(t.changed[i] for t in trainers)",
        "if lead.changed[i]",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "changed-only-ignores-consumer-layout",
        "changed-only skips a bucket only for consumers holding this publish's dtype and layout",
        "megabuf/weights/transfer.py",
        "    return consumer.holds == holding(lead.manifest, lead.dtype)\n",
        "    return True\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "publisher-keeps-pre-replan-buckets",
        "a Publisher follows a bucket re-plan: it publishes the engine's current buckets",
        "megabuf/weights/publish.py",
        "        model.engine.param_side.publish()\n        self._follow_layout()\n",
        "        model.engine.param_side.publish()\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "delta-anchor-never-due",
        "with deltas, every anchor_every-th publish is whole (an anchor)",
        "megabuf/weights/publish.py",
        "            delta and self._since_anchor >= self.anchor_every - 1,\n",
        "            False,\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "delta-patch-misplaced",
        "a consumer writes each delta value at its own index (bitwise the trainer's slice)",
        "megabuf/weights/delta.py",
        "    flat.index_copy_(0, indices.to(torch.int64), values)\n",
        "    flat.index_copy_(0, indices.to(torch.int64).flip(0), values)\n",
        ("tests/test_weights_delta.py", "tests/test_weights_publish.py"),
    ),
    Mutant(
        "four-phase-update-loads-nothing",
        "the four-phase receiver loads every received weight into the engine",
        "megabuf/weights/weight_transfer.py",
        "        self.load_weights(iter(weights.items()))\n",
        "",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "async-publish-without-snapshot",
        "an asynchronous publish sends its version, never the next step's values",
        "megabuf/weights/publish.py",
        "        if snapshot and viewed:\n",
        "        if False:\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "hybrid-publish-slices-over-the-dp-world",
        "under a hybrid split each publishing trainer sends (whole or as a delta) its slice "
        "of the buffer laid out over its shard group",
        "megabuf/weights/publish.py",
        "lo, hi = send_range(bucket.numel, buf.dp_rank, buf.dp_size)",
        "topo = self.model.engine.process_groups.topology\n"
        "        lo, hi = send_range(bucket.numel, topo.dp_rank, topo.dp_size)",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "delta-to-any-current-consumer",
        "a delta is sent only when every consumer holds the previous version (a late joiner "
        "gets a whole anchor)",
        "megabuf/weights/transfer.py",
        "    current = all(_current(c, lead) for c in consumers)\n",
        "    current = any(_current(c, lead) for c in consumers)\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "async-publish-misses-views-of-the-model",
        "an asynchronous publish snapshots every slice that views the model's own shard "
        "(and keeps a copy, not a view, to detect the next delta against)",
        "megabuf/weights/publish.py",
        "    return any(ptr == t.untyped_storage().data_ptr() for t in homes)\n",
        "    return False\n",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "receiver-swaps-trainer-slices",
        "a consumer rebuilds each bucket from every trainer's own slice",
        "megabuf/weights/publish.py",
        "lo, hi = send_range(flat.numel(), r, len(trainers))",
        "lo, hi = send_range(flat.numel(), len(trainers) - 1 - r, len(trainers))",
        ("tests/test_weights_publish.py",),
    ),
    Mutant(
        "microbatch-counts-not-compared",
        "ranks of one shard group with different micro-batch counts raise by name, never hang",
        "megabuf/sync/microbatches.py",
        'problem = "" if len(set(got)) == 1 else self._describe(got)',
        'problem = ""',
        ("tests/test_hybrid.py",),
    ),
    Mutant(
        "auto-bucket-rank-local-plan",
        "bucket_size=auto plans from numbers agreed over dp, never from rank-local timings",
        "megabuf/replan/autobucket.py",
        "agreed = agree(self.measure(grad_dtype), self.collectives, self.group, self.device)",
        "agreed = self.measure(grad_dtype)",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-views-not-relinked",
        "the auto re-plan keeps every main_grad a view of the buffer the buckets reduce",
        "megabuf/buckets/buffer.py",
        "        self._grad_data.zero_()\n        self.buckets = [self._make_bucket(",
        "        self._grad_data = torch.zeros_like(self._grad_data)\n"
        "        self.buckets = [self._make_bucket(",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-old-grad-hooks-kept",
        "the auto re-plan removes the grad hooks of the old bucket groups",
        "megabuf/core/wiring.py",
        "    for handle in old.grad_hook_handles:\n        handle.remove()\n",
        "",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-sharded-optimizer-state-dropped",
        "a sharded auto re-plan carries the optimizer's model-space state onto the new shards",
        "megabuf/optimizer/distributed.py",
        "        load_model_space_state(self.parts(), state)\n",
        "        del state\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-sharded-old-grad-shards-ledgered",
        "a sharded auto re-plan takes the old groups' grad shards off the memory ledger",
        "megabuf/replan/sharded_replan.py",
        "            ledger.free(GRAD_SHARD, group.grads.shard_nbytes)\n",
        "            pass\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-zero3-params-not-gathered",
        "a ZeRO-3 auto re-plan gathers every shard unit before copying the params into new buffers",
        "megabuf/sharding/unit_params.py",
        "        runtime.gather_all()\n        runtime.remove()\n",
        "        runtime.remove()\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-bucket-zero3-old-param-shards-ledgered",
        "a ZeRO-3 auto re-plan takes the old groups' param shards off the memory ledger",
        "megabuf/sharding/params.py",
        "        self.ledger.free(PARAM_SHARD, sum(_nbytes(s) for s in self.shards))\n",
        "",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "inbound-scale-never",
        "grads that reach main_grad by the hook's copy take the pre-scale factor on the way in",
        "megabuf/buckets/grad_math.py",
        "        if first and allowed and self.factor is not None:\n",
        "        if False:\n",
        ("tests/test_inbound_scale.py",),
    ),
    Mutant(
        "inbound-scale-linked-after-scaled-copy",
        "a param scaled on the way in keeps .grad None until the sync (no unscaled in-place add)",
        "megabuf/sync/hooks.py",
        "                param.grad = None  # linked at the sync: no unscaled grad added in pl",
        "                param.grad = main_grad if link else None  # in pl",
        ("tests/test_inbound_scale.py",),
    ),
    Mutant(
        "inbound-scale-under-no-sync",
        "grads go in scaled only when this backward's end reduces the group (not under no_sync)",
        "megabuf/buckets/bucket_group.py",
        "        self._inbound_allowed = value and scales and cfg.sync_grads_at_backward_end",
        "        self._inbound_allowed = scales and cfg.sync_grads_at_backward_end",
        ("tests/test_inbound_scale.py",),
    ),
    Mutant(
        "paired-ratio-not-per-round",
        "the paired bench divides each step by the baseline's step of the same round",
        "megabuf/bench/paired.py",
        "        ratios = [steps[s][r] / steps[0][r] for r in range(n_rounds)]\n",
        "        ratios = [steps[s][r] / statistics.median(steps[0]) for r in range(n_rounds)]\n",
        ("tests/test_bench_paired.py",),
    ),
    Mutant(
        "backward-end-syncs-without-param-grads",
        "a backward that reaches no param (autograd.grad of the inputs) does not close the sync",
        "megabuf/sync/backward_sync.py",
        "        if self.param_grads and self.wanted():\n",
        "        if self.wanted():\n",
        ("tests/test_create_graph.py",),
    ),
    Mutant(
        "local-sgd-saves-between-averagings",
        "a LocalSGD checkpoint between averagings (replicas differ) is refused on every rank",
        "megabuf/comm_hooks/local_sgd.py",
        "        if self.step > last:\n",
        "        if False:\n",
        ("tests/test_checkpoint_combos.py", "tests/test_comm_hook_quant_local.py"),
    ),
    Mutant(
        "auto-quiet-step-never",
        "the last of >= 3 auto warm-up steps is quiet (reduced after backward), grads unsharded",
        "megabuf/replan/autobucket.py",
        "        return due and self.quiet_allowed and not self.replanned\n",
        "        return False\n",
        ("tests/test_bucket_planner.py", "tests/test_autobucket.py"),
    ),
    Mutant(
        "auto-torch-loop-never-replans",
        "a forward starting an iteration whose grads every rank cleared re-plans (torch loops)",
        "megabuf/core/engine.py",
        "        if pending.item() == 0.0:\n            self.zero_grad_buffer()\n",
        "        if pending.item() == 0.0:\n            pass\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-cleared-grads-not-agreed",
        "the iteration start is agreed over dp: one rank's uncleared grads stop every rank",
        "megabuf/core/engine.py",
        "        self.collectives.all_reduce_max(pending, auto.group)\n",
        "",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-kept-plan-keeps-recording",
        "after the re-plan (kept or not) the warm-up's timeline records nothing more",
        "megabuf/replan/autobucket.py",
        "        if not self.replanned:  # a kept plan's grad sync still calls\n",
        "        if True:\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "auto-never-gives-up",
        "no iteration start in 2 syncs past the warm-up: the default plan kept, with a warning",
        "megabuf/replan/autobucket.py",
        "        return not self.replanned and self.syncs >= warmup + OVERDUE_SYNCS\n",
        "        return False\n",
        ("tests/test_autobucket.py",),
    ),
    Mutant(
        "quiet-step-dispatches-in-backward",
        "a deferred (quiet) iteration dispatches nothing in backward, also after a no_sync() exit",
        "megabuf/sync/grad_sync.py",
        "        return (require_sync or self.reduce_each) and not self.defer_dispatch\n",
        "        return require_sync or self.reduce_each\n",
        ("tests/test_grad_sync.py", "tests/test_autobucket.py"),
    ),
    Mutant(
        "quiet-step-counted-as-overlapped",
        "the quiet step's ready times are left out of the overlapped steps' medians",
        "megabuf/replan/warmup.py",
        "        for s in _steps(events)[skip_steps:]\n        if not s.quiet\n    ]\n",
        "        for s in _steps(events)[skip_steps:]\n    ]\n",
        ("tests/test_bucket_planner.py",),
    ),
    Mutant(
        "counted-arrivals-never-engaged",
        "after the first sync, groups of small params count their arrivals (no Python per grad)",
        "megabuf/core/engine.py",
        "            on_first_sync=weak_callable(self._count_arrivals),",
        "            on_first_sync=lambda: None,",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-ready-one-early",
        "a counted group is ready at its learned total of arrivals, not one before",
        "megabuf/buckets/arrivals.py",
        "                return self.total - 1\n",
        "                return max(1, self.total - 2)\n",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-own-grad-not-copied",
        "reconcile: a .grad that is a tensor of its own is copied into main_grad before dispatch",
        "megabuf/buckets/arrivals.py",
        "            main_grad.copy_(grad)\n            param.grad = main_grad\n",
        "            pass\n",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-bookkeeping-skipped",
        "a counted group's first arrival runs the backward's bookkeeping (arms the sync)",
        "megabuf/buckets/arrivals.py",
        "        if not self._in_backward[0]:\n            on_grad = self._on_grad()\n",
        "        if False:\n            on_grad = self._on_grad()\n",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-state-not-checked",
        "a counted arrival after the dispatch raises; after a sync it owes the sync again",
        "megabuf/buckets/arrivals.py",
        "        if not group.accepts_grads:\n",
        "        if False:\n",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-no-reset-when-synced",
        "a synced group's counter starts over, so the next backward's first arrival runs Python",
        "megabuf/buckets/bucket_group.py",
        "        self.grad_state = GradSyncState.SYNCED\n        self.readiness.counter.reset()",
        "        self.grad_state = GradSyncState.SYNCED\n        pass",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "counted-no-reset-on-no-sync-exit",
        "entering or leaving no_sync() starts the counters over (count, or pass a long run)",
        "megabuf/sync/grad_sync.py",
        "            if group.counted is not None:  # the next arrival decides afresh",
        "            if False:  # the next arrival decides afresh",
        ("tests/test_counted_arrivals.py",),
    ),
    Mutant(
        "dropped-gathers-not-waited",
        "a model dropped with param gathers in flight waits for them (gloo pairs stay usable)",
        "megabuf/buckets/param_gather.py",
        "        weakref.finalize(self.work, wait_dropped, pending, self.rank)\n",
        "        pass\n",
        ("tests/test_engine_lifetime.py",),
    ),
    Mutant(
        "reduce-at-end-without-min-gain",
        "reducing after backward is chosen only for a predicted gain of MIN_GAIN of the backward",
        "megabuf/pure/bucket_planner.py",
        "    return at_end_s <= overlapped_s - MIN_GAIN * backward_s\n",
        "    return at_end_s <= overlapped_s\n",
        ("tests/test_bucket_planner.py",),
    ),
    Mutant(
        "sparse-grads-summed-not-averaged",
        "a sparse grad is divided by dp_size before its all-reduce, as torch DDP",
        "megabuf/sync/sparse_grads.py",
        "                grad.div_(self.dp_size)\n",
        "                pass\n",
        ("tests/test_sparse_grads.py",),
    ),
    Mutant(
        "pickled-copy-groups-by-counter",
        "an unpickled copy builds its groups without a collective or a counted group name",
        "megabuf/core/pickling.py",
        "    groups = resolve_split(ProcessGroups.default_local(), config)\n",
        "    groups = resolve_split(ProcessGroups.default(), config)\n",
        ("tests/test_pickling.py",),
    ),
    Mutant(
        "join-divides-by-initial-size",
        "under Join with divide_by_initial_world_size=False grads average over the active ranks",
        "megabuf/sync/grad_sync.py",
        "        if self._rescale != 1.0:\n",
        "        if False:\n",
        ("tests/test_join.py",),
    ),
    Mutant(
        "join-buffers-from-dp-rank-0",
        "under Join module buffers come from the highest active rank, not a joined rank 0",
        "megabuf/core/join.py",
        "        return self.active[-1]\n",
        "        return 0\n",
        ("tests/test_join.py",),
    ),
    Mutant(
        "join-no-final-sync",
        "when every rank joined, every rank gets the last joiner's params",
        "megabuf/core/join.py",
        "                if not torch.equal(theirs, param):\n",
        "                if False:\n",
        ("tests/test_join.py",),
    ),
    Mutant(
        "verify-bucket-order-one-rank",
        "ranks dispatch bucket groups in chain order (verify names the ranks that differ)",
        "megabuf/buckets/dispatch.py",
        "        for group in self.groups[self.next_index :]:\n"
        "            if group.grad_state is GradSyncState.IDLE:\n",
        "        rest = self.groups[self.next_index :]\n"
        "        for group in rest[::-1] if self.groups[0].rank == 1 else rest:\n"
        "            if group.grad_state is GradSyncState.IDLE:\n",
        ("tests/test_verify.py",),
    ),
    Mutant(
        "verify-param-ulp-one-rank",
        "replicas hold bitwise equal params after a step (verify names the param and the ranks)",
        "megabuf/optimizer/base.py",
        "            write_back_all(self.main_params)\n",
        "            write_back_all(self.main_params)\n"
        "            if self.process_groups.topology.rank == 1:\n"
        "                self.model_params()[0].data.view(-1)[:1].view(torch.int32).add_(1)\n",
        ("tests/test_verify.py",),
    ),
    Mutant(
        "verify-expert-norm-left-out",
        "the global grad norm counts the expert grads (verify names the 'expert' set)",
        "megabuf/optimizer/base.py",
        "            grads = self._grads_of(domain, skip_shared) if domain is not None else []\n",
        "            grads = (\n"
        "                self._grads_of(domain, skip_shared)\n"
        '                if domain is not None and kind == "dense"\n'
        "                else []\n"
        "            )\n",
        ("tests/test_verify.py",),
    ),
    Mutant(
        "verify-size1-group-counted-twice",
        "a norm summed over a group of one rank counts that rank once (verify's fp64 norm differs)",
        "megabuf/optimizer/clip.py",
        "        if collectives.size(group) > 1:\n"
        "            collectives.all_reduce(value, group, async_op=False)\n",
        "        if collectives.size(group) > 1:\n"
        "            collectives.all_reduce(value, group, async_op=False)\n"
        "        else:\n"
        "            value.mul_(2.0)\n",
        ("tests/test_verify.py",),
    ),
    Mutant(
        "planner-activations-left-out",
        "memory planner: every candidate's device total includes the measured activations",
        "megabuf/planning/budget.py",
        '    device["activations"] = inputs.activation_nbytes\n',
        '    device["activations"] = 0\n',
        ("tests/test_budget_planner.py", "tests/test_budget_runs.py"),
    ),
    Mutant(
        "planner-margin-ignored",
        "memory planner: a candidate fits only within the budget less the stated margin",
        "megabuf/planning/budget.py",
        "    return math.floor(budget_nbytes * (1.0 - margin))\n",
        "    return budget_nbytes\n",
        ("tests/test_budget_planner.py",),
    ),
    Mutant(
        "planner-transient-bounds-left-out",
        "memory planner: transient bounds (grad buckets, landing zones, gathered units) count",
        "megabuf/planning/budget.py",
        "    device.update(bounds)\n",
        "    pass\n",
        ("tests/test_budget_runs.py",),
    ),
    Mutant(
        "planner-measurements-not-agreed",
        "memory planner: ranks plan from the MAX of their measurements, one decision everywhere",
        "megabuf/planning/budget_agree.py",
        "    agreed = agree_inputs(inputs, collectives, group, device)\n",
        "    agreed = inputs\n",
        ("tests/test_budget_runs.py",),
    ),
    Mutant(
        "fp8-scale-not-agreed",
        "FP8 scales come from the amax agreed over the dp group, not this rank's shard",
        "megabuf/fp8/agree.py",
        "        collectives.all_reduce_max(amax, group, op=AMAX_OP)\n",
        "        pass\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-per-tensor-all-reduce",
        "one amax all-reduce per step for all FP8 params together, not one per tensor",
        "megabuf/fp8/agree.py",
        "        collectives.all_reduce_max(amax, group, op=AMAX_OP)\n",
        "        for k in range(amax.numel()):\n"
        "            collectives.all_reduce_max(amax[k : k + 1], group, op=AMAX_OP)\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-cast-skipped-after-step",
        "after the step each rank casts its updated master shard into the FP8 bytes",
        "megabuf/fp8/shards.py",
        "            out.copy_(adapter.cast(self._hp(piece), self.scales[i], spec))\n",
        "            pass\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-gather-full-width",
        "FP8 params are stored and gathered as uint8 bytes, 1 byte per element",
        "megabuf/planning/plan.py",
        "        return torch.uint8, grad_dtype\n",
        "        return dtype, grad_dtype\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-checkpoint-not-recast",
        "after a checkpoint load the FP8 bytes are cast from the loaded masters",
        "megabuf/checkpoint/load.py",
        "        recast_fp8(chunks)  # [Note: FP8 params in checkpoints]\n",
        "        pass\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-checkpoint-masters-misplaced",
        "a checkpoint's FP8 entry is the full master put together from every rank's shard",
        "megabuf/fp8/masters.py",
        "            lo = bucket_offsets[b] + piece.buffer_start - starts[b]\n",
        "            lo = bucket_offsets[b] + piece.buffer_start\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-hybrid-agreed-over-replicas",
        "under hybrid sharding the FP8 amaxes are agreed over the shard group",
        "megabuf/optimizer/distributed.py",
        "        agree_and_cast_by_kind(parts, self.collectives, pgs.shard_group)\n",
        "        agree_and_cast_by_kind(\n"
        "            parts, self.collectives, lambda e: pgs.replicate_group() or pgs.dp\n"
        "        )\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-replan-not-reseeded",
        "the bucket_size='auto' rebuild casts the new FP8 buffers from the full masters",
        "megabuf/fp8/masters.py",
        "    fp8.seeds.update(gather_by_kind(parts, collectives, shard_group))\n",
        "    pass\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-offload-masters-dropped",
        "offload keeps the FP8 params' fp32 masters on the host and restores them bitwise",
        "megabuf/weights/offload.py",
        "        yield \"main_params\", masters, True  # FP8 params' fp32 masters (the buffer's)\n",
        '        yield "main_params", masters, False\n',
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-export-not-dequantized",
        "export_weights(fp8='dequantized') hands over bytes / scale, the value forward reads",
        "megabuf/fp8/export.py",
        "    hp = values.to(torch.float32) / scale\n",
        "    hp = values.to(torch.float32)\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-expert-agreed-over-dp",
        "expert FP8 weights' amaxes are agreed over the expert shard group, not the dense one",
        "megabuf/fp8/agree.py",
        "            agree_and_cast(mine, collectives, shard_group(expert))\n",
        "            agree_and_cast(mine, collectives, shard_group(False))\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(
        "fp8-scales-not-counted",
        "the memory formula counts each FP8 param's fp32 scale",
        "megabuf/sharding/formula.py",
        "    scales = FP32_NBYTES * len(buf.param_ids) if fp8 else 0\n",
        "    scales = 0\n",
        ("tests/test_fp8.py",),
    ),
    Mutant(  # issue 43: megabuf.ft
        "ft-divides-by-started-groups",
        "ft: the cross-replica sum is divided by the contributing groups, not the group count",
        "megabuf/ft/replicas.py",
        "        n = self.layout.contributors()\n",
        "        n = 3  # the groups the job started with\n",
        ("tests/test_ft.py",),
    ),
    Mutant(
        "ft-steps-without-should-commit",
        "ft: the optimizer steps only when manager.should_commit() says so",
        "megabuf/ft/gate.py",
        "        if not self.manager.should_commit():\n",
        "        if not (self.manager.should_commit() or True):\n",
        ("tests/test_ft.py",),
    ),
    Mutant(
        "ft-collective-crosses-groups",
        "ft: only the Manager crosses replica groups, never megabuf's collectives",
        "megabuf/ft/replicas.py",
        "_Averaged(self.manager.allreduce(s, reduce_op=ReduceOp.SUM), s, self.layout)",
        "_Averaged(collectives.all_reduce(s, self.manager._pg, async_op=True), s, self.layout)",
        ("tests/test_ft.py",),
    ),
    Mutant(
        "ft-heal-drops-optimizer-state",
        "ft: healing copies the inner optimizer state too",
        "megabuf/ft/state.py",
        "        inner.update({k: _placed(v, main) for k, v in received.items()})\n",
        "        pass\n",
        ("tests/test_ft.py",),
    ),
    Mutant(
        "ft-layout-fingerprint-unchecked",
        "ft: a layout that differs across groups is a named error before the step",
        "megabuf/ft/gate.py",
        "        self.layout.check(rank=self.model.engine.rank)\n",
        "",
        ("tests/test_ft.py",),
    ),
)

PYTEST = ("-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider")


def patched(mutant: Mutant, root: Path = REPO) -> str:
    """The text of `mutant.path` under `root` with the patch applied; raises unless the old text
    occurs exactly once (the list must follow the code)."""
    text = (root / mutant.path).read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise SystemExit(
            f"mutants: {mutant.name}: the old text occurs {count} times in {mutant.path} "
            f"(expected exactly once); update MUTANTS to match the code:\n{mutant.old}"
        )
    return text.replace(mutant.old, mutant.new)


def plant(mutant: Mutant, root: Path) -> None:
    """Copy megabuf/ under `root` and apply the patch there."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "megabuf", root / "megabuf", ignore=ignore)
    (root / mutant.path).write_text(patched(mutant, root))


def pytest_run(root: Path, args: list[str], timeout_s: float) -> tuple[str, str]:
    """(outcome, detail): outcome 'caught' (a test failed), 'passed', 'timeout' or 'error'."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        proc = subprocess.run(
            [sys.executable, *PYTEST, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return "timeout", f"no result within {timeout_s:.0f}s"
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    if proc.returncode == 0:
        return "passed", ""
    if proc.returncode == 1 and failed:
        return "caught", failed[0]
    return "error", f"pytest exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}"


def check_imports_copy(root: Path) -> None:
    """The runs must import the mutated copy, not the working tree's or an installed megabuf."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import megabuf; print(megabuf.__file__)"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=REPO, env=env, capture_output=True, text=True
    )
    if not out.stdout.strip().startswith(str(root)):
        raise SystemExit(f"mutants: tests would import {out.stdout.strip()!r}, not {root}")


def run_mutant(mutant: Mutant, quick: bool, timeout_s: float) -> tuple[str, str]:
    with tempfile.TemporaryDirectory(prefix=f"megabuf-mutant-{mutant.name}-") as tmp:
        root = Path(tmp)
        plant(mutant, root)
        check_imports_copy(root)
        outcome, detail = "passed", ""
        if mutant.tests:
            outcome, detail = pytest_run(root, list(mutant.tests), timeout_s)
        if outcome == "passed" and not quick:
            rest = [f"--ignore={t}" for t in mutant.tests]
            outcome, detail = pytest_run(root, ["tests", *rest], timeout_s)
    return ("survived" if outcome == "passed" else outcome), detail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="relevant test files only")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run these mutants")
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    opts = parser.parse_args()
    chosen = [m for m in MUTANTS if not opts.only or m.name in opts.only]
    unknown = set(opts.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"mutants: unknown names {sorted(unknown)}; see --list")
    for m in chosen:
        patched(m)  # every patch applies before anything runs
    if opts.list:
        for m in chosen:
            print(f"{m.name:30} {m.path:36} {m.rule}")
        return 0
    start, outcomes = time.monotonic(), {}
    for m in chosen:
        t0 = time.monotonic()
        outcome, detail = run_mutant(m, opts.quick, opts.timeout)
        outcomes[m.name] = outcome
        print(f"{outcome:9} {m.name:30} {time.monotonic() - t0:6.0f}s  {m.rule}", flush=True)
        if detail:
            print(f"          {detail}", flush=True)
    caught = sum(o in ("caught", "timeout") for o in outcomes.values())
    survived = [n for n, o in outcomes.items() if o == "survived"]
    errors = [n for n, o in outcomes.items() if o == "error"]
    print(
        f"{caught}/{len(outcomes)} caught ('timeout' counts: the suite did not pass), "
        f"survived: {survived or 'none'}, errors: {errors or 'none'}, "
        f"{time.monotonic() - start:.0f}s{' (--quick)' if opts.quick else ''}"
    )
    return 1 if survived or errors else 0


if __name__ == "__main__":
    sys.exit(main())
