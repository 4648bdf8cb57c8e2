"""The ``taskgeom`` command line. Errors in the input print one line and exit with code 2."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, List, Optional

import pandas as pd
import typer

from taskgeom.errors import TaskgeomError

app = typer.Typer(
    help="Train small transformers on latent-task data and measure the geometry of task inference "
    "(Yan, Yang, Zhong 2026). `taskgeom reproduce` runs every experiment and writes claims.json and report.html.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


DEVICE_OPTION = typer.Option("auto", help="Where to train: auto (CUDA if available, else CPU), cpu, cuda or cuda:N.")
TRACKER_OPTION = typer.Option("none", help="Also log metrics to: none, tensorboard ({run}/tensorboard) or wandb (offline "
                              "unless WANDB_MODE=online). metrics.jsonl is always written.")


def _user_errors(fn: Callable) -> Callable:
    """Turn TaskgeomError into a one-line message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TaskgeomError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2) from None

    return wrapper


def _check_training(device: str, tracker: str, local: bool = True) -> None:
    """Refuse a bad --device or --tracker before anything is written; on Ray each task resolves
    the device on its own node, so only its spelling is checked here."""
    from taskgeom.devices import check_device_name, resolve_device
    from taskgeom.trackers import check_tracker

    check_tracker(tracker)
    if local:
        resolve_device(device)
    else:
        check_device_name(device)


