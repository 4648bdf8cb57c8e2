"""Each kind of a reproduction's work beside its floor, and its wall time beside the busy-cores bound.

A kind's floor is the CPU seconds its arithmetic takes at this machine's large-matrix rate
(``training.timing.matmul_rate``: a 512 x 512 float32 product on one thread; or ``--rate``):

- ``train``: 6 x parameters x tokens of each run trained (``schedule.plan_table``);
- ``dual``, ``m1``, ``e4``: the FLOPs of the matrix products the analysis runs (forward passes, the
  V searches' and E4's probe's backward passes, attention; ``count_flops``), counted while the
  analysis runs once, on a copy of a run of the reproduction (nothing in RESULTS is written): the
  dual analysis and M1 on one run per recipe (the first in RESULTS' plan that has the analysis), E4's
  measurement on seed 0; the other runs of the recipe are taken to cost the same (they read the same
  protocol sizes; the V searches stop after a varying number of steps). Linear algebra that is not a
  layer's product (fits, SVD, pseudo-inverses, least squares) and elementwise work are not counted:
  the floor is a lower bound.

What holds a kind above its floor is first the size of its products: the models' own are narrow
(an inner dimension of 64 at quick). So the report also times, for each recipe's model, the forward
products of one training batch (``shape_rate``: the batch's tokens through each block's four linear
maps, at one thread) and prints that rate beside the large-matrix one, with training's ratio to the
floor at that rate.

The counts are kept in ``--counts`` (JSON, keyed by the run and kind) and read back by a later
report. Each kind's CPU seconds are those RESULTS' ``timings.json`` records; the table prints their
ratio to the floor. The wall bound is the reproduction's CPU seconds over this machine's cores: the
wall time if every core had been busy to the end.

    python benchmarks/floor_distance.py RESULTS [--rate GFLOPS] [--counts floor-counts.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from taskgeom.settings.kernels import use_portable_kernels

STAGE_KINDS = {("schedule", "train"): "train", ("schedule", "analyse"): "dual", ("m1", "analyse"): "m1"}


def stage_seconds(timings: dict) -> pd.DataFrame:
    """One row per timed stage of a kind: kind, run (E4: its seed), CPU and wall seconds."""
    rows = []
    for stage in timings["stages"]:
        words = stage["stage"].split()
        kind = STAGE_KINDS.get((stage["experiment"], words[0]))
        if kind is not None:
            rows.append({"kind": kind, "unit": words[1], "cpu_s": stage["cpu_s"], "wall_s": stage["wall_s"]})
        elif stage["experiment"] == "e4":
            seed = re.search(r"seed (\d+)\)", stage["stage"])
            unit = f"seed {seed.group(1) if seed else '?'}"
            rows.append({"kind": "e4", "unit": unit, "cpu_s": stage["cpu_s"], "wall_s": stage["wall_s"]})
    return pd.DataFrame(rows, columns=["kind", "unit", "cpu_s", "wall_s"])


def count_flops(work) -> int:
    """The FLOPs of the matrix products of ``work()``: every ``nn.Linear`` call (2 x rows x in x out)
    and every attention of a taskgeom ``Attention`` (2 x 2 x B x T^2 x D, scores and mixing), each
    counted again for each gradient its backward pass computes (of the inputs where they require
    one, of the weights where they do: the V searches, E4's probe training); counted by global module
    hooks, which cost little beside the work."""
    import torch
    from torch import nn

    from taskgeom.models.transformer import Attention

    total = [0]

    def hook(module: nn.Module, inputs: tuple, output) -> None:
        if isinstance(module, nn.Linear):
            x = inputs[0]
            flops = 2 * (x.numel() // module.in_features) * module.in_features * module.out_features
        elif isinstance(module, Attention):
            x = inputs[0]
            B, T, D = x.shape
            flops = 4 * B * T * T * D
        else:
            return
        backward = 0
        if torch.is_grad_enabled() and getattr(output, "requires_grad", False):
            backward = int(x.requires_grad) + int(any(p.requires_grad for p in module.parameters(recurse=False)))
        total[0] += flops * (1 + backward)

    handle = nn.modules.module.register_module_forward_hook(hook)
    try:
        work()
    finally:
        handle.remove()
    return total[0]


def _copy(run_dir: Path, into: Path) -> Path:
    copy = into / run_dir.name
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("analysis"))
    return copy


def analysis_flops(results: Path, kind: str, run_name: str, profile: str) -> int:
    """FLOPs of one ``kind`` analysis of ``run_name`` (E4: the measurement of that k = -1 run's seed)
    under ``profile``'s protocol, on copies of its runs."""
    from taskgeom.analysis.protocol import measured_under
    from taskgeom.analysis.stored.dual import analyze_dual
    from taskgeom.analysis.stored.m1 import analyze
    from taskgeom.analysis.study import StudyRun
    from taskgeom.runs.folders import Run
    from taskgeom.settings.recipes import load_measure, recipe_path

    runs = results / "runs"
    measure = load_measure(recipe_path(run_name.split("-")[0]), profile)
    with tempfile.TemporaryDirectory() as tmp, measured_under(measure.analysis_protocol):
        if kind == "dual":
            run = StudyRun(Run.open(_copy(runs / run_name, Path(tmp))))
            return count_flops(lambda: analyze_dual(run, projection_sizes=measure.projection_sizes))
        if kind == "m1":
            run = StudyRun(Run.open(_copy(runs / run_name, Path(tmp))))
            return count_flops(lambda: analyze(run))
        return count_flops(lambda: _e4_measurement(runs, run_name, Path(tmp)))
    raise ValueError(kind)


def _e4_measurement(runs: Path, majors_name: str, tmp: Path) -> None:
    """E4's measurement of one seed (``studies.e4.experiment.measure_rows``) on copies of its runs:
    the k = -1 run ``majors_name``, the top diversity's run and the references' k = -1 runs of its seed."""
    from taskgeom.runs.folders import Run
    from taskgeom.studies.e4.experiment import REFERENCES, measure_rows

    opened = [Run.open(path) for path in sorted(runs.glob("e*-*")) if path.is_dir()]
    majors = next(run for run in opened if run.path.name == majors_name)
    seed = majors.config.train.seed
    mine = [run for run in opened if run.config.train.seed == seed]
    diverse = max((run for run in mine if run.config.name == "e4"), key=lambda run: run.config.task.diversity)
    references = {
        ref: next(run for run in mine if run.config.name == ref and run.config.task.diversity == -1)
        for ref in REFERENCES
    }
    copy = lambda run: Run.open(_copy(run.path, tmp))  # noqa: E731
    measure_rows(
        lambda name: contextlib.nullcontext(),
        "e4",
        copy(majors),
        copy(diverse),
        {ref: copy(run) for ref, run in references.items()},
        seed,
    )


def counted_units(plan: pd.DataFrame, seconds: pd.DataFrame) -> dict[tuple[str, str], str]:
    """{(kind, recipe): the run whose analysis is counted}: per recipe, the first run of the plan
    with a timed analysis of the kind (E4: the k = -1 e4 run of the smallest seed)."""
    chosen = {}
    for kind in ("dual", "m1"):
        timed = set(seconds.loc[seconds["kind"] == kind, "unit"])
        for run in plan["run"]:
            if run in timed:
                chosen.setdefault((kind, run.split("-")[0]), run)
    e4 = plan[(plan["recipe"] == "e4") & (plan["diversity"] == -1)].sort_values("seed")
    if len(e4) and (seconds["kind"] == "e4").any():
        chosen[("e4", "e4")] = e4["run"].iloc[0]
    return chosen


def shape_rate(config, seconds: float = 1.0) -> float:
    """FLOP/s on one thread (per CPU second, as ``matmul_rate``) of the forward products of one training
    batch of ``config``'s model: its batch x sequence-length tokens through a block's query-key-value,
    output, MLP-in and MLP-out maps (float32, ``torch.nn.functional.linear`` as the model calls it)."""
    import time

    import torch

    from taskgeom.settings.devices import torch_threads

    rows, D, mlp = config.train.batch_size * config.task.seq_len, config.model.d_model, config.model.d_mlp
    shapes = [(D, 3 * D), (D, D), (D, mlp), (mlp, D)]  # (in, out)
    maps = [(torch.randn(rows, i), torch.randn(o, i)) for i, o in shapes]
    flops = sum(2 * rows * i * o for i, o in shapes)
    with torch_threads(1):
        for x, w in maps:  # warm up
            torch.nn.functional.linear(x, w)
        count, start, cpu = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < seconds:
            for x, w in maps:
                torch.nn.functional.linear(x, w)
            count += 1
        spent = time.process_time() - cpu
    return flops * count / max(spent, 1e-9)


def report(results: Path, rate: float, counts_path: Path) -> pd.DataFrame:
    """The table: per kind, CPU seconds, floor CPU seconds and their ratio."""
    from taskgeom.experiments import planned_runs
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.schedule import plan_table

    manifest = json.loads((results / "reproduction.json").read_text())
    timings = json.loads((results / "timings.json").read_text())
    ctx = Context(results, manifest["profile"], tuple(manifest["seeds"]), overrides=tuple(manifest["overrides"]))
    plan = plan_table(planned_runs(ctx))
    seconds = stage_seconds(timings)
    counts = json.loads(counts_path.read_text()) if counts_path.exists() else {}
    for (kind, recipe), run in counted_units(plan, seconds).items():
        key = f"{kind} {run}"
        if key not in counts:
            print(f"counting the FLOPs of {kind} on {run} ...", flush=True)
            counts[key] = analysis_flops(results, kind, run, manifest["profile"])
            counts_path.write_text(json.dumps(counts, indent=1))
    flops_per_recipe = {(key.split()[0], key.split()[1].split("-")[0]): value for key, value in counts.items()}
    train_flops = plan.set_index("run")["flops"]
    rows = []
    for kind, group in seconds.groupby("kind", sort=False):
        if kind == "train":
            floor = sum(train_flops[unit] for unit in group["unit"] if unit in train_flops.index)
        else:
            recipes = ["e4" if kind == "e4" else unit.split("-")[0] for unit in group["unit"].unique()]
            floor = sum(flops_per_recipe.get((kind, recipe), float("nan")) for recipe in recipes)
        cpu = float(group["cpu_s"].sum())
        rows.append(
            {
                "kind": kind,
                "units": group["unit"].nunique(),
                "cpu_s": round(cpu, 1),
                "floor_cpu_s": round(floor / rate, 1),
                "ratio": round(cpu / (floor / rate), 2),
            }
        )
    return pd.DataFrame(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a reproduction's folder (its runs/ are needed to count)")
    parser.add_argument(
        "--rate", type=float, help="GFLOP/s a thread of the machine that ran it (default: this machine's probe)"
    )
    parser.add_argument("--counts", type=Path, default=Path("floor-counts.json"), help="where the FLOP counts are kept")
    args = parser.parse_args()
    use_portable_kernels()
    from taskgeom.training.timing import matmul_rate

    rate = args.rate * 1e9 if args.rate else matmul_rate(2.0)
    table = report(args.results, rate, args.counts)
    total = json.loads((args.results / "timings.json").read_text())["total"]
    cores = os.cpu_count() or 1
    bound = total["cpu_s"] / cores
    print(f"large-matrix rate {rate / 1e9:.0f} GFLOP/s a thread; {cores} cores")
    print(table.to_string(index=False))
    print(
        f"wall {total['wall_s']:.0f} s beside the busy-cores bound {bound:.0f} s "
        f"({total['cpu_s']:.0f} CPU-s / {cores} cores): {total['wall_s'] / bound:.2f}x"
    )
    shapes, floor = shape_table(args.results, rate)
    print(shapes.to_string(index=False))
    train_cpu = float(table.loc[table["kind"] == "train", "cpu_s"].sum())
    print(
        f"training {train_cpu:.0f} CPU-s beside its floor at its models' own product rates, {floor:.0f} CPU-s: "
        f"{train_cpu / floor:.2f}x"
    )


def shape_table(results: Path, rate: float) -> tuple[pd.DataFrame, float]:
    """(per recipe of RESULTS' plan, its model's training-shape product rate, ``shape_rate``, beside the
    large-matrix ``rate``; the CPU seconds of training's FLOPs at each run's recipe's rate)."""
    from taskgeom.experiments import planned_runs
    from taskgeom.experiments.base import Context
    from taskgeom.experiments.schedule import plan_table

    manifest = json.loads((results / "reproduction.json").read_text())
    ctx = Context(results, manifest["profile"], tuple(manifest["seeds"]), overrides=tuple(manifest["overrides"]))
    tasks = {task.name: task for task in planned_runs(ctx)}
    plan = plan_table(list(tasks.values()))
    rates = {}
    for recipe, group in plan.groupby("recipe"):
        rates[recipe] = shape_rate(tasks[group["run"].iloc[0]].config)
    floor = sum(row.flops / rates[row.recipe] for row in plan.itertuples())
    rows = [
        {"recipe": recipe, "training-shape GFLOP/s": round(r / 1e9, 1), "of the large-matrix rate": round(r / rate, 2)}
        for recipe, r in rates.items()
    ]
    return pd.DataFrame(rows), floor


if __name__ == "__main__":
    main()
