"""The ``taskgeom`` command line.

Every command shares one error contract (``ContractGroup``), documented in docs/cli.md and docs/practicalities.md: exit 0 done;
1 the work ran and some claims or runs failed (or training diverged); 2 bad input (config, recipe,
paths, run directories, checkpoints); 3 the environment refused (permissions, a full disk, memory,
an unreachable Ray cluster); 4 a bug in taskgeom. An error prints one line on stderr naming the
file or field; ``--debug`` (or TASKGEOM_DEBUG=1) adds the traceback.
"""

from __future__ import annotations

import errno
import os
import traceback
from pathlib import Path
from typing import List, Optional

import pandas as pd
import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from taskgeom.analysis.measures.variants import BY_NAME, DATA_VARIANTS, JUDGED_VARIANTS, MEASURED_AGAIN, STORED_VARIANTS
from taskgeom.errors import EnvironmentRefused, TaskgeomError, TrainingDiverged
from taskgeom.settings.recipes import DEFAULT_PROFILE, profiles_help

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_REFUSED, EXIT_BUG = 1, 2, 3, 4

# OSError numbers that mean a path given was wrong (exit 2); every other OSError is the environment refusing (exit 3).
_PATH_ERRNOS = {
    errno.ENOTDIR,
    errno.EISDIR,
    errno.EEXIST,
    errno.ENOENT,
    errno.ENAMETOOLONG,
    errno.ELOOP,
    errno.ENOTEMPTY,
}
_DEBUG_ENV = "TASKGEOM_DEBUG"


def classify(err: BaseException) -> tuple[int, str]:
    """(exit code, message) for an exception that ended a command; see the module docstring."""
    if isinstance(err, TrainingDiverged):
        return EXIT_FAILED, str(err)
    if isinstance(err, EnvironmentRefused):
        return EXIT_REFUSED, str(err)
    if isinstance(err, TaskgeomError):
        return EXIT_BAD_INPUT, str(err)
    if (
        isinstance(err, MemoryError)
        or type(err).__name__ == "OutOfMemoryError"
        or (
            isinstance(err, RuntimeError)
            and ("can't allocate memory" in str(err) or "out of memory" in str(err).lower())
        )
    ):
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return EXIT_REFUSED, f"out of memory{f' ({first})' if first else ''}"
    if isinstance(err, OSError):
        names = " -> ".join(str(name) for name in (err.filename, err.filename2) if name is not None)
        text = f"{names}: {err.strerror or err}" if names else (err.strerror or str(err) or type(err).__name__)
        return (EXIT_BAD_INPUT if err.errno in _PATH_ERRNOS else EXIT_REFUSED), text
    return (
        EXIT_BUG,
        f"internal error ({type(err).__name__}: {err}); this is a bug in taskgeom: rerun with --debug and report the traceback",
    )


def one_line(text: str) -> str:
    return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def _debug(ctx: typer.Context) -> bool:
    return bool(ctx.meta.get("taskgeom.debug")) or os.environ.get(_DEBUG_ENV, "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


class ContractGroup(TyperGroup):
    """The command group: every command runs under the error contract, so any exception becomes
    one line on stderr and its exit code (with the traceback above it under --debug)."""

    def get_command(self, ctx, cmd_name):
        """The command, its one-line summary in ``taskgeom --help`` set from its docstring: Typer's
        rich help keeps the docstring's line breaks there otherwise ("Mixed / precision")."""
        command = super().get_command(ctx, cmd_name)
        if command is not None and command.help and not command.short_help:
            command.short_help = one_line(command.help)
        return command

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException, BrokenPipeError):
            raise  # typer.Exit codes, Ctrl-C (130), usage errors (2) and a closed pipe are typer's to report
        except Exception as err:
            code, message = classify(err)
            if _debug(ctx):
                traceback.print_exc()
            typer.echo(f"error: {one_line(message)}", err=True)
            raise typer.Exit(code) from None


