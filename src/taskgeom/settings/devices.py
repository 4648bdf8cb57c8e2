"""Where training runs and at what precision: device names, bf16 autocast, batch transfer.

Batches are always generated on the CPU (a pure function of seed and step, whatever the device)
and copied over from pinned memory, so a CUDA run sees exactly the data of a CPU run and differs
from it only by floating-point arithmetic.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator

import torch

from taskgeom.errors import TaskgeomError

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class DeviceError(TaskgeomError):
    """A device that does not exist on this machine or in this torch build."""


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch uses ``count`` threads inside the block (0: as it is), and the number it had after:
    a run's results depend on its thread count, so one run's setting must not leak into the next
    piece of work this process does."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
            raise DeviceError(
                f"device {name!r} asked for, but CUDA is not available (torch {torch.__version__}); use --device cpu or auto"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(
                f"device {name!r} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return torch.device(name)


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    """bfloat16 autocast for ``precision == "bf16"`` on ``device``; a no-op for fp32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a CPU tensor on ``device``, through pinned memory (asynchronous) for CUDA."""
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def available_memory(device: torch.device) -> int | None:
    """Bytes of memory free for new work on ``device``: CUDA's free memory, or on the CPU
    MemAvailable of /proc/meminfo (else the physical memory, from os.sysconf); None if unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def usable_cores(cgroup: str = "/sys/fs/cgroup") -> int:
    """The cores this process may use: its CPU affinity (else ``os.cpu_count``), bounded by a cgroup
    CPU quota when one is set (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cores, int(quota)) if quota else cores)


def _cgroup_quota(root: str) -> float | None:
    """CPUs allowed by the cgroup CPU quota at ``root`` (None: no quota or none readable)."""
    try:
        with open(os.path.join(root, "cpu.max")) as handle:
            quota, period = handle.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with (
            open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as q,
            open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as p,
        ):
            quota, period = int(q.read()), int(p.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def default_workers(threads_per_run: int | None = None) -> int:
    """``--workers`` when not given: the usable cores divided by the threads per run (1 unless
    ``--cpus-per-run`` says otherwise); the schedule caps it further by memory."""
    return max(1, usable_cores() // (threads_per_run or 1))


def describe(device: torch.device) -> str:
    """``this machine (cpu)`` or ``cuda:0 (NVIDIA H200)``: where memory is checked, in words."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return "this machine (cpu)"
