"""The top level exports what a training script calls; everything else stays importable from its
module (pure: no process group)."""

from __future__ import annotations

import importlib

import megabuf

PUBLIC = {
    "DistributedDataParallel",
    "DistributedDataParallelConfig",
    "DistributedOptimizer",
    "FP32Optimizer",
    "MegabufOptimizer",
    "MixedPrecisionOptimizer",
    "OptimizerConfig",
    "ProcessGroups",
    "build_optimizer",
    "default_schedule_hooks",
    "finalize_model_grads",
    "full_state_dict",
    "get_forward_backward_func",
    "init_distributed",
    "load_checkpoint",
    "mark_expert_parallel",
    "save_checkpoint",
    "verify_reproducible",
    "wrap_model_chunks",
}

INTERNALS = {
    "megabuf.bucket_group": ["BucketGroup", "DispatchChain", "GradSyncState", "ParamSyncState"],
    "megabuf.buffer": ["_ParamAndGradBuffer", "_ParamAndGradBucket"],
    "megabuf.checkpoint": [
        "consolidated_comm_hook_state",
        "consolidated_model_state",
        "consolidated_optimizer_state",
    ],
    "megabuf.collectives": ["Collectives", "CommStats"],
    "megabuf.finalize": ["check_scaling_invariant"],
    "megabuf.layout": ["BufferLayout", "compute_layout", "shard_pieces"],
    "megabuf.optimizer": ["ConstantGradScaler", "DynamicGradScaler", "StepResult"],
    "megabuf.pipeline": ["ScheduleHooks", "forward_backward_no_pipelining"],
    "megabuf.plan": ["Plan", "build_plan"],
    "megabuf.replicas": ["is_expert_parallel"],
    "megabuf.reproducible": ["ReproducibilityError", "ReproducibilityReport", "VariantResult"],
}


def test_top_level_is_the_training_script_surface() -> None:
    assert set(megabuf.__all__) == PUBLIC
    assert all(callable(getattr(megabuf, name)) for name in PUBLIC)
    exported = {n for n in dir(megabuf) if not n.startswith("_") and n[0].isupper()}
    assert exported <= PUBLIC, exported - PUBLIC  # no class leaks in by accident


def test_internals_importable_from_their_modules() -> None:
    for module, names in INTERNALS.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, (module, missing)
