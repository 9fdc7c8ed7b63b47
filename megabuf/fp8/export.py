"""FP8 params in `export_weights`: the user's choice of FP8 bytes with scales, or dequantized.

[Note: FP8 params in export_weights]
`export_weights(..., fp8=...)` chooses what an FP8 param becomes in an exported bucket:
- "dequantized" (the default): one tensor under the param's name, `bytes / scale` in fp32 (the
  value forward computes with), then in `dtype` (e.g. bf16), or the weight's dtype if none.
- "bytes": the float8 tensor (its bytes, `float8_e4m3fn`) under the param's name and its fp32
  scale (0-d) under `<name>_scale`; the value is `bytes.float() / scale`. `dtype` does not
  apply to them (a cast would undo the quantisation).
The export reads the bytes, never the master: what it hands over is what forward used.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from megabuf.fp8.adapter import adapter_for, is_converted_fp8

Fp8Export = Literal["dequantized", "bytes"]
FP8_EXPORTS: tuple[str, ...] = ("dequantized", "bytes")
SCALE_SUFFIX = "_scale"


def check_fp8_export(fp8: str) -> None:
    if fp8 not in FP8_EXPORTS:
        raise ValueError(
            f"megabuf: export_weights(fp8={fp8!r}) must be one of {FP8_EXPORTS} ([Note: FP8 "
            "params in export_weights])"
        )


def export_view(param: Tensor) -> Tensor:
    """What the export reads of a param: an FP8 param's bytes (uint8, param-shaped, viewing
    its buffer), else the param itself (detached)."""
    adapter = adapter_for(param) if is_converted_fp8(param) else None
    if adapter is None:
        return param.detach()
    return adapter.parts(param)[0].view(torch.uint8)


def fp8_exported(
    param: Tensor, name: str, data: Tensor, fp8: Fp8Export, dtype: torch.dtype | None
) -> list[tuple[str, Tensor]]:
    """An FP8 param's exported (name, tensor) pairs from its bytes `data` (uint8, param-shaped;
    the model's or a gathered copy): [Note: FP8 params in export_weights]."""
    adapter = adapter_for(param)
    if adapter is None:
        raise RuntimeError(f"megabuf: {name!r} is not an FP8 param (an export bug)")
    raw, scale = adapter.parts(param)
    values = data.view(raw.dtype)
    if fp8 == "bytes":
        return [(name, values), (name + SCALE_SUFFIX, scale.detach().clone())]
    hp = values.to(torch.float32) / scale
    return [(name, hp.to(dtype if dtype is not None else param.dtype))]
