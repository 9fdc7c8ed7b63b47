"""`Fp8BufferPart`: what a uint8 param buffer holds for its FP8 params ([Note: FP8 params]).

One fp32 scale per FP8 param (`scales`, which each param's scale views), the fp32 master of this
rank's shard of every bucket (what the distributed optimizer steps in place), this rank's amax
per param, and the cast of its shard into the buffer's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from megabuf.fp8.convert import Fp8Params
from megabuf.pure.layout import BufferLayout, ShardPiece, shard_pieces


class Fp8BufferPart:
    """The FP8 side of one uint8 param buffer; `shard_bytes(start, end)` is the buffer's view of
    this rank's persistent param bytes for buffer range [start, end)."""

    def __init__(
        self,
        fp8: Fp8Params,
        params: Sequence[nn.Parameter],  # the buffer's params, registration order
        layout: BufferLayout,
        shard_bytes: Callable[[int, int], Tensor],
        *,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
    ) -> None:
        self.fp8 = fp8
        self.params = list(params)
        self.specs = [fp8.specs[p] for p in self.params]
        self.adapters = [fp8.adapters[p] for p in self.params]
        self.shard_bytes = shard_bytes
        # an expert buffer's: sharded over (and its amaxes agreed over) the expert shard group
        self.expert = any(getattr(p, "allreduce", True) is False for p in self.params)
        self.scales = torch.ones(len(self.params), dtype=torch.float32, device=device)  # 1-D
        self.layout, self.dp_size = layout, dp_size
        self.pieces = shard_pieces(layout, dp_rank, dp_size)
        # this rank's shard of each bucket, 1-D, fp32, padded numel / dp: the master copy
        self.masters = [
            torch.zeros(b.numel // dp_size, dtype=torch.float32, device=device)
            for b in layout.buckets
        ]
        self._shard_start = [b.shard_range(dp_rank, dp_size)[0] for b in layout.buckets]

    @property
    def numel(self) -> int:
        return len(self.params)

    @property
    def nbytes(self) -> int:
        """Persistent bytes besides the param bytes: the scales (the masters are the
        optimizer's, counted as its main params)."""
        return self.scales.numel() * self.scales.element_size()

    def place(self, index: int, home: Tensor) -> None:
        """Cast param `index`'s seed into `home` (1-D uint8, its slot) with the scale of the
        whole seed (every rank holds the same seed: the agreed scale), and point the param at
        it."""
        param, spec, adapter = self.params[index], self.specs[index], self.adapters[index]
        seed = self.fp8.seed(param)
        with torch.no_grad():
            self.scales[index] = adapter.scale(seed.abs().max().to(torch.float32), spec)
            data = home.view(spec.fp8_dtype).view(param.shape)
            data.copy_(adapter.cast(seed, self.scales[index], spec))
        adapter.repoint(param, data, self.scales[index])

    def seed_masters(self) -> None:
        """Fill this rank's masters from the seeds (after every `place`)."""
        for piece in self.pieces:
            seed = self.fp8.seed(self.params[piece.param_id]).reshape(-1)
            self.master_view_of(piece).copy_(seed[piece.param_start : piece.param_end])

    def master_view_of(self, piece: ShardPiece) -> Tensor:
        """The fp32 master of one piece of this rank's shard (1-D)."""
        lo = piece.buffer_start - self._shard_start[piece.bucket_id]
        return self.masters[piece.bucket_id][lo : lo + piece.numel]

    def master_view(self, start: int, end: int) -> Tensor:
        """The fp32 master of buffer range [start, end) inside this rank's shard of a bucket."""
        for bucket_id, lo in enumerate(self._shard_start):
            hi = lo + self.masters[bucket_id].numel()
            if lo <= start <= end <= hi:
                return self.masters[bucket_id][start - lo : end - lo]
        raise ValueError(
            f"megabuf: buffer range [{start}, {end}) is outside this rank's FP8 master shards"
        )

    def _hp(self, piece: ShardPiece) -> Tensor:
        """The master of a piece rounded to its param's dtype: what torchao would cast."""
        spec = self.specs[piece.param_id]
        return self.master_view_of(piece).to(spec.hp_dtype)

    def amaxes(self) -> Tensor:
        """1-D fp32, one per FP8 param: max |value| over this rank's shard (0 if none)."""
        amax = torch.zeros(len(self.params), dtype=torch.float32, device=self.scales.device)
        for piece in self.pieces:
            local = self._hp(piece).abs().max().to(torch.float32)
            amax[piece.param_id] = torch.maximum(amax[piece.param_id], local)
        return amax

    def cast(self, agreed_amax: Tensor) -> None:
        """Scales from the agreed amaxes (the library's rule), then this rank's shard cast into
        the buffer's bytes ([Note: FP8 params])."""
        for i, (spec, adapter) in enumerate(zip(self.specs, self.adapters, strict=True)):
            self.scales[i] = adapter.scale(agreed_amax[i], spec)
        for piece in self.pieces:
            i = piece.param_id
            spec, adapter = self.specs[i], self.adapters[i]
            start = piece.buffer_start
            out = self.shard_bytes(start, start + piece.numel).view(spec.fp8_dtype)
            out.copy_(adapter.cast(self._hp(piece), self.scales[i], spec))
