"""Where training runs and at what precision: device names, bf16 autocast, batch transfer.

Batches are always generated on the CPU (a pure function of seed and step, whatever the device)
and copied over from pinned memory, so a CUDA run sees exactly the data of a CPU run and differs
from it only by floating-point arithmetic.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from taskgeom.errors import TaskgeomError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(TaskgeomError):
    """A device that does not exist on this machine or in this torch build."""


def check_device_name(name: str) -> None:
    """DeviceError unless ``name`` is spelt auto, cpu, cuda or cuda:N (whether it exists aside)."""
    kind, colon, index = name.partition(":")
    if kind not in DEVICE_CHOICES or (colon and (kind != "cuda" or not index.isdigit())):
        raise DeviceError(f"unknown device {name!r}; choose auto, cpu, cuda or cuda:N")


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda`` or ``cuda:N`` -> a torch device."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kind, _, index = name.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device {name!r} asked for, but CUDA is not available (torch {torch.__version__}); use --device cpu or auto")
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(f"device {name!r} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """bfloat16 autocast for ``precision == "bf16"`` on ``device``; a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a CPU tensor on ``device``, through pinned memory (asynchronous) for CUDA."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