app = typer.Typer(
    cls=ContractGroup,
    help="Train small transformers on latent-task data and measure the geometry of task inference "
    "(Yan, Yang, Zhong 2026). `taskgeom reproduce` runs every experiment and writes claims.json and report.html. "
    "Exit codes: 0 done, 1 some claims or runs failed, 2 bad input, 3 the environment refused (disk, permissions, "
    "memory, Ray), 4 a bug.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(asked: bool) -> None:
    """``--version``: the installed distribution's version, as pip and ``pip show`` know it."""
    if asked:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("taskgeom")
        except PackageNotFoundError:  # a source tree on sys.path, not installed
            from taskgeom.version import __version__ as number
        typer.echo(f"taskgeom {number}")
        raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        expose_value=False,
        help="Print taskgeom's version and exit.",
    ),
    debug: bool = typer.Option(False, "--debug", help=f"Print the traceback of an error too (or set {_DEBUG_ENV}=1)."),
    native_kernels: bool = typer.Option(
        False,
        "--native-kernels",
        help="Let torch pick its CPU kernels by this CPU. By default ATen, MKL and oneDNN are pinned "
        "to AVX2 (unless you set ATEN_CPU_CAPABILITY, MKL_CBWR or ONEDNN_MAX_CPU_ISA yourself), so AMD EPYC CPUs with AVX2 "
        "or AVX-512 train the same bits and an Intel Xeon with AVX-512 others (docs/results/quick is an AMD EPYC's, "
        "docs/results/quick-c65b65f an Intel Xeon's); reproduction.json records the machine and the choice.",
    ),
) -> None:
    from taskgeom.settings.kernels import use_portable_kernels

    ctx.meta["taskgeom.debug"] = debug
    use_portable_kernels(native_kernels)


DEVICE_OPTION = typer.Option("auto", help="Where to train: auto (CUDA if available, else CPU), cpu, cuda or cuda:N.")
TRACKER_OPTION = typer.Option(
    "none",
    help="Also log metrics to: none, tensorboard ({run}/tensorboard) or wandb (offline "
    "unless WANDB_MODE=online). metrics.jsonl is always written.",
)


def _folder(path: Path, option: str) -> Path:
    """Refuse (before any work) a folder option that names a regular file or a path under one."""
    for part in (path, *path.parents):
        if part.exists() or part.is_symlink():
            if not part.is_dir():
                what = "is a file, not a folder" if part.is_file() else "exists and is not a folder"
                raise TaskgeomError(f"{option} {path} {what}" if part == path else f"{option} {path}: {part} {what}")
            break
    return path


def _note_undeclared(family_name: str, experiments: tuple[str, ...] | None = None) -> None:
    """Say once what the analyses (``experiments``; None: every registered one) will read of the family
    ``family_name`` that it declares none of: training goes on, those analyses will refuse it."""
    from taskgeom.experiments import undeclared
    from taskgeom.tasks.registry import family_class

    missing = undeclared(family_class(family_name), experiments)
    if missing:
        readers = ", ".join(dict.fromkeys(missing.values()))
        typer.echo(
            f"note: the {family_name!r} family declares no {', '.join(missing)}, which {readers} read (TaskFamily, "
            "docs/adding-a-family.md): this trains, but those analyses will refuse its runs until the family declares them",
            err=True,
        )


def _check_training(device: str, tracker: str, local: bool = True) -> None:
    """Refuse a bad --device or --tracker before anything is written; on Ray each task resolves
    the device on its own node, so only its spelling is checked here."""
    from taskgeom.settings.devices import check_device_name, resolve_device
    from taskgeom.training.trackers import check_tracker

    check_tracker(tracker)
    if local:
        resolve_device(device)
    else:
        check_device_name(device)


