"""The weight lifecycle for RL and colocated training (docs/rl-and-colocated-training.md):
offload an engine off its device and restore it bitwise (`offload`, `restore`), stream its
full weights out bucket by bucket (`export_weights`), and publish them to consumer ranks that
do not train (`publish`, `WeightReceiver`)."""

from megabuf.residency import EngineOffloadedError
from megabuf.weights.offload import OffloadReport, is_offloaded, offload, restore

__all__ = ["EngineOffloadedError", "OffloadReport", "is_offloaded", "offload", "restore"]
