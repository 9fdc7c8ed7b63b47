"""Sync: the grad sync and the param side of an engine, the autograd and module hooks that
drive them, and the parts they own (exposed grads, NaN check, comm-hook registry, ZeRO-3
param units, sparse grads, residency).
"""
