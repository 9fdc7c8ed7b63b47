"""The weight lifecycle for RL and colocated training (docs/rl-and-colocated-training.md):
offload an engine off its device and restore it bitwise (`offload`, `restore`), stream its
full weights out bucket by bucket (`export_weights`), and publish them to consumer ranks that
do not train (`publish`, `WeightReceiver`, or `WeightTransferReceiver` for an inference engine
speaking the four-phase weight-transfer protocol)."""

from megabuf.sync.residency import EngineOffloadedError
from megabuf.weights.channel import PendingPublish, PublishGroup, publish_group
from megabuf.weights.export import WeightBucket, export_weights, weight_version
from megabuf.weights.offload import OffloadReport, is_offloaded, offload, restore
from megabuf.weights.publish import Publisher, WeightReceiver
from megabuf.weights.weight_transfer import WeightTransferReceiver

__all__ = [
    "EngineOffloadedError",
    "OffloadReport",
    "PendingPublish",
    "PublishGroup",
    "Publisher",
    "WeightBucket",
    "WeightReceiver",
    "WeightTransferReceiver",
    "export_weights",
    "is_offloaded",
    "offload",
    "publish_group",
    "restore",
    "weight_version",
]
