"""Transport: every torch.distributed call (`Collectives`), the process groups and their
`Topology`, where tensors are allocated, and torch DDP's arguments mapped onto megabuf's.
"""