@app.command()
def train(
    config: str = typer.Argument(..., help="A recipe name (e1, e3, ...) or a path to a YAML recipe."),
    profile: str = typer.Option(
        DEFAULT_PROFILE,
        help=profiles_help("Profile in the recipe; a shipped recipe's"),
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Dotted override, repeatable: --set train.steps=500 --set task.diversity=4"
    ),
    out: Path = typer.Option(Path("runs"), help="Folder under which the run directory {name}-{digest} is made."),
    run_dir: Optional[Path] = typer.Option(
        None, help="Use this run directory instead (must be new or hold the same config)."
    ),
    device: str = DEVICE_OPTION,
    tracker: str = TRACKER_OPTION,
) -> None:
    """Train one run (or resume it from its last checkpoint); prints the run directory.
    Mixed precision: --set train.precision=bf16."""
    from taskgeom.settings.recipes import load_recipe
    from taskgeom.training.train import train_settings

    _check_training(device, tracker)
    settings = load_recipe(config, profile, set_ or [])
    _note_undeclared(settings.task.family)
    if run_dir is None:
        _folder(out, "--out")
    else:
        _folder(run_dir, "--run-dir")  # --out is not used then
    run, lines = train_settings(settings, out, run_dir, device, tracker)
    typer.echo("\n".join(lines or [f"{run.path} is already trained"]))
    typer.echo(str(run.path))


@app.command("eval")
def eval_(run_dir: Path = typer.Argument(..., help="A finished run directory.")) -> None:
    """Per-position loss of a trained model against the Bayes predictors: writes
    analysis/eval.json (tidy rows) and figures/loss_by_position.png, prints the means."""
    from taskgeom.report.figures import plot_loss_by_position
    from taskgeom.runs.folders import Run
    from taskgeom.training.evaluate import evaluate_run

    run = Run.open(run_dir)
    table = pd.DataFrame(evaluate_run(run))
    (run.path / "figures").mkdir(exist_ok=True)
    plot_loss_by_position(
        table, run.path / "figures" / "loss_by_position.png", run.family.plot_labels, title=run.path.name
    )
    typer.echo(table.groupby(["set", "metric"])["value"].mean().unstack().round(4).to_string())


@app.command()
def runs(
    root: Path = typer.Argument(Path("runs"), help="The folder holding run directories."),
    where: Optional[List[str]] = typer.Option(
        None, help="Filter field=value, repeatable: --where family=dice --where k=4"
    ),
    csv: bool = typer.Option(False, "--csv", help="Print CSV instead of a table."),
) -> None:
    """List the runs under ROOT with their settings and last held-out major-task loss, read from
    the run directories (the SQLite index the trainer keeps is brought up to date when the folder
    is writable). A run directory, metrics line or index write that cannot be read or written is
    named on stderr and skipped; the other runs are listed."""
    from taskgeom.runs.index import list_runs

    table, problems = list_runs(root, where or [])
    for problem in problems:
        typer.echo(f"skipped {problem}", err=True)
    table = table.drop(columns=["updated"])
    typer.echo(
        table.to_csv(index=False) if csv else (table.round(4).to_string(index=False) if len(table) else "no runs match")
    )


