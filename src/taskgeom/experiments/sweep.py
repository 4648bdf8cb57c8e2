"""Diversity x seed sweeps: train and analyse one run per (recipe, k, seed) on a process pool or Ray.

Finished runs and finished analyses are skipped, so a killed sweep restarted redoes only what is
unfinished; one failing run is recorded with its error and does not stop the others. The result
is one row per run (``sweep.csv``) and one row per (run, training step) of the measurements
repeated on the weight snapshots (``by_step.csv``).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from taskgeom.analysis.measures.task_vectors import check_major_tasks
from taskgeom.analysis.protocol import Protocol, measured_under
from taskgeom.analysis.stored.rows import by_step
from taskgeom.errors import RunLockedError, TaskgeomError
from taskgeom.experiments.executors import Executor, execute
from taskgeom.progress import console, job_bar
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import atomic_write_text
from taskgeom.settings.config import RunConfig
from taskgeom.settings.recipes import DEFAULT_PROFILE, MeasureSettings, load_measure, load_recipe, recipe_path
from taskgeom.training.memory import check_training_fits
from taskgeom.training.timing import Clock


@dataclass(frozen=True)
class Job:
    """One run of a sweep: its recipe, diversity k, seed, profile, overrides and run root, and
    where it trains (``device``) and what it also logs to (``tracker``), as in ``train.train``."""

    recipe: str
    diversity: int
    seed: int
    profile: str = DEFAULT_PROFILE
    root: str = "runs"
    overrides: tuple[str, ...] = ()
    device: str = "auto"
    tracker: str = "none"

    @property
    def name(self) -> str:
        """The recipe's name in the tables: the file's stem for a recipe given as a file."""
        path = Path(self.recipe)
        return path.stem if path.suffix in (".yaml", ".yml") else self.recipe

    def config(self) -> RunConfig:
        return load_recipe(
            self.recipe, self.profile, [*self.overrides, f"task.diversity={self.diversity}", f"train.seed={self.seed}"]
        )

    def measure(self) -> MeasureSettings:
        """What the profile of the job's recipe measures (the sizes of projection R^2)."""
        return load_measure(recipe_path(self.recipe), self.profile)

    def protocol(self) -> Protocol:
        """The protocol its analysis measures under: the study's, with its profile's sample sizes."""
        return self.measure().analysis_protocol

    def for_ray(self, gpus_per_run: float) -> "Job":
        """This job as a Ray task runs it: its root (and its recipe, when that is a file) as
        absolute paths, which mean the same in any worker's working directory, and its device
        fitted to the GPUs the task declares. Ray hides no GPU from a task that declares none, so
        ``auto`` becomes ``cpu`` there (else every such task would crowd onto GPU 0)."""
        recipe = Path(self.recipe)
        device = self.device
        if device.startswith("cuda") and not gpus_per_run:
            raise TaskgeomError(
                f"--device {device} on Ray needs --gpus-per-run above 0, so that Ray gives each run a GPU"
            )
        if device.startswith("cuda:"):
            raise TaskgeomError(
                f"--device {device}: on Ray each run uses the GPU Ray assigns it; say --device cuda or auto"
            )
        if device == "auto" and not gpus_per_run:
            device = "cpu"
        return replace(
            self,
            root=str(Path(self.root).resolve()),
            recipe=str(recipe.resolve()) if recipe.is_file() else self.recipe,
            device=device,
        )


