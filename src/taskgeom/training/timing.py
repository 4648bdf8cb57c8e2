"""Where a reproduction spends its time: wall and CPU seconds per experiment, per training run and
per analysis stage, written to ``timings.json`` and shown in the report.

CPU seconds are ``time.process_time`` of the process that did the work: stages run in a sweep's
worker processes (or Ray tasks) are timed there and added with ``Timings.add``; an experiment's CPU
total is its own process's time plus that of its workers' stages. Each stage also records the peak
resident memory of its process up to the stage's end (a pool's worker does one item and exits, so
there it is the item's own peak).
"""

from __future__ import annotations

import resource
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Iterator


class Clock:
    """Wall and CPU seconds (of this process) since it started, or since the last ``lap``."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def lap(self) -> tuple[float, float]:
        """(wall, CPU) seconds since the last lap, and a new lap starts."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = (wall - self.wall, cpu - self.cpu)
        self.wall, self.cpu = wall, cpu
        return out


def peak_resident_mb() -> float:
    """The peak resident memory of this process so far, in MB (``getrusage``'s ``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes on macOS, kB on Linux


@dataclass(frozen=True)
class Stage:
    """One timed piece of work: ``where`` is ``main`` (the reproducing process) or ``worker``;
    ``peak_mb``, its process's peak resident memory up to the stage's end (None: not recorded)."""

    experiment: str
    stage: str
    wall_s: float
    cpu_s: float
    where: str = "main"
    peak_mb: float | None = None


@dataclass
class Timings:
    """The stages of one reproduction, in the order they ended, and each experiment's totals."""

    stages: list[Stage] = field(default_factory=list)
    experiments: dict[str, dict[str, float]] = field(default_factory=dict)

    @contextmanager
    def stage(self, experiment: str, name: str) -> Iterator[None]:
        """Time the block as stage ``name`` of ``experiment`` (in this process)."""
        clock = Clock()
        try:
            yield
        finally:
            wall, cpu = clock.lap()
            self.stages.append(Stage(experiment, name, round(wall, 2), round(cpu, 2), peak_mb=peak_resident_mb()))

    def add(
        self,
        experiment: str,
        name: str,
        wall_s: float,
        cpu_s: float,
        where: str = "worker",
        peak_mb: float | None = None,
    ) -> None:
        """A stage timed by the work itself: in a worker process (its CPU is added to the
        experiment's), or ``main`` (this process: already in the experiment's CPU); ``peak_mb``, the
        resident memory peak of the process that did it, when it reported one."""
        self.stages.append(Stage(experiment, name, round(wall_s, 2), round(cpu_s, 2), where, peak_mb))

    @contextmanager
    def experiment(self, name: str) -> Iterator[None]:
        """Time a whole experiment: its wall seconds, and the CPU seconds of this process plus those
        of the worker stages recorded meanwhile."""
        clock, first = Clock(), len(self.stages)
        try:
            yield
        finally:
            wall, cpu = clock.lap()
            workers = sum(s.cpu_s for s in self.stages[first:] if s.where == "worker")
            self.experiments[name] = {"wall_s": round(wall, 1), "cpu_s": round(cpu + workers, 1)}

    def as_dict(self) -> dict:
        """``timings.json``: {"experiments": {name: {wall_s, cpu_s}}, "total": {wall_s, cpu_s, peak_mb},
        "stages": [{experiment, stage, wall_s, cpu_s, where, peak_mb}]}; the total's ``peak_mb`` is the
        largest any one process reached (this one's included), the figure ``/usr/bin/time -v`` reports."""
        total = {key: round(sum(e[key] for e in self.experiments.values()), 1) for key in ("wall_s", "cpu_s")}
        total["peak_mb"] = max([peak_resident_mb(), *(s.peak_mb for s in self.stages if s.peak_mb is not None)])
        return {"experiments": self.experiments, "total": total, "stages": [asdict(s) for s in self.stages]}


# ---- what a plan will take on this machine ---------------------------------------------------------

# [measured] CPU seconds of training per second its FLOPs (6 x parameters x tokens) take at one thread's
# float32 matrix-multiply rate (``matmul_rate``): 2.4-3.2 for every run of the quick three-seed
# reproduction at 7a2bd5c on a 2-core AMD EPYC (kernels pinned to AVX2; the probe 100 GFLOP/s a
# thread; the runs trained two at a time beside the analyses), ``python benchmarks/plan_costs.py RESULTS
# --rate 100``; 1.7-2.2 at 6c99fae on another AMD EPYC (79 GFLOP/s). Each experiment's analyses
# state theirs per flop-second of the run they read (``claims.registry.Experiment.cost``).
TRAIN_COST_PER_FLOP_SECOND = 2.7


def depth_factor(n_layers: int) -> float:
    """[measured] How much more an analysis costs per training FLOP in a model of ``n_layers``
    blocks than at 2 (its searches and readings run at every block): docs/benchmarks.md, analysis
    over training at 6 blocks against 2, 2.0 times (dual), 2.2 (M1) and 1.4 (E4's P0 and prefix
    probe); linear, 1 at 2 blocks and 2 at 6 (long for E4)."""
    return (n_layers + 2) / 4


def matmul_rate(seconds: float = 0.5, n: int = 512) -> float:
    """FLOP/s of torch's float32 ``n x n`` matrix multiply on one thread, for about ``seconds`` of
    wall time (the probe that scales the costs per flop-second to this machine). Per CPU second of this
    process, so that a machine busy with other work reads its own speed, not its load."""
    import torch

    from taskgeom.settings.devices import torch_threads

    a, b = torch.randn(n, n), torch.randn(n, n)
    with torch_threads(1):
        a @ b  # warm up
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            a @ b
            count += 1
        spent = time.process_time() - cpu
    return 2 * n**3 * count / max(spent, 1e-9)


def estimate_wall(pool: list[float], main: float, workers: int) -> float:
    """Wall seconds of a reproduction's work left: ``pool``, the CPU seconds of each unit of the
    schedule (a run's training and dual analysis, one thread each; M1's analyses and E4's seeds beside
    them), spread over ``workers`` but no less than the longest unit; then ``main``, the CPU seconds of
    what the experiments do in the main process one after another (an experiment without
    ``on_pool``)."""
    return max(sum(pool) / max(1, workers), max(pool, default=0.0)) + main
