"""Core: `assemble`, the `Engine` it builds once and its `Wiring` record, and what acts on
the engine whole(pickling and copying a wrapped model, uneven inputs under torch's `Join`).
"""