def _int_list(text: str, option: str) -> list[int]:
    """At least one integer, none twice (two runs of one config would share a run directory)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TaskgeomError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not values:
        raise TaskgeomError(f"{option} must name at least one integer, got {text!r}")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise TaskgeomError(f"{option} names {', '.join(map(str, twice))} more than once, got {text!r}")
    return values


def _executor(kind: str, workers: int | None, address: str | None, cpus_per_run: int | None, gpus_per_run: float):
    """The executor of the options below, ``--workers`` defaulting to ``devices.default_workers``."""
    from taskgeom.experiments.executors import Executor
    from taskgeom.settings.devices import default_workers

    return Executor(
        kind, default_workers(cpus_per_run) if workers is None else workers, address, cpus_per_run, gpus_per_run
    )


# The executor options, shared by `sweep` and `reproduce` (whose sweeps they run).
_EXECUTOR = typer.Option(
    "local",
    "--executor",
    help="Where runs execute: local (a process pool on this machine) or ray "
    "(one Ray task per run; needs `pip install taskgeom\\[ray]`).",
)
_WORKERS = typer.Option(
    None,
    show_default="usable cores / cpus-per-run",
    help="local: parallel worker processes (1: run in this "
    "process); by default every core this process may use (its CPU affinity and any cgroup quota) divided by the "
    "threads per run, and no more at once than memory allows for the runs' estimates. ray without --address: runs "
    "at once on the local Ray instance, which gets workers x cpus-per-run CPUs.",
)
_ADDRESS = typer.Option(
    None,
    help="ray: join the running Ray cluster at HOST:PORT instead of starting a local instance. "
    "Its nodes write the run directories into the output folder by absolute path, so that folder "
    "(and a recipe given as a file) must be on a filesystem every node mounts at the same path.",
)
_CPUS_PER_RUN = typer.Option(
    None,
    show_default="this machine's cores / workers",
    help="CPUs per run: its torch threads, and the CPUs each Ray task declares.",
)
_GPUS_PER_RUN = typer.Option(
    0.0, help="ray: GPUs each task declares, a fraction (0.5: two runs share a GPU) or a whole number."
)


@app.command()
def sweep(
    config: str = typer.Argument(..., help="A recipe name (e1, e3, ...) or a path to a YAML recipe."),
    diversity: str = typer.Option(
        "-1,0,2,4,6,8,10", help="Comma-separated diversity indices k (2^k minor tasks; -1: majors only)."
    ),
    seeds: str = typer.Option("0,1,2", help="Comma-separated training seeds."),
    profile: str = typer.Option(DEFAULT_PROFILE, help="Profile in the recipe."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Dotted override applied to every run, repeatable."),
    out: Path = typer.Option(
        Path("runs"), help="Folder for the run directories and the tables sweep.csv, by_step.csv."
    ),
    executor: str = _EXECUTOR,
    workers: Optional[int] = _WORKERS,
    address: Optional[str] = _ADDRESS,
    cpus_per_run: Optional[int] = _CPUS_PER_RUN,
    gpus_per_run: float = _GPUS_PER_RUN,
    device: str = DEVICE_OPTION,
    tracker: str = TRACKER_OPTION,
) -> None:
    """Train and analyse one run per (k, seed): projection R^2, subspace ablations, probes, the
    predictor transition and Theorem 2. Finished runs are skipped; failures are reported, not fatal.
    Runs execute on a local process pool or on Ray (--executor ray: a local Ray instance, or a
    cluster with --address, whose nodes must share the output folder)."""
    from taskgeom.experiments.sweep import Job, check_jobs, run_sweep, summary

    where = _executor(executor, workers, address, cpus_per_run, gpus_per_run)
    _check_training(device, tracker, where.kind == "local")
    ks, seed_list = _int_list(diversity, "--diversity"), _int_list(seeds, "--seeds")
    _folder(out, "--out")
    jobs = [Job(config, k, s, profile, str(out), tuple(set_ or []), device, tracker) for k in ks for s in seed_list]
    check_jobs(jobs, local=where.kind == "local")
    if jobs:
        _note_undeclared(jobs[0].config().task.family, ("dual_modes",))  # the sweep analyses its runs' dual modes
    where.check()  # Ray importable and its address answering
    table = run_sweep(jobs, where, out)
    typer.echo(summary(table).round(4).to_string(index=False))
    written = [
        out / "sweep.csv",
        *([out / "by_step.csv"] if "step" in table else []),
    ]  # by_step.csv: only when some run finished
    typer.echo(f"tables: {', '.join(map(str, written))}")
    if (table["status"] != "ok").any():  # failed or locked runs
        raise typer.Exit(1)


@app.command()
def analyze(
    run_dir: Path = typer.Argument(
        ..., help="A finished run directory, or a Hugging Face model directory (save_pretrained) with --recipe."
    ),
    layer: Optional[List[int]] = typer.Option(None, "--layer", help="Layers to measure (repeatable); all by default."),
    site: Optional[List[str]] = typer.Option(
        None, "--site", help="Sites to measure (repeatable); default resid_mid and resid_post (those there are)."
    ),
    sequences: int = typer.Option(512, help="Held-out major-task sequences to analyse."),
    recipe: Optional[str] = typer.Option(
        None, help="Hugging Face directory only: the recipe of the task the model learnt (model section ignored)."
    ),
    profile: str = typer.Option(
        DEFAULT_PROFILE,
        help="The recipe's profile whose measure: sample sizes the analysis uses (quick: the study's sizes; smoke: "
        "toy ones); for a Hugging Face directory also the recipe's settings.",
    ),
    set_: Optional[List[str]] = typer.Option(
        None, "--set", help="Hugging Face directory only: dotted override of the recipe, repeatable."
    ),
    out: Optional[Path] = typer.Option(
        None, help="Hugging Face directory only: where analysis/ and figures/ go (default RUN_DIR/taskgeom)."
    ),
) -> None:
    """M1 geometry of a trained model (docs/concepts.md and docs/protocol.md): P0-P3 per layer and site on a
    measurement batch; the claims read the study's block at the same relative depth (resid_post),
    where causal steering is measured too, one position per forward pass. P0-P2 on a selection batch
    give the selected-place variant. Writes analysis/m1.json (tidy rows), analysis/m1.safetensors (the rest of the
    result, which a reproduction reads back for the same request) and figures/m1_*.png."""
    from taskgeom.analysis.protocol import measured_under
    from taskgeom.analysis.study import open_run
    from taskgeom.experiments.m1 import analyze_one
    from taskgeom.experiments.sensitivity import profile_protocol

    if out is not None:
        _folder(out, "--out")
    run = open_run(run_dir, recipe, profile, set_ or [], out)
    _check_analysis_memory(run.config, sequences)
    with measured_under(profile_protocol(run, profile)):
        typer.echo(analyze_one(run, tuple(layer) if layer else None, tuple(site) if site else None, sequences))


def _check_analysis_memory(settings, sequences: int) -> None:
    """Refuse (exit 3), before any work, an analysis whose batches cannot fit in this machine's memory."""
    import torch

    from taskgeom.settings.devices import available_memory, describe
    from taskgeom.training.memory import analysis_memory, check_memory

    cpu = torch.device("cpu")  # the analysis runs on the CPU
    check_memory(
        analysis_memory(settings, max(sequences, 0)),
        available_memory(cpu),
        describe(cpu),
        f"analysing {sequences} sequences per batch of {settings.name}",
        "ask for fewer with --sequences",
    )


