"""Training: what a training loop calls on wrapped models between steps
(`finalize_model_grads`, `verify_reproducible`).
"""
