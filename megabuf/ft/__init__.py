"""Per-step fault tolerance through torchft (the optional extra `megabuf[ft]`).

[Note: fault-tolerant replicas]
One replica group is one megabuf model of any strategy, built on a torch.distributed world that
holds only the group's ranks (each group its own store and world, as torchft expects): every
collective megabuf issues stays inside the group by construction. Across groups there is only
torchft's `Manager`:
- the reduction's cross-replica level ([Note: cross-replica level] in
  megabuf/transport/cross_replica.py) is `ManagerReplicas`: each bucket group's reduced shard
  (the whole bucket under no_shard) is all-reduced with `manager.allreduce`, asynchronously, in
  dispatch-chain order as the hybrid second level is ([Note: two-level reduction]), a sum
  divided by the number of groups that contributed to it (counted by the step's first
  all-reduce, [Note: layout fingerprint]: `manager.num_participants()` except at step 0, where
  torchft counts the groups healing there although they contribute zeros); the first level
  already averaged inside the group, so the result is the mean over every live group's ranks;
- `FaultTolerantOptimizer.step()` steps only if `manager.should_commit()` (on every rank of
  the group) says every reduction of the group succeeded; a voted-down step calls nothing on
  the optimizer, so params, main params, optimizer state and loss scaler stay as they were;
- the bucket layout is compared across groups at each step's first Manager all-reduce
  ([Note: layout fingerprint]);
- a restarted or lagging group heals from a healthy one through the Manager's checkpoint
  transport, rank i from rank i ([Note: replica state for healing]).
What used to span the whole dp group, and what it does now (each stays inside the group, or
crosses through the Manager):
- the construction broadcast of params: inside the group; across groups torchft's init_sync
  heals every group from one at step 0, through the Manager;
- the NaN check's agreement (`check_for_nan_in_grad`): refused under ft (it would make one group
  raise alone); non-finite grads are caught after the cross-replica average, on the same
  values in every group (grad-norm skip, loss scaler), so all groups skip alike;
- micro-batch agreement: inside the group (the Manager all-reduce runs once per step, for the
  final micro-batch, whatever each group's micro-batch count);
- the auto bucket re-plan's agreement: inside the group; a layout that differs across groups
  is caught by the fingerprint and raised by name;
- checkpoint coordination (save / load): inside the group (each group saves its own; one
  group's checkpoint is the job's);
- grad-norm and found-inf reductions (clipping, loss scaling): inside the group, on the
  averaged grads, identical in every group;
- param all-gathers, ZeRO-3 unit gathers, reduce-scatters: inside the group.
Comm hooks are refused (their state would change on a voted-down step). A lost rank inside a
group loses that whole group until it restarts and heals; the lighthouse is a single point of
failure. `import megabuf` does not import this package; torchft itself is imported by the
caller who makes the Manager (`require_torchft` names the extra when it is missing).
"""

from megabuf.ft.fingerprint import LayoutMismatchError, layout_fingerprint
from megabuf.ft.gate import FaultTolerantOptimizer, replica_groups, require_torchft, wrap
from megabuf.ft.replicas import ManagerReplicas
from megabuf.ft.state import load_replica_state, replica_state

__all__ = [
    "FaultTolerantOptimizer",
    "LayoutMismatchError",
    "ManagerReplicas",
    "layout_fingerprint",
    "load_replica_state",
    "replica_groups",
    "replica_state",
    "require_torchft",
    "wrap",
]