@app.command()
@_user_errors
def train(
    config: str = typer.Argument(..., help="A recipe name (e1, e3, ...) or a path to a YAML recipe."),
    profile: str = typer.Option("quick", help="Profile in the recipe: quick (CPU, minutes) or paper (the study's sizes)."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Dotted override, repeatable: --set train.steps=500 --set task.diversity=4"),
    out: Path = typer.Option(Path("runs"), help="Folder under which the run directory {name}-{digest} is made."),
    run_dir: Optional[Path] = typer.Option(None, help="Use this run directory instead (must be new or hold the same config)."),
    device: str = DEVICE_OPTION,
    tracker: str = TRACKER_OPTION,
) -> None:
    """Train one run (or resume it from its last checkpoint); prints the run directory. Mixed
    precision: --set train.precision=bf16."""
    from taskgeom.progress import step_bar
    from taskgeom.recipes import load_recipe
    from taskgeom.runs import Run
    from taskgeom.train import train as train_run

    _check_training(device, tracker)
    settings = load_recipe(config, profile, set_ or [])
    if settings.model.arch != "taskgeom":
        from taskgeom.hf import require_transformers

        require_transformers()  # before the run directory is made
    run = Run.create(settings, out, run_dir)
    if run.finished:
        typer.echo(f"{run.path} is already trained")
    else:
        with step_bar(f"train {run.path.name}", run.config.train.steps) as update:
            record = train_run(run, update, device, tracker)
        for name, values in record["eval"].items():
            typer.echo(f"{name:>6}: loss {values['loss']:.4f}  ID-Bayes {values['bayes_id_loss']:.4f}  excess {values['excess']:+.4f}")
    typer.echo(str(run.path))


@app.command("eval")
@_user_errors
def eval_(run_dir: Path = typer.Argument(..., help="A finished run directory.")) -> None:
    """Per-position loss of a trained model against the Bayes predictors: writes
    analysis/eval.json (tidy rows) and figures/loss_by_position.png, prints the means."""
    from taskgeom.evaluate import evaluate_run
    from taskgeom.report.figures import plot_loss_by_position
    from taskgeom.runs import Run

    run = Run.open(run_dir)
    table = pd.DataFrame(evaluate_run(run))
    (run.path / "figures").mkdir(exist_ok=True)
    plot_loss_by_position(table, run.path / "figures" / "loss_by_position.png", run.family.plot_labels, title=run.path.name)
    typer.echo(table.groupby(["set", "metric"])["value"].mean().unstack().round(4).to_string())


@app.command()
@_user_errors
def runs(
    root: Path = typer.Argument(Path("runs"), help="The folder holding run directories."),
    where: Optional[List[str]] = typer.Option(None, help="Filter field=value, repeatable: --where family=dice --where k=4"),
    csv: bool = typer.Option(False, "--csv", help="Print CSV instead of a table."),
) -> None:
    """List the runs under ROOT with their settings and last held-out major-task loss, from the
    SQLite index the trainer keeps (refreshed from the directories first). Unreadable run
    directories are named on stderr and skipped."""
    from taskgeom.runindex import query, refresh

    for problem in refresh(root):
        typer.echo(f"skipped {problem}", err=True)
    table = query(root, where or []).drop(columns=["updated"])
    typer.echo(table.to_csv(index=False) if csv else (table.round(4).to_string(index=False) if len(table) else "no runs match"))


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise TaskgeomError(f"{option} must be comma-separated integers, got {text!r}") from None


# The executor options, shared by `sweep` and `reproduce` (whose sweeps they run).
_EXECUTOR = typer.Option("local", "--executor", help="Where runs execute: local (a process pool on this machine) or ray "
                         "(one Ray task per run; needs `pip install taskgeom\\[ray]`).")
_WORKERS = typer.Option(2, help="local: parallel worker processes (1: run in this process); ray without --address: "
                        "runs at once on the local Ray instance, which gets workers x cpus-per-run CPUs.")
_ADDRESS = typer.Option(None, help="ray: join the running Ray cluster at HOST:PORT instead of starting a local instance. "
                        "Its nodes write the run directories into the output folder by absolute path, so that folder "
                        "(and a recipe given as a file) must be on a filesystem every node mounts at the same path.")
_CPUS_PER_RUN = typer.Option(None, show_default="this machine's cores / workers",
                             help="CPUs per run: its torch threads, and the CPUs each Ray task declares.")
_GPUS_PER_RUN = typer.Option(0.0, help="ray: GPUs each task declares, a fraction (0.5: two runs share a GPU) or a whole number.")


@app.command()
@_user_errors
def sweep(
    config: str = typer.Argument(..., help="A recipe name (e1, e3, ...) or a path to a YAML recipe."),
    diversity: str = typer.Option("-1,0,2,4,6,8,10", help="Comma-separated diversity indices k (2^k minor tasks; -1: majors only)."),
    seeds: str = typer.Option("0,1,2", help="Comma-separated training seeds."),
    profile: str = typer.Option("quick", help="Profile in the recipe."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Dotted override applied to every run, repeatable."),
    out: Path = typer.Option(Path("runs"), help="Folder for the run directories and the tables sweep.csv, by_step.csv."),
    executor: str = _EXECUTOR,
    workers: int = _WORKERS,
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
    from taskgeom.experiments.executors import Executor
    from taskgeom.experiments.sweep import Job, run_sweep, summary

    where = Executor(executor, workers, address, cpus_per_run, gpus_per_run)
    _check_training(device, tracker, where.kind == "local")
    ks, seed_list = _int_list(diversity, "--diversity"), _int_list(seeds, "--seeds")
    jobs = [Job(config, k, s, profile, str(out), tuple(set_ or []), device, tracker) for k in ks for s in seed_list]
    for job in jobs:  # validate every config before any work starts
        job.config()
    table = run_sweep(jobs, where, out)
    typer.echo(summary(table).round(4).to_string(index=False))
    typer.echo(f"tables: {out / 'sweep.csv'}, {out / 'by_step.csv'}")
    if (table["status"] == "failed").any():
        raise typer.Exit(1)


@app.command()
@_user_errors
def analyze(
    run_dir: Path = typer.Argument(..., help="A finished run directory, or a Hugging Face model directory (save_pretrained) with --recipe."),
    layer: Optional[List[int]] = typer.Option(None, "--layer", help="Layers to measure (repeatable); all by default."),
    site: Optional[List[str]] = typer.Option(None, "--site", help="Sites to measure (repeatable); default resid_mid and resid_post (those there are)."),
    primary: Optional[str] = typer.Option(None, help="Fix the site of the claims (resid_mid or resid_post); by default the place "
                                          "(layer and site) with the highest R^2_task on a selection batch is chosen."),
    sequences: int = typer.Option(512, help="Held-out major-task sequences to analyse."),
    directions: str = typer.Option("task_vectors", help="Steering directions: task_vectors or regression."),
    recipe: Optional[str] = typer.Option(None, help="Hugging Face directory only: the recipe of the task the model learnt (model section ignored)."),
    profile: str = typer.Option("quick", help="Hugging Face directory only: the recipe's profile."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Hugging Face directory only: dotted override of the recipe, repeatable."),
    out: Optional[Path] = typer.Option(None, help="Hugging Face directory only: where analysis/ and figures/ go (default RUN_DIR/taskgeom)."),
) -> None:
    """M1 geometry of a trained model (PAPER.md sections 4 and 7): P0-P2 per layer and site on a
    selection batch and on an independent measurement batch; the place with the highest R^2_task on
    the selection batch is chosen, and P3 and causal steering are measured there on the measurement
    batch. Writes analysis/m1.json (tidy rows) and figures/m1_*.png."""
    from taskgeom.analysis.retrieval import Options, analyze as analyze_run, write
    from taskgeom.report.geometry import FIGURES, plot_retrieval
    from taskgeom.runs import Run

    if directions not in ("task_vectors", "regression"):
        raise TaskgeomError(f"unknown directions {directions!r}; choose task_vectors or regression")
    if (run_dir / "run.json").is_file() or (recipe is None and not (run_dir / "config.json").is_file()):
        if recipe or set_ or out:
            raise TaskgeomError(f"{run_dir} is a taskgeom run directory, which has its own config: analyse it without --recipe, --set and --out")
        run = Run.open(run_dir)
    else:
        from taskgeom.hf import open_pretrained

        run = open_pretrained(run_dir, recipe, profile, set_ or [], out)
    options = Options(tuple(layer) if layer else None, tuple(site) if site else None, primary, sequences, directions=directions)
    result = analyze_run(run, options)
    write(run, result)
    (run.path / "figures").mkdir(parents=True, exist_ok=True)
    plot_retrieval(result, {name: run.path / "figures" / f"m1_{name}.png" for name in FIGURES})
    table = pd.DataFrame(result.rows)
    per_layer = table[table["position"].isna() & (table["batch"] == "measure") & table["metric"].str.startswith(("p0", "p1", "p2"))]
    typer.echo("measurement batch:")
    typer.echo(per_layer.pivot_table(index=["layer", "site"], columns="metric", values="value", sort=False).round(4).to_string())
    best_layer, best_site = result.best
    runner = "" if result.runner_up is None else f"; runner-up layer {result.runner_up[0]} ({result.runner_up[1]})"
    typer.echo(f"selected layer {best_layer} ({best_site}) by R^2_task on the selection batch{runner}:")
    steering = [f"steering.{result.steering.measure}_{kind}" for kind in ("unsteered", "steered", "random")]
    for metric in ("p2.r2_task", "p3.tv_first_quarter", "p3.tv_last_quarter", "p3.tv_first_uncertain", "p3.tv_last_uncertain", *steering,
                   "steering.ratio"):
        typer.echo(f"  {metric:<24} {result.summary[metric]:.4g}")
    typer.echo(str(run.path / "analysis" / "m1.json"))


@app.command("export-hf")
@_user_errors
def export_hf(
    run_dir: Path = typer.Argument(..., help="A finished run directory trained with model.arch gpt2 or llama."),
    out: Path = typer.Argument(..., help="The folder to write (config.json, model.safetensors)."),
) -> None:
    """Write a run's model as a Hugging Face model directory that AutoModelForCausalLM.from_pretrained
    loads (and `taskgeom analyze OUT --recipe ...` analyses); prints OUT."""
    from taskgeom.hf import save_pretrained
    from taskgeom.runs import Run

    typer.echo(str(save_pretrained(Run.open(run_dir), out)))


@app.command()
@_user_errors
def reproduce(
    profile: str = typer.Option("quick", help="quick: reduced sizes for a 2-core CPU; paper: the study's sizes."),
    out: Path = typer.Option(Path("results"), help="Output folder: runs/, figures/, claims.json, report.html."),
    only: Optional[List[str]] = typer.Option(None, help="Run only these experiments (repeatable)."),
    executor: str = _EXECUTOR,
    workers: int = _WORKERS,
    address: Optional[str] = _ADDRESS,
    cpus_per_run: Optional[int] = _CPUS_PER_RUN,
    gpus_per_run: float = _GPUS_PER_RUN,
    device: str = DEVICE_OPTION,
    tracker: str = TRACKER_OPTION,
) -> None:
    """Reproduce every claim: trains what is missing (finished runs are reused), analyses, and
    writes claims.json, timings.json and report.html. Exits 1 if a claim fails (an n/a claim, one
    that does not apply to what was measured, fails nothing). The diversity
    sweeps run on the executor chosen by the executor options (as in `taskgeom sweep`); the other
    experiments' runs train in this process, on --device."""
    from taskgeom.experiments.executors import Executor
    from taskgeom.experiments import EXPERIMENTS, reproduce as run_all
    from taskgeom.claims import exit_code, summary

    where = Executor(executor, workers, address, cpus_per_run, gpus_per_run)
    _check_training(device, tracker)  # its single runs train in this process
    if profile not in ("quick", "paper"):
        raise TaskgeomError(f"unknown profile {profile!r}; choose quick or paper")
    unknown = set(only or []) - set(EXPERIMENTS)
    if unknown:
        raise TaskgeomError(f"unknown experiments {sorted(unknown)}; available: {list(EXPERIMENTS)}")
    chosen = {k: v for k, v in EXPERIMENTS.items() if not only or k in only}
    ctx = run_all(out, profile, chosen, where, device, tracker)
    for claim in ctx.claims:
        measured = f"not applicable: {claim.reason}" if claim.status == "n/a" else f"{claim.value:.4g} {claim.comparison} {claim.threshold:.4g}"
        typer.echo(f"{claim.status.upper():<4}  {claim.id:<28} {measured}")
    typer.echo(f"{summary(ctx.claims)}; report: {ctx.out / 'report.html'}")
    if exit_code(ctx.claims):
        raise typer.Exit(1)