@app.command("export-hf")
def export_hf(
    run_dir: Path = typer.Argument(..., help="A finished run directory trained with model.arch gpt2 or llama."),
    out: Path = typer.Argument(..., help="The folder to write (config.json, model.safetensors)."),
) -> None:
    """Write a run's model as a Hugging Face model directory that AutoModelForCausalLM.from_pretrained
    loads (and `taskgeom analyze OUT --recipe ...` analyses); prints OUT."""
    from taskgeom.models.pretrained import save_pretrained
    from taskgeom.runs.folders import Run

    _folder(out, "OUT")
    typer.echo(str(save_pretrained(Run.open(run_dir), out)))


@app.command()
def reproduce(
    profile: str = typer.Option(
        DEFAULT_PROFILE,
        help=profiles_help("A profile every recipe defines"),
    ),
    seeds: str = typer.Option(
        "0,1,2",
        help="Comma-separated training seeds: every setting is trained on each, and each claim is "
        "judged over them (pass: every seed passes; fail: every seed fails; unstable: they disagree).",
    ),
    out: Optional[Path] = typer.Option(
        None,
        help="Output folder: runs/, figures/, claims.json, report.html. Default: results, or "
        "results-VARIANT with --variant.",
    ),
    only: Optional[List[str]] = typer.Option(
        None,
        help="Run only these experiments (bayes_optimum, m1, dual_modes, or a recipe's "
        "own: e2, e4), or only those of these recipes (repeatable).",
    ),
    recipes: Optional[str] = typer.Option(
        None,
        help="Comma-separated recipes to measure (e1,e2,e3,e4, and those of --recipe); "
        "default all. E4's experiment also trains E1 and E3's k = -1 runs, its references.",
    ),
    recipe: Optional[List[Path]] = typer.Option(
        None,
        "--recipe",
        help="A recipe file to measure besides the shipped ones "
        "(repeatable), e.g. a plugin family's; its study section says what it takes part in.",
    ),
    grid: Optional[str] = typer.Option(
        None,
        help="Comma-separated diversities k of the dual-mode sweep instead of the "
        "profile's (the claims read the lowest and the highest), e.g. -1,8 for a rung of the ladder.",
    ),
    set_: Optional[List[str]] = typer.Option(
        None,
        "--set",
        help="Dotted override applied to every run of every experiment, "
        "repeatable (a smoke test: --set train.steps=50); the runs get other directories.",
    ),
    variant_name: Optional[str] = typer.Option(
        None,
        "--variant",
        help="Train a variant of the data instead of the study's settings (docs/protocol.md#variants): "
        + "; ".join(f"{name} ({BY_NAME[name].changes})" for name in DATA_VARIANTS)
        + ". Its recipes alone, with its settings, judged under the "
        "protocol; set it beside the study's settings with `taskgeom ladder results "
        "results-VARIANT`. The variants of the measurement are `taskgeom sensitivity`'s.",
    ),
    plan: bool = typer.Option(
        False,
        "--plan",
        help="Print the runs this reproduction reads (steps, parameters, tokens, "
        "FLOPs), what is left of each (to train; each experiment's stored measurements not stored yet) and "
        "the wall time that is estimated to take here; --csv for a table; then exit: nothing is trained or written.",
    ),
    csv: bool = typer.Option(
        False,
        "--csv",
        help="With --plan: the run list as CSV, with what is left and its estimated CPU seconds "
        "on the pool (cpu_pool_s) and in this process (cpu_main_s), on this machine.",
    ),
    executor: str = _EXECUTOR,
    workers: Optional[int] = _WORKERS,
    address: Optional[str] = _ADDRESS,
    cpus_per_run: Optional[int] = _CPUS_PER_RUN,
    gpus_per_run: float = _GPUS_PER_RUN,
    device: str = DEVICE_OPTION,
    tracker: str = TRACKER_OPTION,
) -> None:
    """Reproduce every claim on every seed of --seeds: trains what is missing (finished runs are
    reused), analyses, judges each claim over the seeds, and writes claims.json, timings.json,
    reproduction.json, tables/ and report.html. Exits 1 if a claim fails on every seed (an unstable
    claim, whose seeds disagree, and an n/a claim, one that does not apply to what was measured, fail
    nothing). The diversity sweeps run on the executor chosen by the executor options (as in
    `taskgeom sweep`); the other experiments' runs train in this process, on --device."""
    from taskgeom.claims.rules import exit_code, summary
    from taskgeom.experiments.request import Request, default_out, plan_text, run

    where = _executor(executor, workers, address, cpus_per_run, gpus_per_run)
    _check_training(device, tracker)  # its single runs train in this process
    request = Request(
        profile,
        tuple(_int_list(seeds, "--seeds")),
        _folder(out or default_out(variant_name), "--out"),
        tuple(only or []),
        recipes,
        tuple(recipe or []),
        None if grid is None else tuple(_int_list(grid, "--grid")),
        tuple(set_ or []),
        variant_name,
    )
    if plan:
        typer.echo(plan_text(request, where, device, tracker, csv), nl=False)
        return
    ctx = run(request, where, device, tracker)
    for claim in ctx.claims:
        typer.echo(claim_line(claim))
    typer.echo(f"{summary(ctx.claims)}; report: {ctx.out / 'report.html'}")
    if exit_code(ctx.claims):
        raise typer.Exit(1)


