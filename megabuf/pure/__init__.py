"""Pure: layout math and the small records the config and the plan are made from (units,
owners, the hybrid split, bucket boundaries, the strategy objects, the timeline). Sees
numels, dtypes, sizes and names, never a process group or a parameter; tested without
processes. The lowest layer ([Note: import layers], tests/test_import_graph.py).
"""
