"""Pipeline schedules (no pipelining, 1F1B, interleaved 1F1B) driving megabuf's data parallelism
through Megatron's hooks; see schedules.py, order.py, p2p.py, hooks.py and chunks.py."""

from megabuf.pipeline.chunks import set_input_tensor, single_bucket_group, unwrap, wrap_model_chunks
from megabuf.pipeline.hooks import GradSyncSwitch, ScheduleHooks, default_schedule_hooks
from megabuf.pipeline.order import (
    Action,
    P2PStep,
    Transfer,
    interleaved_order,
    one_f_one_b_order,
    p2p_steps,
    simulate_pipeline,
)
from megabuf.pipeline.p2p import PipelineP2P
from megabuf.pipeline.schedules import (
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)

__all__ = [
    "Action",
    "GradSyncSwitch",
    "P2PStep",
    "PipelineP2P",
    "ScheduleHooks",
    "Transfer",
    "default_schedule_hooks",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "interleaved_order",
    "one_f_one_b_order",
    "p2p_steps",
    "set_input_tensor",
    "simulate_pipeline",
    "single_bucket_group",
    "unwrap",
    "wrap_model_chunks",
]
