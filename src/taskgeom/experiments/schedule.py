"""One schedule for all training: every run the experiments of a reproduction need is
known before any of them starts (each experiment's ``runs(ctx)``), and the unfinished ones are
trained first, grouped by thread count so that threads never outnumber cores (a run that uses
every core alone, then single-thread runs on a process pool, the most expensive first); the
experiments then find their runs finished and only analyse. A run whose experiment asks for it
(``TrainTask.analyse``: the dual-mode sweep's) is also analysed in the schedule, in the
single-thread phase, right after its training in the same worker, so that the analyses fill the
cores the last long trainings leave idle. The stored measurements the other experiments declare
(``Prepared``: M1's analyses, E4's seeds) join that last phase too, each started on the pool as soon
as the runs and measurements it reads are done, the longest chain of work first; the experiments then
read them back.

Each run trains with the torch thread count it would have had if its experiment had trained it in
turn, because the result depends on it (the same run trained with 1 and with 2 threads differs in
the last bits): a run of a single experiment with this process's thread count, a run of a sweep
with the executor's. A run two experiments share keeps the first one's. So the run directories
are the same, bit for bit, as without the schedule; an analysis uses the thread count its sweep
gives it, as in the sweep, and a prepared measurement the thread count of this process, which
would have measured it otherwise. Such a measurement may run with two threads beside a one-thread
training: its threads then wait for each other asleep (``executors.WORKER_ENVIRONMENT``), so that
they cost no more than the core they get.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import pandas as pd
import torch

from taskgeom.analysis.protocol import STUDY, Protocol, measured_under
from taskgeom.errors import RunDirError
from taskgeom.experiments.executors import Executor, local_pool
from taskgeom.progress import console, job_bar
from taskgeom.runs.folders import Run
from taskgeom.settings.config import RunConfig
from taskgeom.settings.devices import available_memory, resolve_device, torch_threads, usable_cores
from taskgeom.settings.recipes import MeasureSettings
from taskgeom.training.memory import check_training_fits, parameter_count, training_memory
from taskgeom.training.timing import Clock, Timings, peak_resident_mb


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
    needs: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.task.name

    def cost(self) -> float:
        return self.task.cost() * (bool(self.train_threads) + ANALYSIS_SHARE * bool(self.analysis_threads))

    def run(self) -> dict[str, tuple[float, float]]:
        return run_unit(self)


@dataclass(frozen=True)
class Prepared:
    """A stored measurement of ``experiment`` that the schedule makes on its pool, so that the
    experiment later reads it back: ``work()`` measures and stores it (nothing when it is stored
    already) and returns the (wall, CPU) seconds of each stage it timed and its process's peak resident
    memory (MB) at the stage's end, by the stage's name;
    ``name``, unique in a schedule; ``needs``, the names of the runs (trained) and of the other
    prepared measurements it reads; ``threads``, its torch thread count (the bits depend on it);
    ``cost``, relative to ``TrainTask.cost``, to start the longest chain of work first; measured
    under ``protocol``. ``work`` must pickle (a ``functools.partial`` of a module's function)."""

    experiment: str
    name: str
    needs: tuple[str, ...]
    threads: int
    work: Callable[[], dict[str, tuple[float, float, float]]]
    cost: float = 0.0
    protocol: Protocol = STUDY

    def run(self) -> dict[str, tuple[float, float, float]]:
        with measured_under(self.protocol), torch_threads(self.threads):
            return self.work()


def _with_threads(threads: int, work) -> tuple[float, float]:
    """(wall, CPU) seconds of ``work()`` run with ``threads`` torch threads."""
    clock = Clock()
    with torch_threads(threads):
        work()
    return clock.lap()


def run_unit(unit: Unit) -> dict[str, tuple[float, float]]:
    """Do one unit in this process; returns the (wall, CPU) seconds of its ``train`` and ``analyse``."""
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


Item = Unit | Prepared  # what a phase of the schedule does


def _do(item: Item) -> tuple[dict[str, tuple[float, float]], float]:
    """Do ``item`` (a unit or a prepared measurement) in this process: the (wall, CPU) seconds of each
    of its stages, and this process's peak resident memory (MB) at its end."""
    return item.run(), peak_resident_mb()


def chain_costs(items: list[Item]) -> dict[str, float]:
    """{name: the item's cost plus that of the costliest chain of items needing it} over ``items``: the
    order that starts the longest chain of work first."""
    needed_by: dict[str, list[Item]] = {}
    for item in items:
        for need in item.needs:
            needed_by.setdefault(need, []).append(item)
    chain: dict[str, float] = {}

    def cost(item: Item) -> float:
        if item.name not in chain:
            chain[item.name] = item.cost() if isinstance(item, Unit) else item.cost
            chain[item.name] += max((cost(later) for later in needed_by.get(item.name, ())), default=0.0)
        return chain[item.name]

    for item in items:
        cost(item)
    return chain


def _run_phase(group: list[Item], workers: int, failed: set[str]) -> Iterator[tuple[Item, tuple | BaseException]]:
    """(item, ``_do``'s seconds and peak, or the error) for each item of ``group``, on a pool of ``workers``
    processes or (one worker) one after another in this process. An item starts once every name it
    ``needs`` from ``group`` is done, the one heading the costliest chain first (``chain_costs``); an
    item needing one in ``failed`` (earlier phases' failures, and this one's, added as they come) is
    not started and comes back with the reason."""
    chain = chain_costs(group)
    waiting = sorted(group, key=lambda item: -chain[item.name])
    unfinished = {item.name for item in group}
    running: dict = {}
    with local_pool(workers) if workers > 1 else nullcontext() as pool:
        while waiting or running:
            for item in [item for item in waiting if failed & set(item.needs)]:
                waiting.remove(item)
                unfinished.discard(item.name)
                failed.add(item.name)
                yield item, RuntimeError(f"not started: it reads {sorted(failed & set(item.needs))}, which failed")
            ready = [item for item in waiting if not unfinished & set(item.needs)]
            if pool is None:
                if not ready:
                    break
                item = ready[0]
                waiting.remove(item)
                try:
                    result = _do(item)
                except Exception as err:  # reported, and done again by the experiment that needs it
                    result = err
                finished = [(item, result)]
            else:
                for item in ready[: workers - len(running)]:
                    waiting.remove(item)
                    try:
                        running[pool.submit(_do, item)] = item
                    except RuntimeError as err:  # the pool broke (a worker died): left to the experiments
                        unfinished.discard(item.name)
                        failed.add(item.name)
                        yield item, err
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                finished = []
                for future in done:
                    item = running.pop(future)
                    try:
                        result = future.result()
                    except Exception as err:  # the item raised, or its worker process died
                        result = err
                    finished.append((item, result))
            for item, result in finished:
                unfinished.discard(item.name)
                if isinstance(result, BaseException):
                    failed.add(item.name)
                yield item, result
    for item in waiting:  # what each needs waits on another of them
        failed.add(item.name)
        yield item, RuntimeError(f"not started: it reads {sorted(unfinished & set(item.needs))}, which wait on it")


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


def memory_workers(group: list[Item], available: int | None = None) -> int:
    """How many of ``group``'s items fit in this machine's free memory at once: its free bytes
    (``available``, else MemAvailable) over the largest training estimate among the units that train
    on the CPU (``config.training_memory``, a lower bound); ``len(group)`` when nothing bounds it."""
    needs = [
        sum(training_memory(unit.task.config).values())
        for unit in group
        if isinstance(unit, Unit) and unit.train_threads and resolve_device(unit.task.device).type == "cpu"
    ]
    available = available_memory(torch.device("cpu")) if available is None else available
    if not needs or not available:
        return len(group)
    return max(1, available // max(needs))


def train_all(tasks: list[TrainTask], executor: Executor, timings: Timings, prepared: list[Prepared] = ()) -> None:
    """Train (and analyse, where asked) every run of ``tasks`` with work left on ``executor``'s local
    pool, phase by phase: units using t threads share the machine's cores,
    ``cores // t`` at once, so training threads never outnumber cores (oversubscribed torch threads
    slow every run down several-fold); the ``prepared`` measurements join the last phase, each as
    soon as what it reads is done. Work that fails is left to the experiment that needs it, which
    does it again in its own process and reports the error there."""
    units = plan(tasks)
    for unit in units:  # refuse before any run directory is made
        if unit.train_threads:
            check_training_fits(unit.task.config, unit.task.device)
    levels = phases(units) or [(1, [])]
    levels[-1] = (levels[-1][0], [*levels[-1][1], *prepared])
    cores, failed = usable_cores(), set()
    with job_bar("train", len(units) + len(prepared)) as advance:
        for threads, group in levels:
            group = [item for item in group if item.name not in failed]  # no analysis of a run whose training failed
            if not group:
                continue
            pool = max(1, min(executor.workers, cores // threads, len(group), memory_workers(group)))
            where = "worker" if pool > 1 else "main"
            for item, result in _run_phase(group, pool, failed):
                if isinstance(result, BaseException):
                    failed.add(item.name)
                    console.print(
                        f"[red]{item.name} failed in the schedule[/red] ({type(result).__name__}: {result}); "
                        "its experiment does it again"
                    )
                elif isinstance(item, Prepared):  # each stage with its own peak (the item's so far at its end)
                    stages, _ = result
                    for stage, (wall, cpu, peak) in stages.items():
                        timings.add(item.experiment, f"{stage}", wall, cpu, where=where, peak_mb=peak)
                else:
                    seconds, peak = result
                    for what, spent in seconds.items():
                        used = item.train_threads if what == "train" else item.analysis_threads
                        timings.add(
                            "schedule", f"{what} {item.name} ({used} threads)", *spent, where=where, peak_mb=peak
                        )
                advance(item.name)
