"""What ``taskgeom reproduce`` is asked to do (``Request``), checked and resolved before anything
runs: the recipes (the shipped ones and ``--recipe`` files, narrowed by ``--recipes`` and
``--only``), the experiments, a data variant's recipes and settings; then either its plan
(``plan_text``: the runs it reads, what is left of each and the time that would take here) or the reproduction
itself (``run``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from taskgeom import experiments
from taskgeom.analysis.measures.variants import BY_NAME, DATA_VARIANTS
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.base import Context, Experiment, Extra, shipped_studies
from taskgeom.experiments.executors import Executor
from taskgeom.settings.recipes import DEFAULT_PROFILE, Study, load_study


@dataclass(frozen=True)
class Request:
    """``taskgeom reproduce``'s options, parsed: ``recipes`` comma-separated as typed, ``only``
    experiment or recipe names, ``settings`` the ``--set`` overrides, ``data`` the name of a variant of the data (other runs)."""

    profile: str = DEFAULT_PROFILE
    seeds: tuple[int, ...] = (0, 1, 2)
    out: Path | None = None
    only: tuple[str, ...] = ()
    recipes: str | None = None
    recipe_files: tuple[Path, ...] = ()
    grid: tuple[int, ...] | None = None
    settings: tuple[str, ...] = ()
    data: str | None = None


@dataclass(frozen=True)
class Resolved:
    """A request made concrete: the output folder, the studies, the experiments chosen, the settings."""

    out: Path
    studies: tuple[Study, ...]
    experiments: dict[str, Experiment]
    settings: tuple[str, ...]


def resolve(request: Request) -> Resolved:
    """The request's output folder (default ``results``, or ``results-VARIANT``), studies, experiments
    and settings; TaskgeomError naming the option at fault."""
    recipes, settings = request.recipes, tuple(request.settings)
    if any(setting.split("=", 1)[0].strip() == "train.seed" for setting in settings):
        raise TaskgeomError(
            "--set train.seed: reproduce trains every setting on each seed of --seeds; say --seeds instead"
        )
    if request.data is not None:
        recipes, settings = data_variant(request.data, recipes, settings)
    out = request.out or default_out(request.data)
    studies, named = choose_studies(request.recipe_files, recipes, request.only, request.profile)
    chosen = {
        name: run for name, run in experiments.declared(studies, request.profile).items() if not named or name in named
    }
    return Resolved(out, studies, chosen, settings)


def default_out(data: str | None) -> Path:
    """The output folder when none is given: ``results``, or ``results-VARIANT`` for the variant of
    the data named ``data``."""
    return Path("results" if data is None else f"results-{data}")


def data_variant(name: str, recipes: str | None, settings: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """(the recipes, the ``--set`` settings) that train the data variant ``name`` (docs/protocol.md#variants): its own
    recipes (``--recipes`` may only name those) and its overrides before the user's; TaskgeomError for a
    variant of the measurement or an unknown name."""
    if name not in DATA_VARIANTS:
        kind = (
            "measures the same runs another way: list it with `taskgeom sensitivity`"
            if name in BY_NAME
            else "is no variant"
        )
        raise TaskgeomError(f"--variant: {name!r} {kind}; the variants of the data are {', '.join(DATA_VARIANTS)}")
    chosen = BY_NAME[name]
    asked = [r.strip() for r in recipes.split(",")] if recipes else list(chosen.claims)
    if set(asked) - set(chosen.claims):
        raise TaskgeomError(
            f"--recipes: {name} changes the recipes {', '.join(chosen.claims)} alone, not "
            f"{', '.join(sorted(set(asked) - set(chosen.claims)))}"
        )
    return ",".join(asked), (*chosen.overrides, *settings)


def choose_studies(
    files: tuple[Path, ...], recipes: str | None, only: tuple[str, ...], profile: str
) -> tuple[tuple[Study, ...], list[str]]:
    """(the studies ``reproduce`` measures, the experiments named by ``--only``): the shipped recipes
    and ``--recipe`` files, those of ``--recipes`` or of the recipe names among ``--only`` (a name
    that is an experiment's is the experiment) alone when given; TaskgeomError for an unknown name,
    a recipe name given twice, or a recipe without ``profile``."""
    for path in files:
        if not path.is_file():
            raise TaskgeomError(f"--recipe {path}: no such file")
    everything = [*shipped_studies(), *(load_study(path) for path in files)]
    names = [study.name for study in everything]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise TaskgeomError(
            f"--recipe: recipes named {twice} twice (a recipe's name is its file's stem); rename the file"
        )
    wanted = None if recipes is None else [r.strip() for r in recipes.split(",") if r.strip()]
    if wanted is not None and (not wanted or set(wanted) - set(names)):
        raise TaskgeomError(f"--recipes: unknown recipes {sorted(set(wanted) - set(names))}; available: {names}")
    known = set(experiments.EXPERIMENTS) | {name for study in everything for name in study.experiments}
    unknown = sorted(set(only) - set(names) - known)
    if unknown:
        raise TaskgeomError(
            f"--only: unknown experiments or recipes {unknown}; experiments: {sorted(known)}, recipes: {names}"
        )
    by_recipe = [name for name in only if name not in known]
    if by_recipe:
        wanted = [name for name in (wanted or names) if name in by_recipe]
    studies = tuple(study for study in everything if wanted is None or study.name in wanted)
    for study in studies:
        if profile not in study.profiles:
            raise TaskgeomError(
                f"unknown profile {profile!r} for recipe {study.name}; it defines {list(study.profiles)}"
            )
    return studies, [name for name in only if name in known]


def plan_text(request: Request, executor: Executor, device: str, tracker: str, csv: bool = False) -> str:
    """The runs the request reads (``schedule.plan_table``: steps, parameters, tokens, FLOPs) and what
    is left of each (``work_left``), as CSV or as a table with its totals and the wall time of the
    work left estimated on this machine."""
    from taskgeom.report.manifest import cpu_model
    from taskgeom.settings.devices import usable_cores
    from taskgeom.training.timing import estimate_wall, matmul_rate

    resolved = resolve(request)
    ctx = Context(
        resolved.out,
        request.profile,
        tuple(request.seeds),
        executor,
        device,
        tracker,
        resolved.settings,
        resolved.studies,
        request.grid and tuple(request.grid),
    )
    rate, workers = matmul_rate(), min(executor.workers, usable_cores())
    table = work_left(ctx, resolved.experiments, rate)
    if csv:
        return table.to_csv(index=False)
    pool, main = table["cpu_pool_s"], table["cpu_main_s"].sum()
    wall = estimate_wall(list(pool[pool > 0]), main, workers)
    shown = table.drop(columns=["cpu_pool_s", "cpu_main_s"])
    return (
        f"{shown.to_string(index=False)}\n"
        f"{len(table)} runs, {table['steps'].sum():,} steps, {table['tokens'].sum():.3g} tokens, "
        f"{table['flops'].sum():.3g} training FLOPs (6 x parameters x tokens)\n"
        f"left (a reproduction reads back what is stored): {table['train'].sum()} runs to train, "
        f"{table['dual'].sum()} dual analyses, {table['m1'].sum()} M1 analyses"
        f"{''.join(f', {name.upper()} on {table[name].sum()} seeds' for name in table.attrs['own'])}\n"
        f"estimated wall time here: {wall / 60:.0f} min on {workers} worker(s) (training and dual analyses "
        f"{(wall - main) / 60:.0f} min, then the M1 analyses and E4 in this process {main / 60:.0f} min; {cpu_model()}, "
        f"{usable_cores()} usable cores, matrix-multiply probe {rate / 1e9:.0f} GFLOP/s a thread); each kind's cost per "
        f"training FLOP fitted on one quick reproduction (a 2-core AVX2 EPYC), deeper models scaled by their blocks: "
        f"it errs long there, and on another CPU it may be off by a half\n"
    )


def work_left(ctx: Context, chosen: dict[str, Experiment], rate: float) -> pd.DataFrame:
    """``schedule.plan_table``'s row of every run the experiments ``chosen`` read, with what is left of
    it: ``train`` (not trained yet), ``dual`` (the sweep's runs: the dual analysis not stored under its
    version and sizes), ``m1`` (the m1 experiment's runs: the M1 result not stored for its request),
    and a column per study's own experiment that says what of it is left (``Extra.left``; ``e4``: the
    k = -1 run of each seed whose measurement is not stored; their names in ``attrs["own"]``); and the CPU seconds estimated here for
    them at the probe's ``rate`` (``timing.COST_PER_FLOP_SECOND``; analyses scaled by
    ``depth_factor``): ``cpu_pool_s`` on the schedule's pool, ``cpu_main_s`` in this process."""
    from taskgeom.analysis.stored.m1 import load as load_m1
    from taskgeom.analysis.study import StudyRun
    from taskgeom.experiments.schedule import analysed, plan_table
    from taskgeom.runs.folders import Run
    from taskgeom.training.timing import COST_PER_FLOP_SECOND as cost
    from taskgeom.training.timing import depth_factor

    by_experiment = experiments.runs_by_experiment(ctx, chosen)
    table = plan_table([task for tasks in by_experiment.values() for task in tasks])
    trained = {
        task.name: (task.path / "model.safetensors").exists() for tasks in by_experiment.values() for task in tasks
    }

    def m1_left(task) -> bool:
        try:
            return not trained[task.name] or load_m1(StudyRun(Run.open(task.path))) is None
        except TaskgeomError:  # a damaged run directory or stored result: the reproduction says so, and measures it
            return True

    dual = {task.name for task in by_experiment.get("dual_modes", []) if task.analyse and not analysed(task.path)}
    m1 = {task.name for task in by_experiment.get("m1", []) if m1_left(task)}
    own = {
        name: left
        for name, experiment in chosen.items()
        if isinstance(experiment, Extra) and (left := experiment.left(ctx)) is not None
    }
    table["train"] = ~table["run"].map(trained)
    table["dual"], table["m1"] = table["run"].isin(dual), table["run"].isin(m1)
    flop_s = table["flops"] / rate
    depth = table["run"].map(
        {task.name: depth_factor(task.config.model.n_layers) for tasks in by_experiment.values() for task in tasks}
    )
    table["cpu_pool_s"] = flop_s * (cost["train"] * table["train"] + cost["dual"] * depth * table["dual"])
    table["cpu_main_s"] = flop_s * cost["m1"] * depth * table["m1"]
    for name, runs in own.items():  # a study's own measurement, one unit per listed run (E4: each seed's k = -1 run)
        table[name] = table["run"].map(runs.count)
        table["cpu_main_s"] += flop_s * cost.get(name, 0.0) * depth * table[name]
    table = table[[c for c in table.columns if not c.startswith("cpu_")] + ["cpu_pool_s", "cpu_main_s"]]
    table.attrs["own"] = list(own)
    return table


def run(request: Request, executor: Executor, device: str, tracker: str) -> Context:
    """Reproduce what the request asks (``experiments.reproduce``), the executor checked first."""
    resolved = resolve(request)
    executor.check()  # Ray importable and its address answering, before any training
    return experiments.reproduce(
        resolved.out,
        request.profile,
        resolved.experiments,
        executor,
        device,
        tracker,
        resolved.settings,
        tuple(request.seeds),
        resolved.studies,
        request.grid,
    )
