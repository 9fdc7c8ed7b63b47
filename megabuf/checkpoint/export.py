"""`full_state_dict`: the model as one plain state_dict, for torch and Hugging Face tooling."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from megabuf.checkpoint.files import write_file
from megabuf.checkpoint.model_state import owned_model_state, parallel_sizes
from megabuf.checkpoint.save import Chunks
from megabuf.optimizer.param_groups import as_chunks
from megabuf.transport.collectives import Collectives


def full_state_dict(
    model: Chunks, path: str | os.PathLike[str] | None = None
) -> dict[str, Tensor] | None:
    """Collective: every rank calls it. Rank 0 gets the whole model's state_dict (params as
    published after the last step, module buffers; plain tensors, copies), None elsewhere; with
    `path`, rank 0 also writes it there with `torch.save` (atomically: `<path>.partial`, then a
    rename), loadable with `torch.load(path)`.

    Keys: with one model chunk at pp = ep = 1 they are the wrapped module's own state_dict names
    (no wrapper prefix): `my_module.load_state_dict(full_state_dict(model))` works. Otherwise
    they are the checkpoint keys: `stage<i>/` for pp > 1, `chunk<j>/` for several chunks,
    `ep<r>/` before expert entries for ep > 1 (what each rank holds is gathered to rank 0
    through all_gather_object, so every rank briefly holds the whole model in that case)."""
    with torch.profiler.record_function("megabuf::full_state_dict"):
        chunks = as_chunks(model)
        owned = owned_model_state(chunks)  # publishes params; rank 0 owns all at pp = ep = 1
        sizes = parallel_sizes(chunks)
        if sizes["pp_size"] > 1 or sizes["ep_size"] > 1:
            everyone = chunks[0].engine.collectives.all_gather_object(owned, None)
            owned = {k: v for part in everyone for k, v in part.items()}
        if Collectives.rank() != 0:
            return None
        if path is not None:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file(owned, target, 0)
        return owned
