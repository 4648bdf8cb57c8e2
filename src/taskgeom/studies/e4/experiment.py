"""E4, planted Dyck (docs/concepts.md#e4-where-the-geometry-ends): P0 fails where E1 and E3 satisfy it, and linear probes
recover the earlier bracket prefix from the hidden states.

Where (docs/protocol.md, "E4"): the claims read ``resid_post`` of each model's M1 block (the
study's block 3 of 6 at the same relative depth, ``Place.at_depth`` of the family's ``m1_block``),
one place, never the minimum over blocks; the tables keep every layer at both sites.

P0's claim reads the study's own measurement (``studies.e4.variance``: the residual variance ratio of
cells of the tasks sharing the last three planted brackets, at each bracket's own position, at
``resid_mid``) against E1's and E3's 1 - P0 as their M1 claims read it (``reference_within``). The
earlier construction stays measured beside it (``natural_cells_ratio`` in the claim's parts): there
P0 is measured by one function for every family, ``within_share``: the within-cell share of the
variance of the states over (task, current token) cells **at each position separately** (as the
M1 protocol fits P0 for E1-E3, so the drift of the mean state is not counted as within-cell
variance), on major-task sequences of a majors-only model, summarised by the median over the late
window (the last quarter). For E4 the cells are also (task, last three planted brackets), and the
states those of the bracket phase: at each late position, the sequences whose brackets are still
due [ours]. Once all brackets are placed E4 emits iid noise, a one-task E1 where P0 holds
trivially; both E4 numbers over every sequence of the late window are kept in
``analysis/e4.json`` too.

The prefix probe's claim reads the study's own probe (``studies.e4.prefix``) on the model at the top
of the diversity grid: a 2-D projection and an MLP per prefix length, trained to name the first l
brackets of the task's string from the state at the study's block 5 of 6 (``resid_mid``), against
the same probe on shuffled labels [ours]. The earlier construction stays measured beside it (the
claim's part ``linear_probe_gain`` and the tables ``probes*``): in-distribution sequences, tasks
drawn from the pool prior; at each prefix length j, a linear probe classifies the planted bracket
j back from h_t, against a shuffled-label control, at every layer and both sites, read at the M1
block's ``resid_post``; the same probes on OOD sequences (a fresh string each) are a second table,
and both are repeated on the untrained network as a control.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Callable, ContextManager, Literal

import pandas as pd
import torch

from taskgeom.analysis.measures.anova import two_way
from taskgeom.analysis.measures.linear_probes import Kind, linear_probe
from taskgeom.analysis.measures.task_vectors import late_window
from taskgeom.analysis.protocol import active
from taskgeom.analysis.reading.states import collect
from taskgeom.analysis.stored.keys import key as stored_key
from taskgeom.analysis.stored.keys import register as register_format
from taskgeom.analysis.study import StudyRun
from taskgeom.claims.m1 import claim_values
from taskgeom.errors import TaskgeomError
from taskgeom.experiments.base import Context
from taskgeom.experiments.m1 import prepared_name, stored_or_analyzed
from taskgeom.experiments.schedule import Prepared, TrainTask
from taskgeom.hooks import Place
from taskgeom.report.interactive import Evidence, lines
from taskgeom.report.manifest import read_json
from taskgeom.runs.folders import Run
from taskgeom.runs.storage import atomic_write_json
from taskgeom.settings.recipes import Study, load_measure
from taskgeom.studies.e4.claims import CLAIM_SITE, natural_cells_ratio, p0_failure, prefix_probe, weakest_probe
from taskgeom.studies.e4.figures import plot_p0_comparison, plot_p0_positions, plot_prefix_probes, plot_study_probe
from taskgeom.studies.e4.prefix import probe_layer, study_prefix_probe
from taskgeom.studies.e4.variance import study_p0
from taskgeom.tasks import Batch
from taskgeom.tasks.dyck import Dyck
from taskgeom.training.timing import TRAIN_COST_PER_FLOP_SECOND, Timings

# cost [measured], CPU seconds of one seed's measurement (its four stages) per flop-second of its k = -1
# run's training (``Experiment.cost``): 6.6-7.0 on the quick three-seed reproduction at 7a2bd5c, two
# threads asleep when waiting, beside the training (benchmarks/plan_costs.py, 2-core AMD EPYC, 100 GFLOP/s)
COST = 6.8
register_format("e4", 3, __name__)  # one seed's stored measurement (``measure``): its format number
# The protocol's (``active()``): dyck_max_back, the probes for the planted bracket j back, j = 1..max;
# dyck_probe_sequences, sequences per probe analysis; dyck_natural_p0_sequences, those of the P0 layouts
# on natural states [ours] (E4's bracket phase keeps a fraction of them at each late position)
# The recipes whose P0 E4 is set beside (the recipe's ``options: {references: [...]}``): token
# families; E2 would need its token factor binned, since x_t is continuous there.
REFERENCES = ("e1", "e3")
# Sites measured at every layer, for P0 and for the probes (the tables); the claims and the figures
# read studies.e4.claims.CLAIM_SITE of the M1 block (docs/protocol.md, "E4").
P0_SITES = ("resid_mid", "resid_post")
PROBE_SITES = P0_SITES
ProbeSet = Literal["pool", "ood"]
PROBE_SETS: tuple[str, ...] = ("pool", "ood")
MEASURE_STREAM = "probe"
# The tables of ``analysis/e4.json`` (one seed's: ``measure``)
TABLES = ("p0", "p0_brackets", "p0_references", "prefix_probe", "probes", "probes_ood", "probes_untrained")


def claim_layer(run: Run) -> int:
    """The block the claims read: the family's M1 block at the model's depth."""
    return Place.at_depth(*run.family.m1_block, run.config.model.n_layers).layer


def within_share(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, n_a: int, n_b: int, mask: torch.Tensor) -> float:
    """P0 of states h: [N, T, D]: SS_within / SS_total over cells (a, b) at each late position
    separately, over the sequences where mask: [N, T] bool is true there (positions with fewer
    than two left out), and the median over those positions (NaN when none is left); a, b: [N, T]
    long (a in 0..n_a-1, b in 0..n_b-1)."""
    shares = []
    for t in range(*late_window(h.shape[1]).indices(h.shape[1])):
        keep = mask[:, t]
        if int(keep.sum()) >= 2:
            shares.append(two_way(h[keep, t], a[keep, t], b[keep, t], n_a, n_b).within_share)
    return float(torch.tensor(shares, dtype=torch.float64).median()) if shares else math.nan


def within_shares(
    states: Sequence[torch.Tensor], a: torch.Tensor, b: torch.Tensor, n_a: int, n_b: int, mask: torch.Tensor
) -> list[float]:
    """``within_share`` of each state tensor (one per layer)."""
    return [within_share(h, a, b, n_a, n_b, mask) for h in states]


def _layer_states(run: Run, tokens: torch.Tensor, model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """{site name: [[N, T, D] per layer]} for each name in P0_SITES."""
    sites = [(layer, name) for name in P0_SITES for layer in range(run.config.model.n_layers)]
    states = collect(model, tokens, sites)
    return {name: [states[site] for site in sites if site[1] == name] for name in P0_SITES}


def _major_batch(run: Run):
    n = active().dyck_natural_p0_sequences
    return run.family.sample(run.pool, n, run.config.task.seq_len, run.config.train.seed, 0, "p0", "major")


def _late(tokens: torch.Tensor) -> torch.Tensor:
    """[N, T] bool, true on the late window."""
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, late_window(tokens.shape[1])] = True
    return mask


def reference_p0(run: Run) -> dict[str, list[float]]:
    """{site name: within-cell share per layer} over (task, current token) cells, per late
    position, major-task sequences."""
    batch = _major_batch(run)
    tokens = batch.tokens
    task = batch.task[:, None].expand_as(tokens)
    K, V, late = run.pool.n_major, run.family.vocab_size, _late(tokens)
    return {
        name: within_shares(states, task, tokens, K, V, late)
        for name, states in _layer_states(run, tokens, run.load_model()).items()
    }


def reference_within(run: Run) -> float:
    """1 - P0 of a reference run as its M1 claim reads it (the study's forced-token cells at its claim
    place), from its stored M1 result; analysed now where that is absent or of another version or request."""
    return 1.0 - claim_values(stored_or_analyzed(StudyRun(run)).rows)["P0"].value


def dyck_p0(run: Run) -> dict[str, dict[str, list[float]]]:
    """{site name: {grouping_positions: share per layer}}: E4's within-cell share by (task, current
    token) and by (task, last three planted brackets), per late position over the sequences in
    their bracket phase (``_due``) or over every sequence (``_late``)."""
    family, batch = run.family, _major_batch(run)
    tokens = batch.tokens
    late = _late(tokens)
    due = late & (family.bracket_count(tokens) < family.length)
    task = batch.task[:, None].expand_as(tokens)
    last3 = sum((family.planted(tokens, j) + 1) * 3 ** (j - 1) for j in (1, 2, 3))  # [N, T] in 0..26
    K, V = run.pool.n_major, family.vocab_size
    return {
        name: {
            "token_due": within_shares(states, task, tokens, K, V, due),
            "last3_due": within_shares(states, task, last3, K, 27, due),
            "token_late": within_shares(states, task, tokens, K, V, late),
            "last3_late": within_shares(states, task, last3, K, 27, late),
        }
        for name, states in _layer_states(run, tokens, run.load_model()).items()
    }


def probe_batch(run: Run, which: ProbeSet, n_sequences: int | None = None, stream: str = MEASURE_STREAM) -> Batch:
    """The sequences the probes read: ``pool`` draws tasks from the pool prior (in-distribution, as
    the study probes); ``ood`` draws a fresh string per sequence (no memorised string can stand in
    for the prefix)."""
    n_sequences = active().dyck_probe_sequences if n_sequences is None else n_sequences
    family, cfg = run.family, run.config
    if which == "pool":
        return family.sample(run.pool, n_sequences, cfg.task.seq_len, cfg.train.seed, 0, stream, "all")
    if which == "ood":
        return family.sample_ood(n_sequences, cfg.task.seq_len, cfg.train.seed, 0, stream)
    raise ValueError(f"which must be one of {PROBE_SETS}, got {which!r}")


def probe_targets(family: Dyck, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[Kind, torch.Tensor]]]:
    """The probed positions and labels for tokens: [N, T]. mask: [N, T] bool, true where at least
    ``dyck_max_back`` brackets are placed and more are still due; targets: {name: (kind, [N, T] labels)},
    ``back_j`` the planted bracket j back (0 = "(", 1 = ")") and ``depth``."""
    count = family.bracket_count(tokens)
    max_back = active().dyck_max_back
    mask = (count >= max_back) & (count < family.length)
    targets: dict[str, tuple[Kind, torch.Tensor]] = {
        f"back_{j}": ("classification", family.planted(tokens, j)) for j in range(1, max_back + 1)
    }
    targets["depth"] = ("regression", family.depth(tokens).double())
    return mask, targets


def probe_rows(
    states: Iterable[tuple[Place, torch.Tensor]],
    targets: dict[str, tuple[Kind, torch.Tensor]],
    mask: torch.Tensor,
    which: str,
    seed: int,
) -> list[dict]:
    """One tidy row per (site, target): held-out score and shuffled-label control of a linear probe
    from the states at ``mask`` to each target. states: ((layer, site name), [N, T, D]) pairs;
    mask: [N, T] bool; the positions of one sequence stay on one side of the split."""
    groups = torch.arange(mask.shape[0])[:, None].expand_as(mask)[mask]
    rows = []
    for (layer, site), h in states:
        x = h[mask]
        for target, (kind, labels) in targets.items():
            result = linear_probe(x, labels[mask], kind, groups, seed=seed)
            rows.append(
                {
                    "set": which,
                    "site": site,
                    "layer": layer,
                    "target": target,
                    "metric": result.metric,
                    "score": result.score,
                    "control": result.control,
                }
            )
    return rows


def prefix_probes(
    run: Run, model: torch.nn.Module, which: ProbeSet, n_sequences: int | None = None, stream: str = MEASURE_STREAM
) -> list[dict]:
    """Probes for the planted bracket j back (accuracy) and the depth (R^2) on ``which`` sequences
    (``probe_batch``), from the embedding (layer 0's ``resid_pre``) and from PROBE_SITES of every
    layer, at the positions of ``probe_targets``."""
    tokens = probe_batch(run, which, n_sequences, stream).tokens
    mask, targets = probe_targets(run.family, tokens)
    sites = [(0, "resid_pre"), *((layer, name) for layer in range(run.config.model.n_layers) for name in PROBE_SITES)]
    return probe_rows(collect(model, tokens, sites).items(), targets, mask, which, run.config.train.seed)


def probe_diversity(ctx: Context, study: Study) -> int:
    """k of the high-diversity model the prefix probes read (2**k minor tasks): the top of the
    diversity grid (``--grid``, else the profile's ``measure.grid``), where the study's reads."""
    return max(ctx.diversities or load_measure(study.path, ctx.profile).grid)


def references(study: Study) -> tuple[str, ...]:
    """The recipes whose k = -1 runs ``study``'s P0 is set beside (its ``options: {references: [...]}``)."""
    return tuple(study.options("e4").get("references", REFERENCES))


def runs(ctx: Context) -> list[TrainTask]:
    """The runs ``e4`` trains or reads, for the schedule, for every recipe taking part: its own at k = -1
    and at the probes' k (``probe_diversity``), and its references at k = -1, each on every seed."""
    return [
        task
        for study in ctx.taking_part("e4")
        for task in (
            *ctx.plans(study.name, ("task.diversity=-1",)),
            *ctx.plans(study.name, (f"task.diversity={probe_diversity(ctx, study)}",)),
            *(task for name in references(study) for task in ctx.plans(name, ("task.diversity=-1",))),
        )
    ]


def e4(ctx: Context) -> None:
    """E4's claims on the runs of every recipe taking part (``measure_study``)."""
    for study in ctx.taking_part("e4"):
        measure_study(ctx, study, references(study))


def measure_study(ctx: Context, study: Study, references: Sequence[str]) -> None:
    """E4's claims on ``study``'s runs against ``references`` (every seed), one seed's figures, and
    every row in the folder's ``analysis/{study}.json``."""
    tables: dict[str, list[dict]] = {name: [] for name in TABLES}
    diversity = probe_diversity(ctx, study)
    for seed in ctx.seeds:
        measured = measure(ctx, study.name, tuple(references), seed, diversity)
        for name, rows in measured.items():
            tables[name] += [{"seed": seed, **row} for row in rows]
        if seed == ctx.seeds[0]:  # one seed's figures illustrate; the claims read every seed (the JSON holds them all)
            plot(ctx, study.name, tuple(references), measured, seed, diversity)
    atomic_write_json(ctx.out / "analysis" / f"{study.name}.json", tables)


def measure(ctx: Context, name: str, references: tuple[str, ...], seed: int, diversity: int) -> dict[str, list[dict]]:
    """The P0 shares and prefix probes of recipe ``name``'s runs of ``seed`` (the probes on the run at
    k = ``diversity``); records its claims; returns the tidy rows of ``analysis/{name}.json``
    (without the seed). Each seed's rows are kept in ``analysis/{name}/seed-{seed}.json`` with the
    runs they were measured on and read back from there while those runs and their keys (``analysis.stored.keys``: format numbers and the protocol's digest)
    ("e4", "m1") are the same, so a reproduction stopped midway measures only the seeds it had not
    reached; the claims are read from the rows as stored."""
    majors = ctx.trained(name, ("task.diversity=-1",), seed)
    diverse = ctx.trained(name, (f"task.diversity={diversity}",), seed)
    reference_runs = {ref: ctx.trained(ref, ("task.diversity=-1",), seed) for ref in references}
    path, key = seed_file(ctx, name, references, seed, diversity)
    rows = stored_seed(path, key)
    if rows is None:
        tables = measure_rows(ctx.stage, name, majors, diverse, reference_runs, seed)
        atomic_write_json(path, {**key, "tables": tables})
        rows = stored_seed(path, key)
    layer, at = claim_layer(majors), {ref: claim_layer(run) for ref, run in reference_runs.items()}
    residual = [row["value"] for row in rows["p0_brackets"] if row["layer"] == layer]
    within = {row["series"]: row["value"] for row in rows["p0_references"]}
    accuracy, _, reached = study_probe_readings(rows["prefix_probe"])
    ctx.claim(
        seed,
        p0_failure(name, residual, layer, within, natural_cells_ratio(claim_site_shares(rows["p0"]), layer, at)),
        prefix_probe(
            name,
            accuracy["probe"],
            accuracy["control"],
            reached,
            probe_layer(diverse),
            active().dyck_probe_site,
            diversity,
            weakest_probe(rows["probes"], claim_layer(diverse))["gain"],
            study_probe_lengths(rows["prefix_probe"]),
        ),
    )
    return rows


def claim_site_shares(p0_rows: list[dict]) -> dict[str, list[float]]:
    """{series: within-cell share per layer} at ``CLAIM_SITE`` from the ``p0`` table's rows."""
    shares: dict[str, list[float]] = {}
    for row in p0_rows:
        if row["site"] == CLAIM_SITE:
            shares.setdefault(row["series"], []).append(row["value"])
    return shares


def study_probe_lengths(rows: list[dict]) -> dict[str, dict[int, tuple[bool, float]]]:
    """{"probe" | "control": {length: (whether the kept snapshot had trained its head, its chance
    level)}} from the ``prefix_probe`` table's rows of one seed."""
    found: dict[str, dict[int, tuple[bool, float]]] = {}
    for row in rows:
        if row["metric"] == "prefix_probe.accuracy":
            found.setdefault(row["probe"], {})[row["length"]] = (row["trained_at_kept"], row["chance"])
    return found


def study_probe_readings(rows: list[dict]) -> tuple[dict[str, dict[int, float]], int, int]:
    """({"probe" | "control": {length: validation accuracy}}, the layer read, the curriculum's reach)
    from the ``prefix_probe`` table's rows of one seed."""
    accuracy: dict[str, dict[int, float]] = {}
    for row in rows:
        if row["metric"] == "prefix_probe.accuracy":
            accuracy.setdefault(row["probe"], {})[row["length"]] = row["value"]
    layer, reached = next((row["layer"], row["reached"]) for row in rows if row["probe"] == "probe")
    return accuracy, layer, reached


def seed_file(ctx: Context, name: str, references: Sequence[str], seed: int, diversity: int) -> tuple[Path, dict]:
    """(where ``measure`` keeps one seed's tables, the key they are stored under: the versions, the
    diversity and the run directories they read)."""
    overrides = [
        (name, "task.diversity=-1"),
        (name, f"task.diversity={diversity}"),
        *((ref, "task.diversity=-1") for ref in references),
    ]
    runs = [
        f"{config.name}-{config.digest()}"
        for config in (ctx.config(recipe, (setting,), seed) for recipe, setting in overrides)
    ]
    key = {**stored_key("e4"), "m1_version": stored_key("m1")["version"], "diversity": diversity, "runs": runs}
    return ctx.out / "analysis" / name / f"seed-{seed}.json", key


def measure_stored(path: Path, key: dict, root: Path, name: str, references: tuple[str, ...], seed: int) -> dict:
    """Measure one seed and store its tables at ``path`` under ``key`` (``seed_file``: its runs, in
    ``measure``'s order, under ``root``), unless they are stored; the (wall, CPU) seconds of its
    stages and the process's peak memory (MB) at each one's end, by name; none when they were stored."""
    if stored_seed(path, key) is not None:
        return {}
    timings = Timings()
    majors, diverse, *others = (Run.open(root / run) for run in key["runs"])
    stage = partial(timings.stage, "e4")
    tables = measure_rows(stage, name, majors, diverse, dict(zip(references, others)), seed)
    atomic_write_json(path, {**key, "tables": tables})
    return {stage.stage: (stage.wall_s, stage.cpu_s, stage.peak_mb) for stage in timings.stages}


def prepare(ctx: Context) -> list[Prepared]:
    """Each seed's measurement that is not stored, for the schedule's pool, after its runs and the
    M1 analyses of its references (``reference_within`` reads them), with this process's thread count,
    which would have measured it otherwise."""
    found = []
    for study in ctx.taking_part("e4"):
        refs, diversity = references(study), probe_diversity(ctx, study)
        for seed in ctx.seeds:
            path, key = seed_file(ctx, study.name, refs, seed, diversity)
            if stored_seed(path, key) is not None:
                continue
            majors = ctx.plans(study.name, ("task.diversity=-1",))[ctx.seeds.index(seed)]
            found.append(
                Prepared(
                    "e4",
                    f"e4 {study.name} seed {seed}",
                    (*key["runs"], *(prepared_name(run) for run in key["runs"][2:])),
                    torch.get_num_threads(),
                    partial(measure_stored, path, key, ctx.runs_root, study.name, refs, seed),
                    majors.cost() * COST / TRAIN_COST_PER_FLOP_SECOND,
                    ctx.protocol,
                )
            )
    return found


def left(ctx: Context) -> list[str]:
    """For ``--plan``: the k = -1 run of every seed, of every recipe taking part, whose measurement
    ``measure`` has not stored."""
    files = [
        seed_file(ctx, study.name, references(study), seed, probe_diversity(ctx, study))
        for study in ctx.taking_part("e4")
        for seed in ctx.seeds
    ]
    return [key["runs"][0] for path, key in files if stored_seed(path, key) is None]


def stored_seed(path: Path, key: dict) -> dict[str, list[dict]] | None:
    """The tables of one seed's E4 measurement stored at ``path`` under ``key`` (the versions, the
    diversity and the runs it read), or None when absent or stored under another key."""
    if not path.exists():
        return None
    stored = read_json(path, "delete it to measure the seed again")
    if not isinstance(stored, dict) or {k: stored.get(k) for k in key} != key:
        return None
    tables = stored.get("tables")
    if not isinstance(tables, dict) or set(tables) != set(TABLES):
        raise TaskgeomError(f"{path} holds no tables {list(TABLES)}; delete it to measure the seed again")
    return tables


def measure_rows(
    stage: Callable[[str], ContextManager],
    name: str,
    majors: Run,
    diverse: Run,
    reference_runs: dict[str, Run],
    seed: int,
) -> dict[str, list[dict]]:
    """Measure one seed's E4 tables (``measure``): the P0 shares of ``majors`` and the references, the
    prefix probes of ``diverse``; each part timed as ``stage(its name)``."""
    references = tuple(reference_runs)
    with stage(f"P0 as the study's variance.py ({name.upper()}; seed {seed})"):
        residual = study_p0(majors)  # [L, J]
        within = {ref: reference_within(run) for ref, run in reference_runs.items()}
    with stage(
        f"P0 within-cell shares on natural states ({', '.join(r.upper() for r in (*references, name))}; seed {seed})"
    ):
        reference_shares = {ref: reference_p0(run) for ref, run in reference_runs.items()}
        dyck = dyck_p0(majors)
    with stage(f"the study's prefix probe and its shuffled-label control (seed {seed})"):
        study_probe = study_prefix_probe(diverse)
    with stage(f"linear prefix probes (trained and untrained, pool and OOD; seed {seed})"):
        model, untrained_model = (
            diverse.load_model(),
            diverse.new_model(),
        )  # untrained: random features of the same network
        probes = {which: prefix_probes(diverse, model, which) for which in PROBE_SETS}
        untrained = [row for which in PROBE_SETS for row in prefix_probes(diverse, untrained_model, which)]
    p0 = {
        site: {
            **{ref: reference_shares[ref][site] for ref in references},
            **{f"e4_{k}": v for k, v in dyck[site].items()},
        }
        for site in P0_SITES
    }
    p0_rows = [
        {"site": site, "series": name, "layer": layer, "metric": "p0.within_share", "value": share}
        for site, series in p0.items()
        for name, shares in series.items()
        for layer, share in enumerate(shares)
    ]
    bracket_rows = [
        {
            "site": active().dyck_p0_site,
            "layer": layer,
            "bracket": j,
            "metric": "p0.residual_ratio",
            "value": float(value),
        }
        for layer, ratios in enumerate(residual)
        for j, value in enumerate(ratios)
    ]
    reference_rows = [{"series": ref, "metric": "p0.one_minus_P0", "value": share} for ref, share in within.items()]
    at_probe = probe_layer(diverse)
    study_probe_rows = [
        {
            "probe": name,
            "site": active().dyck_probe_site,
            "layer": at_probe,
            "length": length,
            "metric": f"prefix_probe.{metric}",
            "value": values[length],
            "best_epoch": result.best_epoch,
            "epochs": result.epochs,
            "reached": result.reached,
            "trained_at_kept": length in result.kept_lengths,
            "chance": result.chance[length],
        }
        for name, result in study_probe.items()
        for metric, values in (("accuracy", result.accuracy), ("loss", result.loss))
        for length in values
    ]
    return {
        "p0": p0_rows,
        "p0_brackets": bracket_rows,
        "p0_references": reference_rows,
        "prefix_probe": study_probe_rows,
        "probes": probes["pool"],
        "probes_ood": probes["ood"],
        "probes_untrained": untrained,
    }


def plot(
    ctx: Context, name: str, references: tuple[str, ...], measured: dict[str, list[dict]], seed: int, diversity: int
) -> None:
    """The P0 comparison and the prefix-probe figures of one seed's rows (``measure``; the probes' at
    k = ``diversity``)."""
    ratios: dict[int, list[float]] = {}
    for row in measured["p0_brackets"]:
        ratios.setdefault(row["layer"], []).append(row["value"])
    references_within = {row["series"].upper(): row["value"] for row in measured["p0_references"]}
    plot_p0_positions(
        ratios,
        references_within,
        ctx.figure(
            "p0_bracket_positions.png",
            f"E4's P0 as the study's variance.py measures it: the residual variance ratio (1 - R^2 of cells of the tasks sharing the "
            f"last three planted brackets) at each block's {active().dyck_p0_site}, at bracket j's own position, against j, k = -1; dotted: "
            f"{' and '.join(references_within)}'s 1 - P0 (the study's forced-token cells, their M1 block) (seed {seed})",
            (f"{name}.P0_failure",),
        ),
        site=active().dyck_p0_site,
    )
    shares = claim_site_shares(measured["p0"])
    series = {f"{ref.upper()} (task, token)": shares[ref] for ref in references}
    series |= {
        "E4 (task, token), bracket phase": shares["e4_token_due"],
        "E4 (task, last 3 brackets), bracket phase": shares["e4_last3_due"],
    }
    plot_p0_comparison(
        series,
        ctx.figure(
            "p0_across_families.png",
            f"P0 across families, the earlier construction on natural states (natural_cells_ratio in the claim's parts): within-cell "
            f"share of state variance per layer at {CLAIM_SITE}; {' and '.join(r.upper() for r in references)} by "
            f"(task, current token), E4 by (task, current token) and by (task, last three planted brackets), k = -1 (seed {seed})",
            (f"{name}.P0_failure",),
        ),
        site=CLAIM_SITE,
    )
    accuracy, at, reached = study_probe_readings(measured["prefix_probe"])
    plot_study_probe(
        accuracy["probe"],
        accuracy["control"],
        reached,
        ctx.figure(
            "prefix_probe_accuracy.png",
            f"E4: the study's prefix probe (its run_prefix_probe: a 2-D projection and an MLP per length, block {at} {active().dyck_probe_site}): validation "
            f"accuracy of the first l brackets of the task's string against l; dotted: the same probe on shuffled labels; shaded: the "
            f"lengths past the curriculum's reach (l = {reached}), whose heads were never trained; k = {diversity} (seed {seed})",
            (f"{name}.prefix_probe",),
        ),
        site=active().dyck_probe_site,
    )
    last = max(row["layer"] for row in measured["probes_untrained"])
    untrained = [r for r in measured["probes_untrained"] if r["site"] == CLAIM_SITE and r["layer"] == last]
    plot_prefix_probes(
        [*measured["probes"], *measured["probes_ood"]],
        untrained,
        ctx.figure(
            f"{name}_prefix_probes.png",
            f"E4: held-out linear probes at {CLAIM_SITE} for the planted bracket j back and for the depth, "
            f"k = {diversity}; solid: in-distribution (pool) sequences, dashed: OOD sequences, "
            f"dotted: shuffled labels; grey: layer {last} of the untrained network (seed {seed})",
            (f"{name}.prefix_probe",),
        ),
        f"E4: linear probes for the planted bracket prefix at {CLAIM_SITE}, k = {diversity}",
        site=CLAIM_SITE,
    )


def evidence(table: pd.DataFrame) -> list[Evidence]:
    """The report's interactive pieces of every recipe this experiment measured: within-cell shares
    and prefix probes (the rows of the folder's ``analysis/{recipe}.json``)."""
    names = [analysis.removesuffix(".p0") for analysis in table["analysis"].unique() if analysis.endswith(".p0")]
    return [piece for name in names for piece in _evidence(table, name)]


def _evidence(table: pd.DataFrame, e4: str) -> list[Evidence]:
    p0 = table[table["analysis"] == f"{e4}.p0"]
    brackets = table[table["analysis"] == f"{e4}.p0_brackets"]
    study_probe = table[(table["analysis"] == f"{e4}.prefix_probe") & (table["metric"] == "prefix_probe.accuracy")]
    probes = pd.concat([table[table["analysis"] == f"{e4}.{name}"] for name in ("probes", "probes_ood")])
    shown = (
        probes[probes["site"] == CLAIM_SITE].drop(columns="value", errors="ignore").rename(columns={"score": "value"})
    )
    return [
        Evidence(
            f"{e4}-p0-brackets",
            f"Residual variance ratio per bracket index and layer ({active().dyck_p0_site}; the study's variance.py)",
            e4,
            (f"{e4}.P0_failure",),
            figure=lines(
                brackets,
                "bracket",
                lambda k: f"layer {k[0]}",
                ["layer"],
                "Residual variance ratio per bracket",
                "bracket index j",
                "1 - R^2",
            ),
        ),
        Evidence(
            f"{e4}-p0",
            f"Within-cell share of state variance per layer (P0 fails for {e4.upper()})",
            e4,
            (f"{e4}.P0_failure",),
            figure=lines(
                p0,
                "layer",
                lambda k: f"{k[0]} {k[1]}",
                ["site", "series"],
                "Within-cell share per layer",
                "layer",
                "within-cell share",
                dash=lambda k: "dot" if k[0] == "resid_post" else "solid",
            ),
        ),
        Evidence(
            f"{e4}-prefix-probe",
            "The study's prefix probe: validation accuracy per prefix length (dotted: shuffled labels)",
            e4,
            (f"{e4}.prefix_probe",),
            figure=lines(
                study_probe,
                "length",
                lambda k: k[0],
                ["probe"],
                "Prefix probe accuracy per length",
                "prefix length l",
                "validation accuracy",
                dash=lambda k: "dot" if k[0] == "control" else "solid",
            ),
        ),
        Evidence(
            f"{e4}-probes",
            f"Held-out linear prefix probes at {CLAIM_SITE} (pool and OOD sequences; the earlier construction)",
            e4,
            (f"{e4}.prefix_probe",),
            figure=lines(
                shown,
                "layer",
                lambda k: f"{k[1]} ({k[0]})",
                ["set", "target"],
                f"Probe score per layer ({CLAIM_SITE})",
                "layer",
                "score",
                dash=lambda k: "solid" if k[0] == "pool" else "dash",
            ),
        ),
        Evidence(
            f"{e4}-probe-table",
            "Prefix probes: score and shuffled-label control per target, layer, site and set",
            e4,
            (f"{e4}.prefix_probe",),
            table=probes[["seed", "set", "target", "site", "layer", "metric", "score", "control"]].assign(
                gain=probes["score"] - probes["control"]
            ),
        ),
    ]
