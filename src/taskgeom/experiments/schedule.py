"""One schedule for all training: every run the experiments of a reproduction need is
known before any of them starts (each experiment's ``runs(ctx)``), and the unfinished ones are
trained first, grouped by thread count so that threads never outnumber cores (a run that uses
every core alone, then single-thread runs on a process pool, the most expensive first); the
experiments then find their runs finished and only analyse. A run whose experiment asks for it
(``TrainTask.analyse``: the dual-mode sweep's) is also analysed in the schedule, in the
single-thread phase, right after its training in the same worker, so that the analyses fill the
cores the last long trainings leave idle.

Each run trains with the torch thread count it would have had if its experiment had trained it in
turn, because the result depends on it (the same run trained with 1 and with 2 threads differs in
the last bits): a run of a single experiment with this process's thread count, a run of a sweep
with the executor's. A run two experiments share keeps the first one's. So the run directories
are the same, bit for bit, as without the schedule; an analysis uses the thread count its sweep
gives it, as in the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import pandas as pd
import torch

from taskgeom.analysis.protocol import STUDY, Protocol, measured_under
from taskgeom.errors import RunDirError
from taskgeom.experiments.executors import Executor, execute
from taskgeom.progress import console, job_bar
from taskgeom.runs.folders import Run
from taskgeom.settings.config import RunConfig
from taskgeom.settings.devices import available_memory, resolve_device, torch_threads, usable_cores
from taskgeom.settings.recipes import MeasureSettings
from taskgeom.training.memory import check_training_fits, parameter_count, training_memory
from taskgeom.training.timing import Clock, Timings


@dataclass(frozen=True)
class TrainTask:
    """One run to train: its config, run root, device, tracker and the torch thread count it trains
    with (its config's ``train.threads`` when set); ``analyse``: then measure its dual modes
    (``analysis.stored.dual``) with that thread count, projection R^2 at ``projection_sizes`` (OOD tasks,
    sequences per task: its recipe's profile's), under ``protocol`` (its profile's sample sizes)."""

    config: RunConfig
    root: str
    device: str
    tracker: str
    threads: int
    analyse: bool = False
    projection_sizes: tuple[int, int] = MeasureSettings().projection_sizes
    protocol: Protocol = STUDY

    @property
    def name(self) -> str:
        return f"{self.config.name}-{self.config.digest()}"

    @property
    def path(self) -> Path:
        return Path(self.root) / self.name

    def cost(self) -> float:
        """Relative CPU cost of training, for longest-first ordering: parameters x tokens seen."""
        train, task = self.config.train, self.config.task
        return float(parameter_count(self.config)) * train.steps * train.batch_size * task.seq_len


# [measured] A quick-profile dual analysis costs about a quarter of its run's training (e3: 31 of
# 137 CPU-s; e1: 26 of 80).
ANALYSIS_SHARE = 0.25


@dataclass(frozen=True)
class Unit:
    """The schedule's work on one run: train it with ``train_threads`` torch threads (0: nothing to
    train), then analyse it with ``analysis_threads`` (0: nothing to analyse here)."""

    task: TrainTask
    train_threads: int
    analysis_threads: int

    def cost(self) -> float:
        return self.task.cost() * (bool(self.train_threads) + ANALYSIS_SHARE * bool(self.analysis_threads))


def _with_threads(threads: int, work) -> tuple[float, float]:
    """(wall, CPU) seconds of ``work()`` run with ``threads`` torch threads."""
    clock = Clock()
    with torch_threads(threads):
        work()
    return clock.lap()


def run_unit(unit: Unit, _pool_threads: int = 0) -> dict[str, tuple[float, float]]:
    """Do one unit in this process; returns the (wall, CPU) seconds of its ``train`` and ``analyse``.
    (``_pool_threads``: what ``execute`` passes every task; a unit sets its own thread counts.)"""
    from taskgeom.analysis.stored.dual import analyze_dual, load_dual
    from taskgeom.analysis.study import StudyRun
    from taskgeom.training.train import train

    task, seconds = unit.task, {}
    if unit.train_threads:
        seconds["train"] = _with_threads(
            unit.train_threads,
            lambda: train(Run.create(task.config, task.root), device=task.device, tracker=task.tracker),
        )
    if unit.analysis_threads:
        with measured_under(task.protocol):
            seconds["analyse"] = _with_threads(
                unit.analysis_threads,
                lambda: (
                    load_dual(run := Run.open(task.path), task.projection_sizes)
                    or analyze_dual(StudyRun(run), projection_sizes=task.projection_sizes)
                ),
            )
    return seconds


def analysed(path: Path, protocol: Protocol = STUDY) -> bool:
    """Whether the run at ``path`` has a dual analysis current under ``protocol``; a damaged run
    directory counts as not analysed (its experiment reports it)."""
    from taskgeom.analysis.stored.dual import load_dual

    try:
        with measured_under(protocol):
            return (path / "model.safetensors").exists() and load_dual(Run.open(path)) is not None
    except RunDirError:
        return False


def plan(tasks: list[TrainTask]) -> list[Unit]:
    """One unit per run with work left: trained with the thread count of the first task naming it,
    analysed as the first task asking for the analysis asks (its thread count, projection sizes and
    protocol). The most expensive first."""
    first: dict[str, TrainTask] = {}
    analysis: dict[str, TrainTask] = {}
    for task in tasks:
        first.setdefault(task.name, task)
        if task.analyse:
            analysis.setdefault(task.name, task)
    units = []
    for name, task in first.items():
        asked = analysis.get(name)
        if asked is not None:
            task = replace(task, analyse=True, projection_sizes=asked.projection_sizes, protocol=asked.protocol)
        train_threads = 0 if (task.path / "model.safetensors").exists() else task.threads
        analysis_threads = asked.threads if asked is not None and not analysed(task.path, asked.protocol) else 0
        if train_threads or analysis_threads:
            units.append(Unit(task, train_threads, analysis_threads))
    return sorted(units, key=lambda u: -u.cost())


def phases(units: list[Unit]) -> list[tuple[int, list[Unit]]]:
    """(threads, units) in descending thread count: no unit of a phase uses more threads than that.
    An analysis runs in the phase of its own thread count, after its run's training in an earlier
    phase; one that needs more threads than its training runs right after it, in the same unit, in
    the analysis' phase."""
    by_level: dict[int, list[Unit]] = {}
    for unit in units:
        train, analyse = unit.train_threads, unit.analysis_threads
        if train and analyse and analyse < train:
            by_level.setdefault(train, []).append(Unit(unit.task, train, 0))
            by_level.setdefault(analyse, []).append(Unit(unit.task, 0, analyse))
        else:
            by_level.setdefault(max(train, analyse), []).append(unit)
    return [(level, sorted(group, key=lambda u: -u.cost())) for level, group in sorted(by_level.items(), reverse=True)]


def _run_phase(group: list[Unit], workers: int) -> Iterator[tuple[Unit, dict | BaseException]]:
    """(unit, its seconds or the error) for each unit: on a pool of ``workers`` processes, or one
    after another in this process."""
    if workers > 1:
        yield from execute(run_unit, group, Executor(workers=workers))
        return
    for unit in group:
        try:
            yield unit, run_unit(unit)
        except Exception as err:  # reported, and retried by the experiment that needs the run
            yield unit, err


def plan_table(tasks: list[TrainTask]) -> pd.DataFrame:
    """One row per distinct run of ``tasks``: its name, recipe, diversity k, seed, steps, batch,
    sequence length, parameters, tokens seen (steps x batch x length) and the training FLOPs
    estimate 6 x parameters x tokens."""
    rows = {}
    for task in tasks:
        name, c = task.name, task.config
        if name in rows:  # a run two experiments need
            continue
        tokens, parameters = c.train.steps * c.train.batch_size * c.task.seq_len, parameter_count(c)
        rows[name] = {
            "run": name,
            "recipe": c.name,
            "diversity": c.task.diversity,
            "seed": c.train.seed,
            "steps": c.train.steps,
            "batch_size": c.train.batch_size,
            "seq_len": c.task.seq_len,
            "parameters": parameters,
            "tokens": tokens,
            "flops": 6 * parameters * tokens,
        }
    return pd.DataFrame(list(rows.values()))


def memory_workers(group: list[Unit], available: int | None = None) -> int:
    """How many of ``group``'s units fit in this machine's free memory at once: its free bytes
    (``available``, else MemAvailable) over the largest training estimate among the units that train
    on the CPU (``config.training_memory``, a lower bound); ``len(group)`` when nothing bounds it."""
    needs = [
        sum(training_memory(unit.task.config).values())
        for unit in group
        if unit.train_threads and resolve_device(unit.task.device).type == "cpu"
    ]
    available = available_memory(torch.device("cpu")) if available is None else available
    if not needs or not available:
        return len(group)
    return max(1, available // max(needs))


def train_all(tasks: list[TrainTask], executor: Executor, timings: Timings) -> None:
    """Train (and analyse, where asked) every run of ``tasks`` with work left on ``executor``'s
    local pool, phase by phase: units using t threads share the machine's cores, ``cores // t`` at
    once (at most the executor's workers), so threads never outnumber cores (oversubscribed torch
    threads slow every run down several-fold). Work that fails is left to the experiment that needs
    it, which does it again in its own process and reports the error there."""
    units = plan(tasks)
    for unit in units:  # refuse before any run directory is made
        if unit.train_threads:
            check_training_fits(unit.task.config, unit.task.device)
    cores, failed = usable_cores(), set()
    with job_bar("train", len(units)) as advance:
        for threads, group in phases(units):
            group = [
                unit for unit in group if unit.task.name not in failed
            ]  # no analysis of a run whose training failed
            workers = max(1, min(executor.workers, cores // threads, len(group), memory_workers(group)))
            for unit, result in _run_phase(group, workers):
                name = unit.task.name
                if isinstance(result, BaseException):
                    failed.add(name)
                    console.print(
                        f"[red]{name} failed in the schedule[/red] ({type(result).__name__}: {result}); its experiment retries it"
                    )
                else:
                    where = "worker" if workers > 1 else "main"
                    for what, seconds in result.items():
                        used = unit.train_threads if what == "train" else unit.analysis_threads
                        timings.add("schedule", f"{what} {name} ({used} threads)", *seconds, where=where)
                advance(name)