def claim_line(claim) -> str:
    """One line of reproduce's output: status, id, value against the threshold, each seed's value."""
    if claim.status == "n/a":
        measured = f"not applicable: {claim.reason}"
    else:
        measured = f"{claim.value:.4g} {claim.comparison} {claim.threshold:.4g}"
        if claim.seeds and len(claim.seeds) > 1:
            measured += "  seeds: " + ", ".join(
                f"{row['seed']}={'n/a' if row['status'] == 'n/a' else format(row['value'], '.3g')}"
                for row in claim.seeds
            )
    return f"{claim.status.upper():<8}  {claim.id:<32} {measured}"


def _results(folder: Path) -> Path:
    if not folder.is_dir():
        raise TaskgeomError(f"{folder} is not a folder; give the results folder `taskgeom reproduce --out` wrote")
    return folder


@app.command()
def report(
    results_dir: Path = typer.Argument(Path("results"), help="A results folder written by `taskgeom reproduce`."),
    markdown: bool = typer.Option(
        False,
        "--markdown",
        help="Print the claims table as Markdown (per-seed values, the machine, "
        "the seeds and the taskgeom version), for a README, instead of rebuilding the page.",
    ),
) -> None:
    """Rebuild report.html (and tables/analysis.parquet and .csv) from the files of a results
    folder alone: no training, no analysis; run directories are only read. Prints the page's path."""
    from taskgeom.report.html import write_report
    from taskgeom.report.markdown import claims_markdown

    if markdown:
        typer.echo(claims_markdown(_results(results_dir)), nl=False)
        return
    write_report(_results(results_dir))
    typer.echo(str(results_dir / "report.html"))


