"""Shared pieces of the experiments: the output folder, training runs on demand, collecting
claims and figures, and the ``reproduce`` driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch

from taskgeom.claims import Claim
from taskgeom.devices import check_training_fits
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.schedule import TrainTask, train_all
from taskgeom.progress import console, step_bar
from taskgeom.recipes import load_recipe
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_json, atomic_write_text
from taskgeom.timing import Profile
from taskgeom.train import train


@dataclass
class Context:
    """Where one reproduction writes, its profile, where its sweeps run (``executor``), where its
    runs train and what they also log to (``device``, ``tracker``), and what the experiments have
    produced."""

    out: Path
    profile: str = "quick"
    executor: Executor = Executor()
    device: str = "auto"
    tracker: str = "none"
    claims: list[Claim] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (path relative to out, caption)
    timings: Profile = field(default_factory=Profile)  # where the time goes (timings.json)
    experiment: str = ""  # the experiment running now

    def stage(self, name: str) -> ContextManager[None]:
        """Time a block as stage ``name`` of the current experiment."""
        return self.timings.stage(self.experiment, name)

    @property
    def runs_root(self) -> Path:
        return self.out / "runs"

    def figure(self, name: str, caption: str) -> Path:
        """Register figure ``figures/name`` with its caption; returns the path to save it to."""
        path = self.out / "figures" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        self.figures.append((f"figures/{name}", caption))
        return path

    def plan(self, recipe: str, overrides: tuple[str, ...] = (), threads: int = 0) -> TrainTask:
        """The run ``trained(recipe, overrides)`` gives, as a task for the training schedule, with the
        torch threads it trains with: its config's ``train.threads``, else ``threads``, else this
        process's (as ``trained`` would use)."""
        config = load_recipe(recipe, self.profile, list(overrides))
        return TrainTask(config, str(self.runs_root), self.device, self.tracker, config.train.threads or threads or torch.get_num_threads())

    def trained(self, recipe: str, overrides: tuple[str, ...] = ()) -> Run:
        """The run of ``recipe`` under this profile, trained now unless already finished."""
        config = load_recipe(recipe, self.profile, list(overrides))
        if not (self.runs_root / f"{config.name}-{config.digest()}" / "model.safetensors").exists():
            check_training_fits(config, self.device)  # before its run directory is made
        run = Run.create(config, self.runs_root)
        if not run.finished:
            with self.stage(f"train {run.path.name}"), step_bar(f"train {run.path.name}", run.config.train.steps) as update:
                train(run, update, self.device, self.tracker)
        return run


Experiment = Callable[[Context], None]  # may carry ``runs(ctx) -> list[TrainTask]``: the runs it needs, for the schedule


def reproduce(out: Path, profile: str, experiments: dict[str, Experiment], executor: Executor = Executor(),
              device: str = "auto", tracker: str = "none") -> Context:
    """Train every run the experiments declare (``runs``) on ``executor``'s local pool first
    (``schedule``), then run each experiment (their sweeps on ``executor``; training on ``device``,
    also logged to ``tracker``), then write ``claims.json``, ``timings.json`` and ``report.html``."""
    from taskgeom.report.html import write_report

    ctx = Context(Path(out), profile, executor, device, tracker)
    ctx.out.mkdir(parents=True, exist_ok=True)
    tasks = [task for experiment in experiments.values() for task in getattr(experiment, "runs", lambda _: [])(ctx)]
    if tasks and executor.kind == "local" and executor.workers > 1:  # one schedule: every run trained first, together
        console.log("[bold]training[/bold] every run the experiments need")
        ctx.experiment = "schedule"
        with ctx.timings.experiment("schedule"):
            train_all(tasks, executor, ctx.timings)
    for name, experiment in experiments.items():
        console.log(f"experiment [bold]{name}[/bold]")
        ctx.experiment = name
        with ctx.timings.experiment(name):
            experiment(ctx)
    atomic_write_json(ctx.out / "claims.json", [c.as_dict() for c in ctx.claims])
    atomic_write_json(ctx.out / "timings.json", ctx.timings.as_dict())
    atomic_write_text(ctx.out / "report.html", write_report(ctx))
    return ctx
