"""Checkpoints in model space on torch.distributed.checkpoint: verified, crash-safe, optionally
asynchronous, loadable at another data-parallel size, bucket size or optimizer sharding; export
to one plain state_dict.

[Note: checkpoint layout]
A checkpoint is a torch.distributed.checkpoint (DCP) directory plus megabuf's index:
    <path>/.metadata        DCP's metadata (written by rank 0)
    <path>/__<r>_0.distcp   what global rank r owns ([Note: checkpoint state in DCP])
    <path>/common.pt        rank-independent optimizer state (class, param groups, loss scale)
    <path>/common-pp<p>-ep<e>.pt  a plain torch optimizer's param groups of the other pipeline
                            stages / ep ranks ([Note: torch optimizer state in checkpoints])
    <path>/extra.pt         the `extra=` object given to save_checkpoint (only if one was given)
    <path>/metadata.json    megabuf's index, written last, with a checksum of its own: every
                            file's writer rank, size and SHA-256; the model entries (shape,
                            dtype) and optimizer params (numel, shape); world, pp and ep sizes;
                            the comm hooks' state index ([Note: comm hook state in
                            checkpoints] in hook_state.py; the tensors are in the DCP files)
Model entries (params, frozen params, module buffers) are written once per replica set: dense
entries by dp rank 0 of each pipeline stage, expert entries by expt_dp rank 0. Optimizer state
is keyed by param and stored as chunks of each flattened param (a plain torch optimizer's as
whole params: [Note: torch optimizer state in checkpoints]), so any dp size, bucket layout and
optimizer sharding can load it: DCP reads into each rank exactly the ranges it steps. Keys carry
the pipeline stage / ep rank when those are > 1 (see `model_space_keys`), so pp and ep sizes must
match between save and load (a mismatch raises naming both). Saving and loading are crash-safe
and verified: [Note: checkpoint crash safety] in `files.py`; asynchronous saves: [Note:
asynchronous checkpoint saves] in `save.py`. `torch.distributed.checkpoint.format_utils.
dcp_to_torch_save(path, "model.pt")` turns a checkpoint into one plain file whose "model" entry is
the model's state_dict (pp = ep = 1) and whose "optimizer" entry holds each param's flat state.

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
from megabuf.checkpoint.offline import (
    consolidated_comm_hook_state,
    consolidated_model_state,
    consolidated_optimizer_state,
)
from megabuf.checkpoint.save import SaveHandle, save_checkpoint, wait_for_pending_save

__all__ = [
    "FORMAT",
    "SaveHandle",
    "consolidated_comm_hook_state",
    "consolidated_model_state",
    "consolidated_optimizer_state",
    "find_checkpoint",
    "full_state_dict",
    "load_checkpoint",
    "save_checkpoint",
    "wait_for_pending_save",
]
