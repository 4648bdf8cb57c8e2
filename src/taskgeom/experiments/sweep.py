"""Diversity x seed sweeps: train and analyse one run per (recipe, k, seed) on a process pool.

Finished runs and finished analyses are skipped, so a killed sweep restarted redoes only what is
unfinished; one failing run is recorded with its error and does not stop the others. The result
is one row per run (``sweep.csv``) and one row per (run, training step) of the measurements
repeated on the weight snapshots (``by_step.csv``).
"""

from __future__ import annotations

import multiprocessing
import os
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch

from taskgeom.config import RunConfig
from taskgeom.progress import console, job_bar
from taskgeom.recipes import load_recipe
from taskgeom.runs import Run
from taskgeom.storage import atomic_write_text


@dataclass(frozen=True)
class Job:
    recipe: str
    diversity: int
    seed: int
    profile: str = "quick"
    root: str = "runs"
    overrides: tuple[str, ...] = ()

    def config(self) -> RunConfig:
        return load_recipe(self.recipe, self.profile, [*self.overrides, f"task.diversity={self.diversity}", f"train.seed={self.seed}"])


def run_job(job: Job, threads: int = 0) -> list[dict]:
    """Train (or resume) and analyse one run; returns its tidy dual-mode rows, each tagged with
    the job, or one row with status ``failed`` and the error."""
    from taskgeom.analysis.dual import analyze_dual, load_dual
    from taskgeom.train import train

    tag = {"recipe": job.recipe, "diversity": job.diversity, "seed": job.seed}
    try:
        if threads:
            torch.set_num_threads(threads)
        run = Run.create(job.config(), job.root)
        train(run)
        rows = load_dual(run) or analyze_dual(run)
        return [{**tag, "run": str(run.path), "status": "ok", **row} for row in rows]
    except Exception as err:  # one failing run must not stop the sweep
        return [{**tag, "status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}]


def run_sweep(jobs: list[Job], workers: int = 2, out: Path | None = None) -> pd.DataFrame:
    """Run every job (``workers`` processes, 1 = in this process) and gather their rows; with
    ``out``, also write ``sweep.csv`` (one row per run) and ``by_step.csv`` there."""
    rows: list[dict] = []
    with job_bar("sweep", len(jobs)) as advance:
        if workers <= 1:
            for job in jobs:
                rows += run_job(job)
                advance(f"{job.recipe} k={job.diversity} seed={job.seed}")
        else:
            threads = max(1, (os.cpu_count() or 1) // workers)
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, mp_context=context) as pool:
                futures = {pool.submit(run_job, job, threads): job for job in jobs}
                for future in as_completed(futures):
                    job = futures[future]
                    try:
                        rows += future.result()
                    except Exception as err:  # the worker process itself died
                        rows.append({**asdict(job), "status": "failed", "error": f"{type(err).__name__}: {err}"})
                    advance(f"{job.recipe} k={job.diversity} seed={job.seed}")
    table = pd.DataFrame(rows)
    for row in table[table["status"] == "failed"].drop_duplicates(["recipe", "diversity", "seed"]).itertuples():
        console.print(f"[red]failed[/red] {row.recipe} k={row.diversity} seed={row.seed}: {row.error}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "sweep.csv", summary(table).to_csv(index=False))
        if "step" in table:
            atomic_write_text(out / "by_step.csv", by_step(table).to_csv(index=False))
    return table


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """One row per run: a column per metric (``metric@set`` where the metric has a set)."""
    keys = ["recipe", "diversity", "seed", "status"]
    ok = table[(table["status"] == "ok") & table["step"].isna()] if "step" in table else table.iloc[0:0]
    if ok.empty:
        return table.drop_duplicates(keys)[[k for k in [*keys, "error"] if k in table]]
    name = ok["metric"] + ok["set"].map(lambda s: f"@{s}" if isinstance(s, str) else "")
    wide = ok.assign(name=name).pivot_table(index=keys, columns="name", values="value").reset_index()
    failed = table[table["status"] == "failed"].drop_duplicates(keys)[[k for k in [*keys, "error"] if k in table]]
    return pd.concat([wide, failed], ignore_index=True).sort_values(["recipe", "diversity", "seed"])


def by_step(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, training step): projection R^2 and the predictor-transition statistics
    (``log_ratio``, ``kl_to_memorising``, ``kl_to_generalising``; token families only)."""
    rows = table[table["step"].notna()]
    wide = rows.pivot_table(index=["recipe", "diversity", "seed", "step"], columns="metric", values="value").reset_index()
    return wide.rename(columns=lambda c: c.removeprefix("transition_"))