@app.command()
def compare(
    results_a: Path = typer.Argument(..., help="A results folder written by `taskgeom reproduce`."),
    results_b: Path = typer.Argument(..., help="Another one, for example the same command on another machine."),
) -> None:
    """Say how two reproductions differ: the machines (CPU, torch's CPU capability, libraries,
    threads), which runs of both differ in the bits of their model.safetensors, and which claims
    differ in verdict or in median by more than their spread over seeds. Exits 1 when some verdict
    differs."""
    from taskgeom.report.compare import compare_results

    text, verdicts_differ = compare_results(_results(results_a), _results(results_b))
    typer.echo(text, nl=False)
    if verdicts_differ:
        raise typer.Exit(1)


@app.command()
def rejudge(
    results: Path = typer.Argument(..., help="A finished results folder written by `taskgeom reproduce`."),
    variant: str = typer.Option(
        ...,
        "--variant",
        help="A claim form published before the rule's, to judge under in place of the one the folder was judged "
        f"under (docs: Protocol, Variants): {', '.join(JUDGED_VARIANTS)}.",
    ),
    out: Optional[Path] = typer.Option(
        None, help="Folder to write claims.json, the manifest, figures and report.html to. Default: RESULTS-VARIANT."
    ),
) -> None:
    """Judge a finished reproduction's claims again under a variant of the claims' forms (its other
    forms and its V search as its manifest records them), from its stored analyses (nothing is
    trained or measured, its runs are read where they are and not written; seconds), into OUT; `taskgeom compare RESULTS OUT` then lists each claim before and after.
    Refuses, before writing anything, a variant of the measurement or the data, and a folder whose
    runs or analyses are not all stored under this taskgeom's protocol."""
    from taskgeom.experiments.request import rejudge as judge_again

    results = _results(results).resolve()
    target = out or results.with_name(f"{results.name}-{variant}")
    ctx = judge_again(results, _folder(target, "--out"), variant)
    typer.echo(ctx.out)


