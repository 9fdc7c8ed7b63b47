"""Re-plan: `bucket_size = "auto"`: the warm-up measurement, the agreed plan and the
rebuild (dense and sharded).
"""
