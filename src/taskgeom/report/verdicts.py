"""The verdict grid, the first picture of the README and Home (``taskgeom ladder`` draws it beside
the panels): every claim (rows, in blocks by recipe, each block in the catalog's order) at every
results folder given (columns), coloured by its verdict over the seeds, with its median in the cell
and a caveat's mark where the verdict carries one. ``verdicts.csv`` is the table it shows, read from
the folders' claims.json alone; a test holds the published one to the published manifests."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.textpath import TextToPath  # noqa: E402

from taskgeom.claims.catalog import specs  # noqa: E402
from taskgeom.claims.rules import CAVEATS, caveat_marks  # noqa: E402
from taskgeom.report.figures import save  # noqa: E402
from taskgeom.report.manifest import read_claims, read_manifest  # noqa: E402
from taskgeom.report.markdown import number  # noqa: E402
from taskgeom.runs.storage import atomic_write_text  # noqa: E402

COLUMNS = ["claim", "recipe", "profile", "status", "median", "judged", "seeds", "caveat"]
COLOURS = {"pass": "#8fd18c", "fail": "#f2877a", "unstable": "#f6c453", "n/a": "#d0d0d0"}
MEANING = {
    "pass": "pass: every seed",
    "fail": "fail: every seed",
    "unstable": "unstable: seeds disagree",
    "n/a": "n/a: does not apply",
}
FEWER = "*"
FONT = 11.0  # points, every label and cell: at the README's width (about 830 px) it prints at 12 px or more
ROW, PAD, GAP = 0.30, 0.08, 0.35  # inches: a row's height, the space inside a cell, between the two columns of blocks


def verdict_table(named: dict[str, Path]) -> pd.DataFrame:
    """One row per claim measured in each folder of ``named`` ({profile: results folder}, the
    columns' order): its id, recipe, the profile, its verdict over the seeds, median, the number of
    seeds it was judged on (those not n/a) of the seeds run, and its caveat ('' when none), as the
    folder's claims.json has them; in blocks by recipe (the manifests' order), each block in the
    catalog's order (a claim the catalog lacks after it), then by profile."""
    rows, recipes = [], {}
    for profile, folder in named.items():
        recipes.update(dict.fromkeys(read_manifest(folder).get("recipes") or []))
        for claim in read_claims(folder):
            rows.append(
                {
                    "claim": claim["id"],
                    "recipe": claim["id"].split(".")[0],
                    "profile": profile,
                    "status": claim["status"],
                    "median": claim.get("median"),
                    "judged": sum(row["status"] != "n/a" for row in claim.get("seeds") or []),
                    "seeds": len(claim.get("seeds") or []),
                    "caveat": claim.get("caveat") or "",
                }
            )
    table = pd.DataFrame(rows, columns=COLUMNS)
    recipes.update(dict.fromkeys(table["recipe"]))
    names = {**dict.fromkeys(spec.name for spec in specs()), **dict.fromkeys(table["claim"].str.split(".", n=1).str[1])}
    rank = {
        "recipe": list(recipes).index,
        "claim": lambda claim: list(names).index(claim.split(".", 1)[1]),
        "profile": list(named).index,
    }
    return table.sort_values(
        ["recipe", "claim", "profile"],
        key=lambda column: column.map(rank[column.name]),
        kind="stable",
        ignore_index=True,
    )


def cell_text(row) -> str:
    """What a cell prints: the median to 3 significant digits ('n/a' where the claim does not apply),
    a star when it rests on fewer seeds than were run (the others n/a), a caveat's mark (``CAVEATS``:
    a dagger on a model that is not Bayes-optimal, a double dagger on one without an OOD mode)."""
    text = "n/a" if row["status"] == "n/a" or pd.isna(row["median"]) else number(float(row["median"]))
    return text + (FEWER if _fewer(row) else "") + caveat_marks(row["caveat"])


def _fewer(row) -> bool:
    return 0 < row["judged"] < row["seeds"]


def _width(text: str, bold: bool = False) -> float:
    """The width of ``text`` at FONT in inches, as matplotlib sets it."""
    width, _, _ = TextToPath().get_text_width_height_descent(
        text, FontProperties(size=FONT, weight="bold" if bold else "normal"), ismath=False
    )
    return width / 72


def _columns(heights: list[float]) -> int:
    """Where to split the blocks (in order) into two columns so that the taller one is shortest."""
    if len(heights) < 2:
        return len(heights)
    return min(range(1, len(heights)), key=lambda i: max(sum(heights[:i]), sum(heights[i:])))


def footnotes(table: pd.DataFrame, profiles: list[str]) -> list[str]:
    """The marks the grid uses, explained (only those it uses)."""
    notes = []
    if table.apply(_fewer, axis=1).any():
        notes.append(f"{FEWER} judged on fewer seeds than were run: on the others the claim does not apply")
    for text, mark, meaning in CAVEATS.values():
        if table["caveat"].str.contains(text, regex=False).any():
            notes.append(f"{mark} {text} on at least one seed ({meaning})")
    if len(table) < table["claim"].nunique() * len(profiles):
        notes.append("- not measured at that profile")
    return notes


