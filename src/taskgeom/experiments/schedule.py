"""One schedule for all training (issue 14): every run the experiments of a reproduction need is
known before any of them starts (each experiment's ``runs(ctx)``), and the unfinished ones are
trained first, grouped by thread count so that threads never outnumber cores (single-thread runs
on a process pool, the most expensive first; a run that uses every core alone); the experiments
then find their runs finished and only analyse.

Each run trains with the torch thread count it would have had if its experiment had trained it in
turn, because the result depends on it (the same run trained with 1 and with 2 threads differs in
the last bits): a run of a single experiment with this process's thread count, a run of a sweep
with the executor's. A run two experiments share keeps the first one's. So the run directories
are the same, bit for bit, as without the schedule.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from taskgeom.config import RunConfig, parameter_count
from taskgeom.devices import check_training_fits
from taskgeom.experiments.executors import Executor, execute
from taskgeom.progress import console, job_bar
from taskgeom.runs import Run
from taskgeom.timing import Clock, Profile


@dataclass(frozen=True)
class TrainTask:
    """One run to train: its config, run root, device, tracker and the torch thread count it trains
    with (its config's ``train.threads`` when set)."""

    config: RunConfig
    root: str
    device: str
    tracker: str
    threads: int

    @property
    def name(self) -> str:
        return f"{self.config.name}-{self.config.digest()}"

    def cost(self) -> float:
        """Relative CPU cost, for longest-first ordering: parameters x tokens seen."""
        train, task = self.config.train, self.config.task
        return float(parameter_count(self.config)) * train.steps * train.batch_size * task.seq_len


def train_task(task: TrainTask, _pool_threads: int = 0) -> tuple[float, float]:
    """Train (or resume) one run in this process with ``task.threads`` torch threads; returns its
    (wall, CPU) seconds."""
    from taskgeom.train import train

    clock, before = Clock(), torch.get_num_threads()
    torch.set_num_threads(task.threads)
    try:
        train(Run.create(task.config, task.root), device=task.device, tracker=task.tracker)
    finally:
        torch.set_num_threads(before)
    return clock.lap()


def unique_unfinished(tasks: list[TrainTask]) -> list[TrainTask]:
    """The tasks whose run is not finished, each run once (the first task naming it wins), the most
    expensive first."""
    seen: dict[str, TrainTask] = {}
    for task in tasks:
        if task.name not in seen and not (Path(task.root) / task.name / "model.safetensors").exists():
            seen[task.name] = task
    return sorted(seen.values(), key=lambda t: -t.cost())


def _train_group(group: list[TrainTask], workers: int) -> Iterator[tuple[TrainTask, tuple[float, float] | BaseException]]:
    """(task, (wall, CPU) seconds or the error) for each task: on a pool of ``workers`` processes,
    or one after another in this process."""
    if workers > 1:
        yield from execute(train_task, group, Executor(workers=workers))
        return
    for task in group:
        try:
            yield task, train_task(task)
        except Exception as err:  # reported, and retried by the experiment that needs the run
            yield task, err


def train_all(tasks: list[TrainTask], executor: Executor, timings: Profile) -> None:
    """Train every unfinished run of ``tasks`` on ``executor``'s local pool. Runs that use t threads
    share the machine's cores: they train on ``cores // t`` workers at once (at most the
    executor's), so threads never outnumber cores (oversubscribed torch threads slow every run
    down several-fold). A run whose training fails is left to the experiment that needs it, which
    trains it again in its own process and reports the error there."""
    todo = unique_unfinished(tasks)
    for task in todo:  # refuse before any run directory is made
        check_training_fits(task.config, task.device)
    cores = os.cpu_count() or 1
    with job_bar("train", len(todo)) as advance:
        for threads in sorted({t.threads for t in todo}):
            group = [t for t in todo if t.threads == threads]
            workers = max(1, min(executor.workers, cores // threads, len(group)))
            for task, result in _train_group(group, workers):
                if isinstance(result, BaseException):
                    console.print(f"[red]training {task.name} failed[/red] ({type(result).__name__}: {result}); its experiment retries it")
                else:
                    timings.add("schedule", f"train {task.name} ({task.threads} threads)", *result, where="worker" if workers > 1 else "main")
                advance(task.name)
