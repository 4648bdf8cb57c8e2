"""A reproduction's results folder in pandas (``tg.results(folder)``): its claims and every
analysis row of every run it used, in one layout (``report.tables.analysis_table``: ``run``,
``recipe``, ``diversity``, ``seed``, ``analysis``, then the fields of ``analysis.stored.rows``), and its
runs opened for study."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd

from taskgeom.analysis.protocol import Protocol
from taskgeom.analysis.study import StudyRun, open_run
from taskgeom.errors import TaskgeomError
from taskgeom.report.manifest import read_claims, read_manifest, recorded_choices
from taskgeom.report.tables import analysis_table, run_config
from taskgeom.settings.recipes import load_measure, recipe_path


@dataclass(frozen=True)
class Results:
    """folder: the results folder; claims: one row per claim of ``claims.json`` (id, status,
    value, threshold, parts, seeds, ...); rows: every analysis row (m1, dual, eval, e4, ...);
    runs: the run directories the reproduction used (names under ``folder/runs``)."""

    folder: Path
    claims: pd.DataFrame
    rows: pd.DataFrame
    runs: tuple[str, ...]

    @property
    def protocol(self) -> Protocol:
        """The protocol its reproduction measured under: the study's, with the sample sizes its profile
        sets (the smoke profile's), and the claims' forms and V search it was measured and judged under
        (its manifest's, ``report.manifest.recorded_choices``); measure under it (``tg.measured_under``) to
        get its stored numbers."""
        manifest = read_manifest(self.folder)
        measured = load_measure(recipe_path(manifest["recipes"][0]), manifest["profile"]).analysis_protocol
        return replace(measured, **recorded_choices(manifest))

    def run(self, recipe: str, diversity: int = -1, seed: int = 0) -> StudyRun:
        """The run of ``recipe`` at task diversity ``diversity`` trained on ``seed``, opened for study."""
        for name in self.runs:
            config = run_config(self.folder / "runs" / name)
            if (config["name"], config["task"]["diversity"], config["train"]["seed"]) == (recipe, diversity, seed):
                return open_run(self.folder / "runs" / name)
        raise TaskgeomError(f"{self.folder} used no run of {recipe!r} at diversity {diversity} on seed {seed}")


def results(folder: Path | str) -> Results:
    """The results folder written by ``taskgeom reproduce``; TaskgeomError naming the file when it is not one."""
    folder = Path(folder)
    runs = tuple(read_manifest(folder)["runs"])
    claims = pd.DataFrame(read_claims(folder))
    return Results(folder, claims, analysis_table(folder, list(runs)), runs)