def plot_verdicts(
    table: pd.DataFrame, profiles: list[str], sections: dict[str, str], path: Path, note: str = ""
) -> None:
    """Draw the grid of ``verdict_table``'s rows: a block per recipe (its section title, the profiles
    over the cells, a row per claim), the blocks in two columns, a legend below; ``note`` (the seeds
    and machine) under the title. A claim a profile did not measure is a blank cell with a dash."""
    blocks = [(recipe, list(dict.fromkeys(part["claim"]))) for recipe, part in table.groupby("recipe", sort=False)]
    cells = {(row["claim"], row["profile"]): row for _, row in table.iterrows()}
    label_w = max([_width(claim.split(".", 1)[1]) for _, claims in blocks for claim in claims] + [0.5]) + PAD
    cell_w = (
        max([_width(cell_text(row)) for row in cells.values()] + [_width(p, bold=True) for p in profiles]) + 2 * PAD
    )
    title_w = max([_width(sections.get(recipe, recipe.upper()), bold=True) for recipe, _ in blocks] + [0])
    block_w = max(label_w + cell_w * len(profiles), title_w + PAD)
    heights = [(len(claims) + 2.5) * ROW for _, claims in blocks]  # the title, the profiles, the claims, a space
    split = _columns(heights)
    columns = [blocks[:split], blocks[split:]] if split < len(blocks) else [blocks]
    width = len(columns) * block_w + (len(columns) - 1) * GAP + 2 * PAD
    top = 0.75 if note else 0.5  # the title, and the note
    body = max(sum(heights[:split]), sum(heights[split:]))
    notes = footnotes(table, profiles)
    height = top + body + (1 + len(notes)) * ROW + PAD

    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)  # inches from the top left
    ax.axis("off")
    ax.text(
        PAD,
        0.3,
        "Every claim's verdict over the seeds at each profile, its median in the cell",
        fontsize=FONT + 2,
        weight="bold",
        va="center",
    )
    if note:
        ax.text(PAD, 0.58, note, fontsize=FONT, va="center", color="#444444")
    for c, column in enumerate(columns):
        x0, y = PAD + c * (block_w + GAP), top
        for recipe, claims in column:
            ax.text(x0, y + ROW / 2, sections.get(recipe, recipe.upper()), fontsize=FONT, weight="bold", va="center")
            for i, profile in enumerate(profiles):
                ax.text(
                    x0 + label_w + (i + 0.5) * cell_w,
                    y + 1.5 * ROW,
                    profile,
                    fontsize=FONT,
                    weight="bold",
                    ha="center",
                    va="center",
                )
            y += 2 * ROW
            for claim in claims:
                ax.text(x0, y + ROW / 2, claim.split(".", 1)[1], fontsize=FONT, va="center")
                for i, profile in enumerate(profiles):
                    row, x = cells.get((claim, profile)), x0 + label_w + i * cell_w
                    ax.add_patch(
                        Rectangle(
                            (x + 0.02, y + 0.02),
                            cell_w - 0.04,
                            ROW - 0.04,
                            lw=0.6,
                            facecolor="white" if row is None else COLOURS[row["status"]],
                            edgecolor="#c8c8c8" if row is None else "none",
                        )
                    )
                    ax.text(
                        x + cell_w / 2,
                        y + ROW / 2,
                        "-" if row is None else cell_text(row),
                        fontsize=FONT,
                        ha="center",
                        va="center",
                        color="#888888" if row is None else "black",
                    )
                y += ROW
            y += ROW / 2
    y, x = top + body, PAD
    for status, meaning in MEANING.items():
        ax.add_patch(Rectangle((x, y + 0.06), 0.3, ROW - 0.12, facecolor=COLOURS[status]))
        ax.text(x + 0.38, y + ROW / 2, meaning, fontsize=FONT, va="center")
        x += 0.38 + _width(meaning) + 0.3
    for i, text in enumerate(notes):
        ax.text(PAD, y + (i + 1.5) * ROW, text, fontsize=FONT, va="center")
    save(fig, path)


def machine_note(named: dict[str, Path]) -> str:
    """'Seeds 0, 1, 2; Intel(R) Xeon(R) Processor, 2 cores, torch CPU capability AVX2': what the
    folders share (a part they differ in is left out)."""
    manifests = [read_manifest(folder) for folder in named.values()]
    parts = []
    seeds = {tuple(m["seeds"]) for m in manifests}
    if len(seeds) == 1:
        parts.append("seeds " + ", ".join(map(str, next(iter(seeds)))))
    machines = {
        (m["machine"].get("cpu"), m["machine"].get("cores"), m["machine"].get("cpu_capability")) for m in manifests
    }
    if len(machines) == 1:
        cpu, cores, capability = next(iter(machines))
        parts.append(f"{cpu}, {cores} cores, torch CPU capability {capability}")
    text = "; ".join(parts)
    return text[:1].upper() + text[1:]


def write_verdicts(named: dict[str, Path], out: Path) -> pd.DataFrame:
    """Write verdicts.csv and verdicts.png (and .pdf) into ``out``; return the table."""
    table = verdict_table(named)
    atomic_write_text(out / "verdicts.csv", table.to_csv(index=False))
    sections = {}
    for folder in named.values():
        sections = {**read_manifest(folder).get("sections", {}), **sections}
    plot_verdicts(table, list(named), sections, out / "verdicts.png", machine_note(named))
    return table
