"""The experiments behind ``taskgeom reproduce``: every registered experiment
(``claims.registry``: the generic ones, the recipes' own studies, a plugin's) that a recipe's
``study`` section declares, in the registry's order; each adds claims and figures. ``reproduce``
trains the runs they need (``planned_runs``), runs them on one ``base.Context`` and writes what
they produced."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from taskgeom.analysis.measures.task_vectors import check_major_tasks
from taskgeom.analysis.protocol import EARLIER, measured_under
from taskgeom.claims.catalog import with_preconditions
from taskgeom.claims.registry import Experiment
from taskgeom.claims.registry import experiments as registered
from taskgeom.claims.rules import over_seeds
from taskgeom.errors import ResultsLockedError
from taskgeom.experiments.base import Context, shipped_studies
from taskgeom.experiments.executors import Executor
from taskgeom.experiments.schedule import TrainTask, train_all
from taskgeom.progress import console
from taskgeom.report.manifest import MANIFEST, manifest
from taskgeom.runs.storage import atomic_write_json, exclusive_lock
from taskgeom.settings.config import ConfigError
from taskgeom.settings.recipes import Study
from taskgeom.tasks import TaskFamily
from taskgeom.tasks.registry import family_class


def declarations() -> dict[str, tuple[str, ...]]:
    """{experiment: the family declarations its analyses read} (``Experiment.reads``), for those that read any."""
    return {name: experiment.reads for name, experiment in registered().items() if experiment.reads}


def undeclared(family: type[TaskFamily], experiments: Iterable[str] | None = None) -> dict[str, str]:
    """{declaration: the experiment that reads it} for what ``experiments`` (by default every
    registered one) read that ``family`` declares none of."""
    reads = declarations()
    return {
        name: experiment
        for experiment in (reads if experiments is None else experiments)
        for name in reads.get(experiment, ())
        if getattr(family, name) is None
    }


def check_declarations(tasks: Iterable[TrainTask], experiment: str) -> None:
    """ConfigError, before anything is trained, naming every declaration that ``experiment`` reads and
    the family of one of its runs ``tasks`` lacks (``undeclared``)."""
    missing = {}
    for task in tasks:
        family = family_class(task.config.task.family)
        for name in undeclared(family, (experiment,)):
            missing.setdefault(family.name, {})[name] = task.config.name
    if missing:
        said = "; ".join(
            f"the {family!r} family (recipe {', '.join(sorted(set(recipes.values())))}) declares no {', '.join(recipes)}"
            for family, recipes in missing.items()
        )
        raise ConfigError(
            f"experiment {experiment} reads what {said} (TaskFamily, docs/adding-a-family.md): set it on the family class, "
            f"or leave {experiment} out with --only"
        )


def declared(studies: tuple[Study, ...], profile: str) -> dict[str, Experiment]:
    """The registered experiments ``studies`` take part in at ``profile``, in the registry's order;
    ConfigError for a name no experiment is registered under."""
    known = registered()
    unknown = sorted({name for study in studies for name in study.experiments} - set(known))
    if unknown:
        owners = sorted(study.name for study in studies if set(study.experiments) & set(unknown))
        raise ConfigError(
            f"recipes {owners}: unknown experiments {unknown}; registered: {list(known)} "
            "(an experiment from another package joins through the entry-point group taskgeom.experiments)"
        )
    return {
        name: experiment
        for name, experiment in known.items()
        if any(study.takes_part(name, profile) for study in studies)
    }


def _declared(ctx: Context) -> dict[str, Experiment]:
    """The experiments ``ctx``'s studies declare at its profile (``declared``)."""
    return declared(ctx.studies, ctx.profile)


def runs_by_experiment(ctx: Context, experiments: dict[str, Experiment] | None = None) -> dict[str, list[TrainTask]]:
    """{experiment: the runs it declares for ``ctx`` (its ``runs``)} for the experiments (by default
    those ``ctx``'s studies declare), in order."""
    experiments = _declared(ctx) if experiments is None else experiments
    return {name: experiment.runs(ctx) for name, experiment in experiments.items()}


def planned_runs(ctx: Context, experiments: dict[str, Experiment] | None = None) -> list[TrainTask]:
    """Every run the experiments (by default those ``ctx``'s studies declare) declare for ``ctx``
    (``runs``), in order; a run two experiments need appears once for each."""
    return [task for tasks in runs_by_experiment(ctx, experiments).values() for task in tasks]


RESULTS_LOCK = ".taskgeom.lock"  # in the results folder: held by the one reproduction writing it


