"""The torch DDP tests the conformance tier runs, by id (`suite.Class.test_name`, suite.py).

How they were chosen (discover.py; rerun with `python -m tests.conformance --discover`), on torch
2.13.0's wheel, gloo, CPU, world size 2:
- candidates: the 103 of `DistributedTest._DistTestBase`'s 285 tests that name
  `DistributedDataParallel` (or call `DDP(`) in their body or in a `self._helper` they call, and
  the 8 tests of ddp_under_dist_autograd_test.py's CPU classes (111 in all);
- each ran once on torch DDP, bound so that a rank leaves a marker when it constructs one:
  92 skipped here (71 "Need at least 2 CUDA devices", 10 "CUDA is not available", 2 need 4
  GPUs, 9 disabled upstream with an issue link or as flaky); 19 ran and passed, and 18 of them
  built a DDP (`test_backward_no_ddp`, the rpc suite's no-DDP baseline, builds none).
- Running all 285 tests of `_DistTestBase` the same way found no other test that builds a DDP
  and is not skipped here, so the source filter misses none.
The rpc tests run at the sizes their classes fix: DdpComparisonTest 4 trainers,
DdpUnderDistAutogradTest 4 trainers + a remote worker + a master (6 ranks).
"""

from __future__ import annotations

SELECTED: tuple[str, ...] = (
    # gloo, CPU, world size 2: DistributedTest._DistTestBase (distributed_test.py)
    "dist.DistributedTest.test_DistributedDataParallelCPU",
    "dist.DistributedTest.test_DistributedDataParallelCPU_grad_is_view",
    "dist.DistributedTest.test_DistributedDataParallel_requires_grad",
    "dist.DistributedTest.test_accumulate_gradients_no_sync",
    "dist.DistributedTest.test_accumulate_gradients_no_sync_allreduce_hook",
    "dist.DistributedTest.test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "dist.DistributedTest.test_accumulate_gradients_no_sync_grad_is_view",
    "dist.DistributedTest.test_ddp_create_graph",
    "dist.DistributedTest.test_ddp_logging_data_cpu",
    "dist.DistributedTest.test_grads_same_across_ranks_with_no_sync",
    "dist.DistributedTest.test_static_graph_api_cpu",
    # RPC + distributed autograd (ddp_under_dist_autograd_test.py), TensorPipe agent
    "rpc.DdpComparisonTest.test_ddp_comparison",
    "rpc.DdpComparisonTest.test_ddp_comparison_uneven_inputs",
    "rpc.DdpComparisonTest.test_ddp_dist_autograd_sparse_grads",
    "rpc.DdpComparisonTest.test_ddp_dist_autograd_local_vs_remote",
    "rpc.DdpUnderDistAutogradTest.test_backward_ddp_outside",
    "rpc.DdpUnderDistAutogradTest.test_backward_ddp_outside_uneven_inputs",
    "rpc.DdpUnderDistAutogradTest.test_backward_ddp_inside",
)