def run_job(job: Job, threads: int = 0) -> list[dict]:
    """Train (or resume) and analyse one run; returns its tidy dual-mode rows, or one row with
    status ``failed`` and the error."""
    from taskgeom.analysis.stored.dual import analyze_dual, load_dual
    from taskgeom.analysis.study import StudyRun
    from taskgeom.training.train import train

    try:
        if threads:
            torch.set_num_threads(threads)
        config = job.config()
        if not (Path(job.root) / f"{config.name}-{config.digest()}" / "model.safetensors").exists():
            check_training_fits(config, job.device)  # on the node that trains it, before its run directory is made
        run = Run.create(config, job.root)
        clock = Clock()
        train(run, device=job.device, tracker=job.tracker)
        trained = clock.lap()
        sizes = job.measure().projection_sizes
        with measured_under(job.protocol()):
            rows = load_dual(run, sizes) or analyze_dual(StudyRun(run), projection_sizes=sizes)
        analysed = clock.lap()
        seconds = {
            "train_wall_s": trained[0],
            "train_cpu_s": trained[1],
            "analysis_wall_s": analysed[0],
            "analysis_cpu_s": analysed[1],
        }
        return [{"run": str(run.path), "status": "ok", **row, **seconds} for row in rows]
    except RunLockedError as err:  # another process is training this run: said as such, not retried here
        return [{"status": "locked", "error": str(err)}]
    except Exception as err:  # one failing run must not stop the sweep
        return [{"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}]


def job_seconds(table: pd.DataFrame) -> pd.DataFrame:
    """One row per finished job: recipe, diversity, seed, run directory and the wall and CPU seconds of its
    training and analysis (measured in the process that ran it; near zero when reused)."""
    columns = ["recipe", "diversity", "seed", "run", "train_wall_s", "train_cpu_s", "analysis_wall_s", "analysis_cpu_s"]
    if not set(columns) <= set(table.columns):
        return pd.DataFrame(columns=columns)
    ok = table[table["status"] == "ok"]
    return ok.drop_duplicates(["recipe", "diversity", "seed"])[columns].reset_index(drop=True)


def check_jobs(jobs: list[Job], local: bool = True) -> None:
    """Validate every job's config before any work starts: its major tasks span a task subspace and,
    when it trains on this machine (``local``), it fits the device (a Ray task's node and device are
    known only there)."""
    for job in jobs:
        settings = job.config()
        check_major_tasks(settings.task.n_major, f"sweep of {job.recipe} (k = {job.diversity}, seed {job.seed})")
        if local:
            check_training_fits(settings, job.device)


def run_sweep(jobs: list[Job], executor: Executor = Executor(), out: Path | None = None) -> pd.DataFrame:
    """Run every job on ``executor`` and gather their rows, each tagged with its job; with ``out``,
    also write ``sweep.csv`` (one row per run) and ``by_step.csv`` there. On Ray the run
    directories are made under each job's root as an absolute path, which every worker must see."""
    rows: list[dict] = []
    submitted = {job.for_ray(executor.gpus_per_run) if executor.kind == "ray" else job: job for job in jobs}
    with job_bar("sweep", len(submitted)) as advance:
        for located, result in execute(run_job, list(submitted), executor):
            job = submitted[located]
            if isinstance(result, BaseException):  # the process running the job died
                result = [{"status": "failed", "error": f"{type(result).__name__}: {result}"}]
            rows += [{"recipe": job.name, "diversity": job.diversity, "seed": job.seed, **row} for row in result]
            advance(f"{job.name} k={job.diversity} seed={job.seed}")
    table = pd.DataFrame(rows)
    for row in table[table["status"] != "ok"].drop_duplicates(["recipe", "diversity", "seed"]).itertuples():
        console.print(f"[red]{row.status}[/red] {row.recipe} k={row.diversity} seed={row.seed}: {row.error}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "sweep.csv", summary(table).to_csv(index=False))
        if "step" in table:
            atomic_write_text(out / "by_step.csv", by_step(table).to_csv(index=False))
    return table


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run: a column per metric (``metric@set`` where the metric has a set; a share of
    gain is empty where its gain is not positive), and per set with shares of in-context gain the
    gain they divide by (``gain@set``), whether it is below ``MIN_RELIABLE_GAIN``
    (``unreliable@set``) and why a share is empty (``reason@set``)."""
    keys = ["recipe", "diversity", "seed", "status"]
    ok = (
        table[(table["status"] == "ok") & table["step"].isna()] if {"step", "metric"} <= set(table) else table.iloc[0:0]
    )
    if not ok.empty:
        ok = ok[~ok["metric"].str.startswith("table.")]  # per-place tables stay in dual.json
    if ok.empty:  # no run finished: one row per run with its error
        return table.drop_duplicates(keys)[[k for k in [*keys, "error"] if k in table]]
    name = ok["metric"] + ok["set"].map(lambda s: f"@{s}" if isinstance(s, str) else "")
    wide = ok.assign(name=name).groupby([*keys, "name"])["value"].mean().unstack("name")
    if "gain" in ok:
        shares = ok[ok["gain"].notna()].groupby([*keys, "set"])
        gains = pd.DataFrame(
            {
                "gain": shares["gain"].first(),
                "unreliable": shares["unreliable"].first(),
                "reason": shares["reason"].first(),
            }
        ).unstack("set")
        gains.columns = [f"{field}@{set_name}" for field, set_name in gains.columns]
        wide = wide.join(gains)
    wide = wide.reset_index()
    wide.columns.name = None
    failed = table[table["status"] != "ok"].drop_duplicates(keys)[[k for k in [*keys, "error"] if k in table]]
    return pd.concat([wide, failed], ignore_index=True).sort_values(["recipe", "diversity", "seed"])
