"""Claims across results folders (``taskgeom ladder``): the scale ladder, or a claims x profile
table. Each folder is one rung (its profile, or the name given as ``NAME=PATH``); every claim's
median, min and max over the seeds at each rung, its verdict there, one panel per claim (value
against rung, the seeds as dots, the threshold as a line), the rank curve of the V ablation at
each rung, and the verdict grid of every claim at every rung (``report.verdicts``). Nothing is
measured here: the folders' claims.json and tables are read."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from taskgeom.errors import TaskgeomError  # noqa: E402
from taskgeom.report.figures import save  # noqa: E402
from taskgeom.report.manifest import read_claims, read_manifest  # noqa: E402
from taskgeom.report.markdown import STATUS_TEXT, machine_line, number  # noqa: E402
from taskgeom.report.verdicts import write_verdicts  # noqa: E402
from taskgeom.runs.storage import atomic_write_text  # noqa: E402

_COLOURS = {"pass": "tab:green", "fail": "tab:red", "n/a": "tab:gray"}


def rungs(specs: list[str]) -> dict[str, Path]:
    """``{rung: folder}`` from ``NAME=PATH`` or ``PATH`` (named by its manifest's profile), in order."""
    named: dict[str, Path] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        folder = Path(path)
        name = name or read_manifest(folder)["profile"]
        if name in named:
            raise TaskgeomError(f"rung {name!r} given twice ({named[name]} and {folder}); name them NAME=PATH")
        named[name] = folder
    return named


def ladder_rows(named: dict[str, Path]) -> pd.DataFrame:
    """One row per (rung, claim, seed): value, status, and the claim's verdict, median, min, max,
    comparison and threshold at that rung."""
    rows = []
    for rung, folder in named.items():
        read_manifest(folder)  # a results folder of this version, or a clear error
        for claim in read_claims(folder):
            common = {
                "rung": rung,
                "claim": claim["id"],
                "verdict": claim["status"],
                "median": claim.get("median"),
                "min": claim.get("min"),
                "max": claim.get("max"),
                "comparison": claim["comparison"],
                "threshold": claim["threshold"],
            }
            rows += [
                {**common, "seed": row["seed"], "value": row["value"], "status": row["status"]}
                for row in claim.get("seeds") or []
            ]
    return pd.DataFrame(rows)


def rank_curves(named: dict[str, Path]) -> pd.DataFrame:
    """The OOD gain removed by V of each rank (mean over blocks) at the highest diversity of each
    rung: median, min and max over the seeds whose share is reliable (as the claims count them: a
    null or unreliable share is n/a for its seed), per (rung, recipe, rank); from each folder's
    tables/rank_curve.csv."""
    frames = []
    for rung, folder in named.items():
        path = folder / "tables" / "rank_curve.csv"
        if path.is_file():
            curve = pd.read_csv(path)
            curve = curve[
                curve["layer"].isna() & curve["value"].notna()
            ]  # the mean over blocks, where the gain is positive
            if "unreliable" in curve:
                curve = curve[~curve["unreliable"].eq(True)]
            high = curve[curve["diversity"] == curve.groupby("recipe")["diversity"].transform("max")]
            frames.append(
                high.groupby(["recipe", "diversity", "rank"])["value"]
                .agg(["median", "min", "max"])
                .reset_index()
                .assign(rung=rung)
            )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _cell(rows: pd.DataFrame) -> str:
    if rows.empty:
        return "-"
    first = rows.iloc[0]
    if first["verdict"] == "n/a":
        return "n/a"
    return f"{number(first['median'])} [{number(first['min'])}, {number(first['max'])}] {STATUS_TEXT[first['verdict']]}"


def ladder_markdown(named: dict[str, Path], rows: pd.DataFrame, curves: pd.DataFrame) -> str:
    """Where each rung came from, the claim x rung table (median [min, max] verdict over the seeds)
    and the rank curves."""
    lines = []
    for rung, folder in named.items():
        m = read_manifest(folder)
        scope = [
            f"recipes {', '.join(m['recipes'])}" if m.get("recipes") else "every recipe",
            f"grid {m['grid']}" if m.get("grid") else "the profile's grid",
        ]
        lines.append(
            f"- **{rung}**: profile `{m['profile']}`, seeds {', '.join(map(str, m['seeds']))}, {', '.join(scope)}, "
            f"taskgeom {m['taskgeom']} ({m.get('commit') or 'unknown commit'}); {machine_line(m)}"
        )
    order = list(dict.fromkeys(rows["claim"])) if len(rows) else []
    lines += ["", "| claim | threshold | " + " | ".join(named) + " |", "|---|---|" + "---|" * len(named)]
    for claim in order:
        mine = rows[rows["claim"] == claim]
        first = mine.iloc[0]
        cells = [_cell(mine[mine["rung"] == rung]) for rung in named]
        lines.append(f"| `{claim}` | {first['comparison']} {number(first['threshold'])} | " + " | ".join(cells) + " |")
    if len(curves):
        lines += [
            "",
            "% of OOD in-context gain removed by ablating V of rank r (highest diversity; median [min, max] over the seeds "
            "whose gain is reliable, as the claims count them; a recipe and rung with none is left out):",
            "",
            "| recipe | rung | " + " | ".join(f"r = {r}" for r in sorted(curves["rank"].unique())) + " |",
            "|---|---|" + "---|" * curves["rank"].nunique(),
        ]
        for (recipe, rung), part in curves.groupby(["recipe", "rung"], sort=False):
            by_rank = part.set_index("rank")
            lines.append(
                f"| {recipe} | {rung} | "
                + " | ".join(
                    f"{number(by_rank.loc[r, 'median'])} [{number(by_rank.loc[r, 'min'])}, {number(by_rank.loc[r, 'max'])}]"
                    if r in by_rank.index
                    else "-"
                    for r in sorted(curves["rank"].unique())
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def plot_ladder(rows: pd.DataFrame, rung_order: list[str], out: Path) -> list[Path]:
    """One figure per recipe, one panel per claim: each seed's value at each rung (green pass, red
    fail), the median joined across rungs, the threshold dashed. Returns the PNG paths."""
    paths = []
    rows = rows[rows["status"] != "n/a"]
    for recipe, mine in rows.groupby(rows["claim"].str.split(".").str[0], sort=False):
        claims = list(dict.fromkeys(mine["claim"]))
        cols = min(4, len(claims))
        fig, axes = plt.subplots(
            (len(claims) + cols - 1) // cols,
            cols,
            figsize=(3.2 * cols, 2.6 * ((len(claims) + cols - 1) // cols)),
            squeeze=False,
        )
        for ax, claim in zip(axes.flat, claims):
            part = mine[mine["claim"] == claim]
            x = part["rung"].map({r: i for i, r in enumerate(rung_order)})
            ax.scatter(x, part["value"], c=part["status"].map(_COLOURS), s=18, zorder=3)
            medians = part.groupby("rung")["value"].median().reindex(rung_order)
            present = medians.notna().to_numpy()  # rungs that measured the claim, joined in order
            ax.plot(
                [i for i, p in enumerate(present) if p],
                medians.dropna().values,
                color="black",
                lw=1,
                marker="_",
                zorder=2,
            )
            ax.axhline(part["threshold"].iloc[0], color="gray", ls="--", lw=1)
            ax.set_title(f"{claim} ({part['comparison'].iloc[0]} {number(part['threshold'].iloc[0])})", fontsize=8)
            ax.set_xticks(range(len(rung_order)), rung_order, fontsize=7)
            ax.tick_params(axis="y", labelsize=7)
        for ax in list(axes.flat)[len(claims) :]:
            ax.axis("off")
        fig.tight_layout()
        path = out / f"ladder_{recipe}.png"
        save(fig, path)
        paths.append(path)
    return paths


def write_ladder(specs: list[str], out: Path) -> str:
    """Write ladder.csv (the long rows), rank_curves.csv, ladder.md, the panels, and the verdict grid
    (verdicts.png, and verdicts.csv, the table it shows) into ``out``; return the Markdown."""
    named = rungs(specs)
    rows, curves = ladder_rows(named), rank_curves(named)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "ladder.csv", rows.to_csv(index=False))
    atomic_write_text(out / "rank_curves.csv", curves.to_csv(index=False))
    text = ladder_markdown(named, rows, curves)
    atomic_write_text(out / "ladder.md", text)
    plot_ladder(rows, list(named), out)
    write_verdicts(named, out)
    return text
