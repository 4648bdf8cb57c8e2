"""Portable CPU kernels: the same bits on every x86-64 machine with AVX2.

torch picks its CPU kernels by the CPU (ATen's vectorised paths, MKL's branches, oneDNN's ISA), and
training amplifies the last bits, so two machines train other weights. Pinned to AVX2, AMD EPYC machines
with AVX2 and with AVX-512 trained the same bits (``benchmarks/kernel_pins.py`` on two machines, README);
an Intel Xeon with AVX-512 trained other bits under the same pins (2026-12-03).
Every command that trains or measures calls ``use_portable_kernels`` before torch computes anything
(the CLI's entry point; pool workers are spawned with its environment, Ray tasks get it in their
``runtime_env``). The variables must be set before torch's first computation: torch reads them then.

The choice (``Kernels``): ``pinned`` (the pins set here), ``user`` (the user set one of the variables:
theirs are kept), ``native`` (asked for with ``--native-kernels``, or a CPU without AVX2 or not
x86-64, where the pins cannot hold: said once). It is recorded in ``reproduction.json``.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

PINS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CHOICE_VARIABLE = "TASKGEOM_KERNELS"  # the choice made, for the manifest and for child processes


@dataclass(frozen=True)
class Kernels:
    """The kernel choice: ``mode`` pinned | user | native, ``reason`` in words, ``variables`` set."""

    mode: str
    reason: str
    variables: dict[str, str]

    def record(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "variables": dict(self.variables)}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (Linux), None where they cannot be read."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def choose(
    native: bool = False,
    environ: dict[str, str] | None = None,
    machine: str | None = None,
    flags: set[str] | None = None,
) -> Kernels:
    """The kernel choice for this process (module docstring); ``environ``, ``machine`` and
    ``flags`` default to this machine's."""
    environ = os.environ if environ is None else environ
    machine = (machine or platform.machine()).lower()
    flags = cpu_flags() if flags is None else flags
    user = {name: environ[name] for name in PINS if name in environ}
    if (
        user == PINS and environ.get(CHOICE_VARIABLE) == "pinned"
    ):  # set by an earlier choice of this process or its parent
        user = {}
    if user:
        return Kernels(
            "user", f"kept the kernel variables the user set ({', '.join(f'{k}={v}' for k, v in user.items())})", user
        )
    if native:
        return Kernels("native", "--native-kernels: torch picks its kernels by this CPU", {})
    if machine not in ("x86_64", "amd64"):
        return Kernels("native", f"this CPU is {machine}, not x86-64: bits will differ from the published ones", {})
    if flags is not None and "avx2" not in flags:
        return Kernels("native", "this CPU has no AVX2: bits will differ from the published ones", {})
    return Kernels(
        "pinned",
        "ATen, MKL and oneDNN pinned to AVX2: AMD EPYC CPUs train the same bits as each other, an Intel Xeon others",
        dict(PINS),
    )


def use_portable_kernels(native: bool = False) -> Kernels:
    """Choose and apply the kernels for this process and the processes it starts (``tg.pin_kernels``):
    pinned to AVX2 unless the user set the variables, or ``native`` (torch picks by this CPU); say
    once, on stderr, when the published bits cannot be had here. Returns the choice (``Kernels``:
    its ``mode`` and ``reason``). Call before torch computes anything: torch reads the variables then."""
    choice = choose(native)
    if choice.mode == "native" and os.environ.get(CHOICE_VARIABLE) == "pinned":
        for name in PINS:  # an earlier choice of this process pinned them
            os.environ.pop(name, None)
    os.environ.update(choice.variables)
    if CHOICE_VARIABLE not in os.environ and choice.mode == "native" and not native:
        print(f"taskgeom: {choice.reason}", file=sys.stderr)
    os.environ[CHOICE_VARIABLE] = choice.mode
    return choice


def environment() -> dict[str, str]:
    """The kernel variables of this process (the pins and the choice), for a process elsewhere
    (a Ray task's ``runtime_env``)."""
    return {name: os.environ[name] for name in (*PINS, CHOICE_VARIABLE) if name in os.environ}


def current() -> dict:
    """The choice in force in this process (as ``reproduction.json`` records it): the mode set by
    ``use_portable_kernels`` (``unset`` when nothing chose) and the pin variables set."""
    return {
        "mode": os.environ.get(CHOICE_VARIABLE, "unset"),
        "variables": {name: os.environ[name] for name in PINS if name in os.environ},
    }
