"""Buckets: the contiguous param-and-grad buffers and the bucket groups that reduce them
(lifecycles, dispatch chains, arrivals, the two-level reduction).
"""