@app.command()
def ladder(
    folders: List[str] = typer.Argument(
        ...,
        help="Results folders written by `taskgeom reproduce`, one per rung, in the ladder's "
        "order; NAME=PATH names a rung (default: its profile).",
    ),
    out: Path = typer.Option(
        Path("ladder"),
        help="Folder to write ladder.md, ladder.csv, rank_curves.csv, ladder_*.png, verdicts.png and verdicts.csv.",
    ),
) -> None:
    """Tabulate claims across results folders: the scale ladder (one folder per rung) or a claims x
    profile table. Writes each claim's median \\[min, max] and verdict over the seeds at every rung,
    the long per-seed rows (ladder.csv, for pandas), the V-ablation rank curves, one panel per
    claim and the verdict grid (verdicts.png: every claim at every rung, coloured by its verdict,
    its median in the cell; verdicts.csv, the table it shows); prints the Markdown."""
    from taskgeom.report.ladder import write_ladder

    _folder(out, "--out")
    typer.echo(write_ladder(folders, out), nl=False)


@app.command()
def sensitivity(
    run_dirs: List[Path] = typer.Argument(
        ..., help="Finished run directories (for example a reproduction's runs at the highest k, every seed)."
    ),
    variant: Optional[List[str]] = typer.Option(
        None,
        "--variant",
        help="A variant (docs: Protocol, Variants) to list beside the protocol, repeatable. Default: every one "
        f"sensitivity covers: {', '.join(STORED_VARIANTS)}, read from the runs' stored m1.json and dual.json; "
        f"{', '.join(MEASURED_AGAIN)}, measured again on each run (minutes a run). The variants of the data "
        f"({', '.join(DATA_VARIANTS)}) train other runs: `taskgeom reproduce --variant`.",
    ),
    csv: bool = typer.Option(False, "--csv", help="Print every run's row as CSV instead of the summary."),
    places: bool = typer.Option(
        False,
        "--places",
        help="Instead: the place-dependent values at every layer and site, read from the "
        "runs' stored m1.json and dual.json: P0-P2 and projection R^2 at the place the claims read, and the "
        "lowest and highest over all places (median over the runs).",
    ),
    threads: int = typer.Option(
        1,
        help="torch threads for what is measured again (0: torch's default). The V search's result depends "
        "on it; 1, the thread count of a reproduction's sweep analyses (its --cpus-per-run, 1 with the default --workers), "
        "gives the protocol the values of its claims.json bit for bit.",
    ),
    profile: str = typer.Option(
        DEFAULT_PROFILE,
        help="The profile the runs were reproduced at: what is measured again uses its sample sizes "
        "(the smoke profile's are toy sizes; every other shipped profile keeps the study's).",
    ),
) -> None:
    """For each claim it covers, its value and verdict under the study's protocol (docs/protocol.md) and under each applicable earlier convention (its variants, docs/protocol.md#variants), on the same runs: the
    M1 claims P0-P3 (runs at k = -1, from their m1.json), projection R^2 at each run's diversity
    (dual.json), and the double dissociation (S and V ablations and the random control, measured
    again). A claim's verdict is judged over the runs given (pass on every run, fail on every run,
    else unstable), its value the median over them. Reports; the claims keep the protocol."""
    from taskgeom.experiments.sensitivity import chosen_variants, place_summary, summarise
    from taskgeom.experiments.sensitivity import sensitivity as measure

    table = measure(run_dirs, chosen_variants(tuple(variant or ())), places, threads, profile)
    if csv:
        typer.echo(table.to_csv(index=False), nl=False)
    elif places:
        typer.echo(place_summary(table).round(3).to_string(index=False))
    else:
        typer.echo(summarise(table).to_string(index=False))
