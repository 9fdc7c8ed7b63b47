"""FP8 params: a param kind of the engine (issue 42; docs/fp8.md).

[Note: FP8 params]
A float8 training weight of a library the engine has an adapter for (torchao's
`WeightWithDynamicFloat8CastTensor`, installed by `convert_to_float8_training(model,
config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))`) is an FP8 param:
- Detection and refusals (`convert.py`, at construction, before planning): only tensorwise
  dynamic scaling is supported; rowwise, rowwise_with_gw_hp, non-dynamic weight scaling, MX block
  scales and Transformer Engine weights are refused by name. Under
  `no_shard` there is no master copy: the weights stay as torchao made them (high precision,
  cast in forward by torchao), exactly what torch DDP does with the same model.
- Storage: under the sharded strategies each FP8 weight is swapped for an `nn.Parameter` of the
  library's float8 tensor (torchao's `Float8TrainingTensor`) whose bytes view a uint8 param
  buffer (the planner's dtype key is (uint8, grad dtype): FP8 params share buffers only with FP8
  params, and bucket groups with any) and whose scale views one element of the buffer's fp32
  `scales` (`Fp8BufferPart`). Forward reads that tensor: torchao sees a weight already cast and
  does not cast again. Grads stay high precision: the grad buffer has the weight's dtype (fp32
  with grad_reduce_in_fp32).
- Master: the buffer's `Fp8BufferPart.masters`, this rank's shard of every bucket in fp32, is what
  the distributed optimizer steps in place (its main params view it).
- After each step (`agree_and_cast_by_kind`, called by the distributed optimizer before the
  param gathers are dispatched): each rank takes its shard's amax per FP8 param (of the master
  rounded to the weight's dtype), ONE all-reduce(MAX) of all of them over the group the buffers
  are sharded over (expert-parallel FP8 params, in expert buffers: one more over the expert
  shard group), the scales by torchao's own `amax_to_scale`, and the cast of its shard by
  torchao's own `hp_tensor_and_scale_to_float8` into the uint8 buffer. Under hybrid sharding
  that group is the shard group, not the whole dp group: the replicas of a shard step the same
  reduced grads (all-reduced across replicas) from the same master, so they hold equal masters
  and agree on the same amaxes without the cross-replica traffic. Every rank then holds the
  same scales, and the param all-gather (after the step, or per unit in forward under
  optim_grads_params) moves 1 byte per element. The max of the shards' amaxes is the amax of
  the full weight, and the cast is elementwise: the gathered weight is bitwise the cast torchao
  would make of the full master.
- At construction each rank casts the full seed (dp rank 0's value when init_sync; an expert
  weight's: expt_dp rank 0's) with the scale of the full weight: the same on every rank without
  a collective.
- Checkpoints, the bucket_size="auto" rebuild: [Note: FP8 params in checkpoints] (masters.py);
  export_weights: [Note: FP8 params in export_weights] (export.py); offload: the bytes, scales
  and masters are stashed like any storage ([Note: what offload releases]).
"""

import torch

from megabuf.fp8.adapter import (
    adapter_for,
    broadcast_tensors,
    is_converted_fp8,
    is_fp8_param,
)
from megabuf.fp8.agree import AMAX_OP, agree_and_cast
from megabuf.fp8.convert import Fp8Params, convert_fp8_params, refuse_fp8_params
from megabuf.fp8.shards import Fp8BufferPart
from megabuf.fp8.spec import Fp8Adapter, Fp8Spec


def param_dtype_label(dtype: torch.dtype) -> str:
    """How reports name a buffer's param dtype: a uint8 buffer holds FP8 params."""
    name = str(dtype).removeprefix("torch.")
    return "fp8 (uint8 bytes + an fp32 scale each)" if name == "uint8" else name


__all__ = [
    "AMAX_OP",
    "Fp8Adapter",
    "Fp8BufferPart",
    "Fp8Params",
    "Fp8Spec",
    "adapter_for",
    "agree_and_cast",
    "broadcast_tensors",
    "convert_fp8_params",
    "is_converted_fp8",
    "is_fp8_param",
    "param_dtype_label",
    "refuse_fp8_params",
]
