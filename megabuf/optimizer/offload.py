"""CPU offload of the distributed optimizer (`DistributedDataParallelConfig.cpu_offload`).

[Note: cpu offload]
With params on a CUDA device, every main param of this rank's shards gets
- `main`: an fp32 copy in pinned host memory (for fp32 params too: the device buffer can no
  longer be stepped in place), which the inner optimizer steps on the CPU, so its state (Adam's
  moments) is host memory as well;
- `model_grad`: a pinned host buffer of the grad shard's dtype, refilled at every step;
- `model_data`: the param shard on the device (the `param_data` view), where the update lands.
At each step `fetch_grads()` copies every reduced grad shard device -> host with non-blocking
copies on a side stream (which first waits for the compute stream, where the reductions
landed), then waits on one event before the CPU reads them: the grad norm, clipping and the
inner step run on the host. The write-back (`write_back_all`) copies each updated main param
host -> device without blocking the host, on the compute stream, so the param all-gather that
follows is ordered after it on the device. The host copy of a main param is not written again
before that copy has run: the next step's `fetch_grads()` waits for the compute stream first.
The device keeps the param buffer and the grad buffer (or their shards); `memory_report()`
reports the main params, their state and the host grads in its `host` figures.

With params on the CPU there is nothing to offload: the optimizer already steps in host
memory. `cpu_offload=True` is then a no-op and warns once (a `UserWarning`), so a config
written for a GPU cluster also runs on a laptop.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from megabuf.ddp import DistributedDataParallel
from megabuf.optimizer.main_params import MainParam
from megabuf.transport.devices import params_device

HOST = torch.device("cpu")  # where cpu_offload keeps main params, state and grad copies


class CPUOffload:
    """Host copies of main params and grads, and the copies between device and host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._device_grads: list[Tensor] = []  # 1-D grad shard views on the device
        self._host_grads: list[Tensor] = []  # their pinned host copies, same order
        self._stream = torch.cuda.Stream(device)
        self._event = torch.cuda.Event()

    @classmethod
    def for_chunks(
        cls, chunks: Sequence[DistributedDataParallel], grad_scaler: object | None
    ) -> CPUOffload | None:
        """The offload for `chunks`, or None when cpu_offload is off or a no-op (CPU params,
        with one UserWarning); see [Note: cpu offload]."""
        flags = {bool(c.ddp_config.cpu_offload) for c in chunks}
        if flags == {False}:
            return None
        if len(flags) > 1:
            raise ValueError(
                "megabuf: model chunks disagree on DistributedDataParallelConfig.cpu_offload; "
                "build every chunk with the same DDP config"
            )
        device = params_device([p for c in chunks for p in c.engine.param_to_name], None)
        if device.type == "cpu":
            warnings.warn(
                "megabuf: DistributedDataParallelConfig.cpu_offload=True is a no-op here: the "
                "params are on the CPU, where the optimizer already steps; set "
                "cpu_offload=False to silence this",
                UserWarning,
                stacklevel=4,
            )
            return None
        if device.type != "cuda":
            raise ValueError(
                f"megabuf: DistributedDataParallelConfig.cpu_offload=True needs CUDA params, "
                f"not {device.type}; set cpu_offload=False"
            )
        if grad_scaler is not None:
            raise ValueError(
                "megabuf: DistributedDataParallelConfig.cpu_offload=True does not support loss "
                "scaling (OptimizerConfig.fp16 / loss_scale) yet; train in bf16 or fp32, or "
                "set cpu_offload=False"
            )
        return cls(device)

    def offload(self, main_params: Sequence[MainParam]) -> list[MainParam]:
        """Host versions of `main_params` (sharded, on this device); see [Note: cpu offload]."""
        out = []
        for mp in main_params:
            main = torch.empty(mp.main.shape, dtype=torch.float32, device=HOST, pin_memory=True)
            main.copy_(mp.main)  # fp32 already: the device copy (or the buffer view) is exact
            grad = torch.empty(
                mp.model_grad.shape, dtype=mp.model_grad.dtype, device=HOST, pin_memory=True
            )
            data = mp.model_data if mp.model_data is not None else mp.main.view(-1)
            self._device_grads.append(mp.model_grad)
            self._host_grads.append(grad)
            out.append(dataclasses.replace(mp, main=main, model_grad=grad, model_data=data))
        return out

    def fetch_grads(self) -> None:
        """Copy every reduced grad shard to its host buffer and wait for the copies."""
        with torch.profiler.record_function("megabuf::offload_grads_to_host"):
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for host, dev in zip(self._host_grads, self._device_grads, strict=True):
                    host.copy_(dev, non_blocking=True)
            self._event.record(self._stream)
            self._event.synchronize()