def reproduce(
    out: Path,
    profile: str,
    experiments: dict[str, Experiment] | None = None,
    executor: Executor = Executor(),
    device: str = "auto",
    tracker: str = "none",
    overrides: tuple[str, ...] = (),
    seeds: tuple[int, ...] = (0,),
    studies: tuple[Study, ...] | None = None,
    diversities: tuple[int, ...] | None = None,
    forms: dict | None = None,
) -> Context:
    """Train every run the experiments declare (``runs``) for every seed of ``seeds`` on
    ``executor``'s local pool first (``schedule``), with the measurements they store
    (``prepare``) beside, then run each experiment (their sweeps on
    ``executor``; training on ``device``, also logged to ``tracker``; every recipe with
    ``overrides`` applied first; the recipes of ``studies``, by default the shipped ones; the sweeps
    over ``diversities`` when given), judge each claim over the seeds, then write ``claims.json``,
    ``timings.json``, ``reproduction.json``, the tables and ``report.html``. ``experiments``: by
    default those the studies declare at ``profile`` (``declared``). One reproduction writes a
    folder at a time: a second one into ``out`` is refused (``ResultsLockedError``, exit code 3)
    before it trains or writes anything, so the manifests always come whole from one process.
    ``forms``: ``protocol.EARLIER``'s choices to measure and judge under where not the study's (the
    claims' forms, the V search; ``request.rejudge``)."""
    from taskgeom.report.html import write_report

    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and at least one, got {list(seeds)}")
    ctx = Context(
        Path(out),
        profile,
        tuple(seeds),
        executor,
        device,
        tracker,
        tuple(overrides),
        shipped_studies() if studies is None else tuple(studies),
        None if diversities is None else tuple(diversities),
        forms=dict(forms or {}),
    )
    experiments = _declared(ctx) if experiments is None else experiments
    protocol = ctx.protocol  # the profile's sample sizes, checked before anything is written or trained
    planned = runs_by_experiment(ctx, experiments)
    for name, runs in planned.items():  # before anything is written or trained
        check_declarations(runs, name)
    tasks = [task for runs in planned.values() for task in runs]
    for task in tasks:  # every experiment measures in the task subspace: refuse before anything is written
        check_major_tasks(task.config.task.n_major, f"reproduce ({task.config.name}, k = {task.config.task.diversity})")
    ctx.out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(
        ctx.out / RESULTS_LOCK, f"results folder {ctx.out}", refused=ResultsLockedError
    ):  # one writer a folder
        ctx.used |= {task.name: None for task in tasks}
        if (
            tasks and executor.kind == "local" and executor.workers > 1
        ):  # one schedule: every run trained first, together, and the stored measurements beside
            console.log("[bold]training[/bold] every run the experiments need, and measuring beside")
            ctx.experiment = "schedule"
            with ctx.timings.experiment("schedule"), measured_under(protocol):
                prepared = [
                    item
                    for experiment in experiments.values()
                    if experiment.prepare
                    for item in experiment.prepare(ctx)
                ]
                train_all(tasks, executor, ctx.timings, prepared)
        for name, experiment in experiments.items():
            console.log(f"experiment [bold]{name}[/bold]")
            ctx.experiment = name
            first = len(ctx.measured)
            with ctx.timings.experiment(name), measured_under(protocol):
                experiment(ctx)
            ctx.made_by |= {claim.id: name for _, claim in ctx.measured[first:]}
        ctx.claims = over_seeds(with_preconditions(ctx.measured))
        atomic_write_json(ctx.out / "claims.json", [c.as_dict() for c in ctx.claims])
        atomic_write_json(ctx.out / "timings.json", ctx.timings.as_dict())
        figures = [
            {
                "path": f.path,
                "pdf": str(Path(f.path).with_suffix(".pdf")),
                "caption": f.caption,
                "experiment": f.experiment,
                "claims": list(f.claims),
            }
            for f in ctx.figures
        ]
        sections = {study.name: study.section for study in ctx.studies}
        atomic_write_json(
            ctx.out / MANIFEST,
            manifest(
                profile,
                ctx.overrides,
                device,
                executor.kind,
                list(experiments),
                list(ctx.used),
                ctx.made_by,
                figures,
                ctx.seeds,
                ctx.runs_root,
                sections,
                {name: getattr(ctx.protocol, name) for name in EARLIER},
                ctx.diversities,
            ),
        )
        write_report(ctx.out)
    return ctx


__all__ = [
    "Context",
    "check_declarations",
    "declarations",
    "declared",
    "planned_runs",
    "reproduce",
    "runs_by_experiment",
    "undeclared",
]
