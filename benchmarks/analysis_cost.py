"""Each analysis's seconds on a finished run against the run's own training, in one process.

For each finished run directory (a reproduction's, at any profile), at one thread count:

- the baseline: ``--steps`` training steps of the run's own config, trained from scratch in a
  temporary folder, scaled to the run's steps (its training time, estimated);
- the M1 analysis (``experiments.m1.analyze_one``: P0-P3 and steering, m1.json) and the dual
  analysis (``analysis.stored.dual.analyze_dual``: projection R^2, the S and V ablations, probes,
  dual.json), each timed on a copy of the run, so the run itself is never written;
- for an E4 run instead, its P0 as the study's variance.py measures it
  (``studies.e4.variance.study_p0``, 30 masks x 2,048 sequences per major task) and its prefix
  probe as the study's run_prefix_probe (``studies.e4.prefix.study_prefix_probe``, 10 masks x 32
  sequences per task of the pool, the probe and its shuffled-label control trained 2,000 epochs);
  neither writes anything. A reproduction reads P0 on the k = -1 run and the probe on the grid's top.

It prints each analysis's seconds and its ratio to the training estimate. A reproduction trains
each run once and analyses it once or twice, so the ratios say what share of its wall time the
analyses take (the target: analyses under a third of a quick reproduction's wall time).

    python benchmarks/analysis_cost.py RUN_DIR [RUN_DIR ...] [--steps 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from taskgeom.analysis.stored.dual import analyze_dual
from taskgeom.analysis.study import StudyRun
from taskgeom.experiments.m1 import analyze_one
from taskgeom.runs.folders import Run
from taskgeom.studies.e4.prefix import study_prefix_probe
from taskgeom.studies.e4.variance import study_p0
from taskgeom.tasks.dyck import Dyck
from taskgeom.training.train import train


def training_seconds(run: Run, steps: int, scratch: Path) -> float:
    """Seconds to train ``run``'s config for all its steps, estimated from ``steps`` of them trained from scratch."""
    config = run.config
    short = config.model_copy(
        update={
            "train": config.train.model_copy(update={"steps": steps, "eval_every": steps, "checkpoint_every": steps})
        }
    )
    start = time.perf_counter()
    train(Run.create(short, scratch))
    return (time.perf_counter() - start) * config.train.steps / steps


def timed(analysis, run_dir: Path, scratch: Path) -> float:
    """Seconds of ``analysis(StudyRun)`` on a copy of ``run_dir`` without its stored analyses."""
    copy = scratch / run_dir.name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("analysis", "figures"))
    return seconds(lambda path: analysis(StudyRun(Run.open(path))), copy)


def seconds(analysis, argument) -> float:
    """Seconds of ``analysis(argument)``."""
    start = time.perf_counter()
    analysis(argument)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="finished run directories")
    parser.add_argument("--steps", type=int, default=50, help="training steps the baseline times")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a reproduction's sweep analyses use 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(f"{'run':<16} {'train (est.) s':>14} {'m1 s':>8} {'m1 / train':>10} {'dual s':>8} {'dual / train':>12}")
    for run_dir in args.runs:
        with tempfile.TemporaryDirectory() as scratch:
            run = Run.open(run_dir)
            base = training_seconds(run, args.steps, Path(scratch) / "baseline")
            if isinstance(run.family, Dyck):
                p0, probe = (seconds(analysis, run) for analysis in (study_p0, study_prefix_probe))
                print(
                    f"{run_dir.name:<16} {base:>14.1f}   E4 P0 (study_p0) {p0:.1f} s, {p0 / base:.2f} of training; "
                    f"prefix probe (study_prefix_probe, {run.pool.size} tasks) {probe:.1f} s, {probe / base:.2f} of training"
                )
                continue
            m1 = timed(analyze_one, run_dir, Path(scratch) / "m1")
            dual = timed(analyze_dual, run_dir, Path(scratch) / "dual")
        print(f"{run_dir.name:<16} {base:>14.1f} {m1:>8.1f} {m1 / base:>10.2f} {dual:>8.1f} {dual / base:>12.2f}")


if __name__ == "__main__":
    main()
