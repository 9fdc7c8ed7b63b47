"""Splitting `megabuf.testing.GPT` into pipeline stages (for tests and examples).

`split_gpt(gpt, num_stages)` returns `num_stages` modules: the first holds the token and position
embeddings, each holds a contiguous run of blocks (named by their index in the whole model, so a
stage's param names are the whole model's), the last holds the final LayerNorm and the LM head.
With tied embeddings and more than one stage, the last stage gets its own copy of the embedding
matrix as `lm_head.weight`; both copies are marked `shared_embedding=True` so megabuf gives each a
bucket of its own and `finalize_model_grads` sums their grads over the `embd` group, which keeps
the copies identical (Megatron's scheme). On one stage the tie stays one Parameter.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from megabuf.testing.models import GPT


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: tokens [B, T] (first stage) or activations [B, T, d_model]
    (via `set_input_tensor`) -> activations, or logits [B, T, vocab] on the last stage."""

    def __init__(self, gpt: GPT, first_block: int, end_block: int, *, pre: bool, post: bool):
        super().__init__()
        whole = copy.deepcopy(gpt)  # one deepcopy keeps a tie a single Parameter
        self.pre_process, self.post_process = pre, post
        self.tok_emb = whole.tok_emb if pre else None
        self.pos_emb = whole.pos_emb if pre else None
        mine = range(first_block, end_block)
        self.blocks = nn.ModuleDict({str(i): whole.blocks[i] for i in mine})
        self.ln_f = whole.ln_f if post else None
        self.lm_head = whole.lm_head if post else None
        self.input_tensor: Tensor | None = None
        if gpt.config.tie_embeddings and pre != post:
            owner = self.tok_emb if pre else self.lm_head
            owner.weight.shared_embedding = True  # type: ignore[union-attr]

    def set_input_tensor(self, tensor: Tensor | None) -> None:
        self.input_tensor = tensor

    def forward(self, tokens: Tensor | None = None) -> Tensor:
        if self.pre_process:
            if tokens is None or self.tok_emb is None or self.pos_emb is None:
                raise ValueError("megabuf.testing: the first GPTStage needs tokens")
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_emb(tokens) + self.pos_emb(pos)
        else:
            if self.input_tensor is None:
                raise ValueError("megabuf.testing: call set_input_tensor() on later GPTStages")
            h = self.input_tensor
        for block in self.blocks.values():
            h = block(h)
        if self.post_process and self.ln_f is not None and self.lm_head is not None:
            return self.lm_head(self.ln_f(h))  # type: ignore[no-any-return]
        return h


def split_gpt(gpt: GPT, num_stages: int) -> list[GPTStage]:
    """Cut `gpt` into `num_stages` stages with blocks spread as evenly as possible (earlier
    stages get the extra blocks)."""
    n = len(gpt.blocks)
    if not num_stages >= 1:
        raise ValueError(f"megabuf.testing: num_stages must be >= 1, got {num_stages}")
    bounds = [i * n // num_stages for i in range(num_stages + 1)]
    return [
        GPTStage(gpt, bounds[s], bounds[s + 1], pre=s == 0, post=s == num_stages - 1)
        for s in range(num_stages)
    ]


def stage_index(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Which of `split_gpt`'s stages pipeline rank `pp_rank` holds as model chunk `chunk`."""
    return chunk * pp_size + pp_rank
