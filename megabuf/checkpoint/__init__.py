"""Checkpoints in model space: one file per rank plus an index, verified, crash-safe, loadable
at another data-parallel size, bucket size or optimizer kind; export to one plain state_dict.

[Note: checkpoint layout]
    <path>/metadata.json   index, with its own checksum: per file its writer rank, size and
                           SHA-256, which model entries and optimizer params it holds; the
                           world size and the pipeline / expert-parallel sizes at save
    <path>/common.pt       rank-independent optimizer state (class, param groups, loss scale)
    <path>/extra.pt        the `extra=` object given to save_checkpoint (only if one was given)
    <path>/rank00000.pt    {"model": {key: tensor}, "optimizer": [pieces]} for each global rank
Model entries (params, frozen params, module buffers) are written once per replica set: dense
entries by dp rank 0 of each pipeline stage, expert entries by expt_dp rank 0. Optimizer pieces
are ranges of flattened params (see [Note: model-space optimizer state]; a plain torch
optimizer's are whole params, see [Note: torch optimizer state in checkpoints]), so any dp size
and any bucket layout can load them: each rank assembles exactly the ranges it owns. Keys carry
the pipeline stage / ep rank when those are > 1 (see `model_space_keys`), so pp and ep sizes must
match between save and load (a mismatch raises naming both). Saving and loading are crash-safe
and verified: [Note: checkpoint crash safety] in `files.py`.

Saving RNG states (or any other state of the training script) with the checkpoint::

    extra = {"step": step, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
    megabuf.save_checkpoint(path, model, opt, extra=extra)  # rank 0's `extra` is kept
    ...
    extra = megabuf.load_checkpoint(path, model, opt)
    torch.set_rng_state(extra["torch_rng"]); random.setstate(extra["python_rng"])

(add `torch.cuda.get_rng_state()` on GPUs; for state that differs per rank, all-gather it into
rank 0's `extra` first, e.g. a list indexed by rank.)
"""

from megabuf.checkpoint.export import full_state_dict
from megabuf.checkpoint.files import FORMAT, find_checkpoint
from megabuf.checkpoint.load import load_checkpoint
from megabuf.checkpoint.offline import consolidated_model_state, consolidated_optimizer_state
from megabuf.checkpoint.save import save_checkpoint

__all__ = [
    "FORMAT",
    "consolidated_model_state",
    "consolidated_optimizer_state",
    "find_checkpoint",
    "full_state_dict",
    "load_checkpoint",
    "save_checkpoint",
]
