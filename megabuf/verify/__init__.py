"""The verify mode: run-time self-checks that name the first diverging rank.

[Note: verify mode]
`DistributedDataParallelConfig.verify` ("off", "collectives", "replicas", "norms", "all";
megabuf/pure/verify_levels.py) turns on checks that the engine can make of itself because it
knows every collective it issues, every param's owners and every group. Each raises the same
`VerifyError` on every rank of the group it checks, naming the first differing collective, param
or ownership set and the ranks on each side, in bounded time (no check can itself hang: each
exchange is one fixed-size all-gather that every rank of the group issues at the same point).
- collectives (fingerprint.py): every collective of the engine's `Collectives` (op, group,
  bytes, and the bucket group it is for) is folded into a running CRC per group and kept in a
  short log ([Note: collective observers]). Before a bucket group's reduction is issued, the
  ranks of its group agree on (bucket group id, grad dtype, numel) -- that order is fixed by
  construction ([Note: dispatch order]), so a rank that would issue another bucket is named
  before the mismatched collective can pair wrong buffers or hang. At every grad sync (the
  engine's sync checks) the ranks of each reducing group (dp_shard, dp_replicate, dp, expt_dp)
  all-gather (count, CRC); on a mismatch they all-gather the logs and name the first differing
  entry. Collectives whose sizes legitimately differ between ranks (all-to-all, p2p, pickled
  objects, sparse) are fingerprinted by op only.
- replicas (replicas.py): at every grad sync, a position-weighted integer digest of every
  param's bits (and, under no_shard, of every synced grad) is all-gathered over the group whose
  ranks must hold equal copies (dp for dense params, expt_dp for expert params; dp covers the
  hybrid replicate group); the first param whose digests differ is named with the ranks
  holding each value. One ulp on one rank changes the digest. Off while a comm hook of the
  user's is registered (local SGD lets replicas drift by design).
- norms (norms.py): after the optimizer's grad norm, every rank's owned pieces (param range,
  fp64 sum of squares of its grad) are all-gathered over dp, then pp; identical ranges are one
  piece (replicas), the ranges of every param must tile it exactly (a gap: left out of the norm;
  an overlap: counted twice), tied embeddings count on the first stage. The fp64 norm over
  those sets must equal the optimizer's within NORM_RTOL, else the kind (dense / expert) whose
  part differs is named.
The spike guards (spikes.py: `check_for_large_grads`, `grad_norm_skip_threshold`) are
independent of the level; their decision is agreed over pp and dp (a MAX all-reduce) so every
rank that steps skips or raises alike.
"""

from megabuf.verify.errors import VerifyError

__all__ = ["VerifyError"]
