"""Sharding strategies on megabuf's buffers (ZeRO-1/2/3): see [Note: sharding strategies].

[Note: sharding strategies]
`DistributedDataParallelConfig.data_parallel_sharding_strategy` says what one dp rank keeps of
each bucket beyond its shard of the fp32 main params and optimizer state:

    no_shard            full params, full grads (all-reduce)            torch DDP
    optim               full params, full grads, reduce-scatter         ZeRO-1 (the distributed
                        into this rank's shard, all-gather of params    optimizer)
    optim_grads         full params; the full grad bucket exists only   ZeRO-2
                        while it accumulates and reduces, the reduced
                        grad shard persists
    optim_grads_params  the param shard persists; a unit's full params  ZeRO-3 / FSDP
                        exist only around its forward and backward

Every strategy uses the same layout (megabuf/pure/layout.py, padded so each bucket splits into dp
equal shards), the same bucket groups and the same reduce-scatter, so at one micro-batch the
sharded strategies are bitwise equal to "optim". What changes is which storages are released
(resized to 0, views kept) and when; `MemoryLedger` records every such allocation so
`memory_report()` can state persistent bytes and transient high-water marks exactly.
ZeRO-3's param side: [Note: sharded param lifecycle] (params.py), [Note: who gathers when]
(units_runtime.py) and [Note: stray reads] (read_guard.py); frozen params are not in the
buffers and stay replicated (whole on every rank) under every strategy.
"""

from megabuf.sharding.ledger import MemoryLedger

__all__ = ["MemoryLedger"]
