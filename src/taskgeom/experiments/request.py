"""What ``taskgeom reproduce`` is asked to do (``Request``), checked and resolved before anything
runs: the recipes (the shipped ones and ``--recipe`` files, narrowed by ``--recipes`` and
``--only``), the experiments, a data variant's recipes and settings; then either its plan
(``plan_text``: the runs it reads, what is left of each and the time that would take here) or the reproduction
itself (``run``); or a finished reproduction's claims judged again under other claim forms
(``rejudge``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from taskgeom import experiments
from taskgeom.analysis.measures.variants import BY_NAME, DATA_VARIANTS, JUDGED_VARIANTS
from taskgeom.claims.registry import Experiment
from taskgeom.claims.registry import experiments as registered
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.base import Context, shipped_studies
from taskgeom.experiments.executors import Executor
from taskgeom.report.manifest import read_manifest, recorded_choices
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
    known = set(registered()) | {name for study in everything for name in study.experiments}
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
        f"left (a reproduction reads back what is stored): {table['train'].sum()} runs to train"
        f"{''.join(f', {table[name].sum()} units of {name}' for name in table.attrs['left'])}\n"
        f"estimated wall time here: {wall / 60:.0f} min on {workers} worker(s) (training and the analyses beside it "
        f"{(wall - main) / 60:.0f} min{f', then the other analyses in this process {main / 60:.0f} min' if main else ''}; {cpu_model()}, "
        f"{usable_cores()} usable cores, matrix-multiply probe {rate / 1e9:.0f} GFLOP/s a thread); each kind's cost per "
        f"training FLOP fitted on one quick reproduction (a 2-core AVX2 EPYC), deeper models scaled by their blocks: "
        f"it errs long there, and on another CPU it may be off by a half\n"
    )


def work_left(ctx: Context, chosen: dict[str, Experiment], rate: float) -> pd.DataFrame:
    """``schedule.plan_table``'s row of every run the experiments ``chosen`` read, with what is left of
    it: ``train`` (not trained yet) and a column per experiment that stores its measurement, the
    number of its units left on that run (``Experiment.left``: the dual sweep's analyses, the M1
    results, E4's seeds; their names in ``attrs["left"]``); and the CPU seconds estimated here for
    them at the probe's ``rate`` (``timing.TRAIN_COST_PER_FLOP_SECOND`` and each experiment's
    ``cost``; analyses scaled by ``depth_factor``): ``cpu_pool_s`` on the schedule's pool,
    ``cpu_main_s`` in this process."""
    from taskgeom.analysis.protocol import measured_under
    from taskgeom.experiments.schedule import plan_table
    from taskgeom.training.timing import TRAIN_COST_PER_FLOP_SECOND, depth_factor

    by_experiment = experiments.runs_by_experiment(ctx, chosen)
    tasks = [task for tasks in by_experiment.values() for task in tasks]
    table = plan_table(tasks)
    trained = {task.name: (task.path / "model.safetensors").exists() for task in tasks}
    with measured_under(ctx.protocol):  # stored results are keyed by the profile's protocol
        left = {name: experiment.left(ctx) for name, experiment in chosen.items() if experiment.left is not None}
    table["train"] = ~table["run"].map(trained)
    flop_s = table["flops"] / rate
    depth = table["run"].map({task.name: depth_factor(task.config.model.n_layers) for task in tasks})
    table["cpu_pool_s"] = flop_s * TRAIN_COST_PER_FLOP_SECOND * table["train"]
    table["cpu_main_s"] = 0.0
    for name, runs in left.items():  # one unit per listed run
        experiment = chosen[name]
        table[name] = table["run"].map(runs.count)
        table["cpu_pool_s" if experiment.on_pool else "cpu_main_s"] += flop_s * experiment.cost * depth * table[name]
    table = table[[c for c in table.columns if not c.startswith("cpu_")] + ["cpu_pool_s", "cpu_main_s"]]
    table.attrs["left"] = list(left)
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


def rejudge(results: Path, out: Path, variant: str) -> Context:
    """The claims of the finished reproduction in ``results`` judged again under the claims' forms of
    the judged variant ``variant`` (``variants.JUDGED_VARIANTS``), from its stored analyses, into
    ``out`` (claims.json, the manifest with its ``forms``, figures and report; ``taskgeom compare
    RESULTS OUT`` sets them side by side). Its profile, seeds, settings, recipes and grid are the
    manifest's; ``out/runs`` and each folder of ``results/analysis`` (E4's stored seeds) are links to
    ``results``' (nothing is left to
    train or measure there: only the evaluations every reproduction computes again are written
    through them, the same bytes). TaskgeomError, before anything is
    written, naming a variant that is not a judged one, or the runs and analyses that are missing."""
    if variant not in JUDGED_VARIANTS:
        raise TaskgeomError(
            f"{variant!r} is no variant of the claims' forms; `taskgeom rejudge` takes {', '.join(JUDGED_VARIANTS)} "
            "(the variants of the measurement are `taskgeom sensitivity`'s)"
        )
    results, out = Path(results).resolve(), Path(out)
    found = read_manifest(results)
    if out.exists() and any(out.iterdir()):
        raise TaskgeomError(f"--out {out} is not empty; judge again into a new folder")
    studies = tuple(study for study in shipped_studies() if study.name in found["recipes"])
    unknown = sorted(set(found["recipes"]) - {study.name for study in studies})
    if unknown:
        raise TaskgeomError(
            f"{results} measured the recipes {', '.join(unknown)}, which are not shipped; rejudge judges the shipped "
            "recipes' reproductions"
        )
    chosen = {name: registered()[name] for name in found["experiments"]}
    settings = {
        "profile": found["profile"],
        "seeds": tuple(found["seeds"]),
        "overrides": tuple(found["overrides"]),
        "studies": studies,
        "diversities": None if found.get("grid") is None else tuple(found["grid"]),
    }
    recorded = recorded_choices(found)  # the forms and V search it was measured and judged under
    source = Context(results, executor=Executor(workers=1), forms=recorded, **settings)
    table = work_left(source, chosen, rate=1.0)
    missing = table[table["train"] | (table[table.attrs["left"]].sum(axis=1) > 0)]["run"].tolist()
    if missing:
        raise TaskgeomError(
            f"{results} lacks the stored runs or analyses of {', '.join(missing)} (under this taskgeom's protocol); "
            f"`taskgeom reproduce --out {results}` measures them, then judge again"
        )
    (out / "analysis").mkdir(parents=True, exist_ok=True)
    (out / "runs").symlink_to(results / "runs", target_is_directory=True)
    for stored in (results / "analysis").iterdir():
        if stored.is_dir():
            (out / "analysis" / stored.name).symlink_to(stored, target_is_directory=True)
    return experiments.reproduce(
        out, executor=source.executor, experiments=chosen, forms={**recorded, **BY_NAME[variant].fields}, **settings
    )
