"""The verdict grid that opens the README and Home: its table is what the published manifests'
claims.json say (each claim's verdict, median and caveat at each profile, in the catalog's order),
the committed docs/ladder/verdicts.csv is that table rebuilt now (a manifest changed without the
grid redrawn fails), a planted change is caught, and the figure stays readable at the README's width."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd
from PIL import Image

from taskgeom.claims.catalog import specs
from taskgeom.report.verdicts import FONT, cell_text, footnotes, plot_verdicts, verdict_table

ROOT = Path(__file__).resolve().parents[1]
GRID = ROOT / "docs" / "ladder"
README_WIDTH = 830  # px: the width GitHub gives a README's content


def published_command() -> list[str]:
    """The rungs of the `taskgeom ladder` command the README's caption names (NAME=PATH each)."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    command = re.search(r"`taskgeom ladder ([^`]*?) --out docs/ladder`", readme)
    assert command, "the README's caption names the command that drew the grid"
    return command.group(1).split()


def published() -> dict[str, Path]:
    return {name: ROOT / path for name, _, path in (spec.partition("=") for spec in published_command())}


def _claims(folder: Path) -> list[dict]:
    return json.loads((folder / "claims.json").read_text(encoding="utf-8"))


def test_the_readme_and_home_open_with_the_grid_drawn_from_the_published_manifests():
    for page, prefix in ((ROOT / "README.md", "docs/"), (ROOT / "docs" / "index.md", "")):
        first = re.search(r"!\[[^\]]*\]\(([^)]+)\)", page.read_text(encoding="utf-8")).group(1)
        assert first == f"{prefix}ladder/verdicts.png", page.name
    assert published_command() == [
        "quick=docs/results/quick",
        "deep=docs/results/deep",
        "standard=docs/results/standard",
    ]
    assert "--out docs/ladder" in " ".join((ROOT / "docs" / "scale-ladder.md").read_text(encoding="utf-8").split())


def test_the_grids_table_is_what_each_manifest_says():
    named = published()
    table = verdict_table(named)
    assert len(table) == sum(len(_claims(folder)) for folder in named.values())
    cells = table.set_index(["claim", "profile"])
    assert cells.index.is_unique
    for profile, folder in named.items():
        for claim in _claims(folder):
            cell = cells.loc[(claim["id"], profile)]
            assert cell["status"] == claim["status"] and cell["caveat"] == (claim["caveat"] or ""), (
                profile,
                claim["id"],
            )
            assert cell["median"] == claim["median"] or (pd.isna(cell["median"]) and claim["median"] is None), (
                profile,
                claim["id"],
            )
            assert (cell["judged"], cell["seeds"]) == (
                sum(s["status"] != "n/a" for s in claim["seeds"]),
                len(claim["seeds"]),
            )
    names = list(dict.fromkeys(spec.name for spec in specs()))
    for recipe, part in table.groupby("recipe", sort=False):  # a block per recipe, in the catalog's order
        order = [names.index(claim.split(".", 1)[1]) for claim in dict.fromkeys(part["claim"])]
        assert order == sorted(order), recipe
    assert list(dict.fromkeys(table["recipe"])) == ["e1", "e2", "e3", "e4"]
    assert list(table["profile"][: len(named)]) == list(named)
    shown = {(row["claim"], row["profile"]): cell_text(row) for _, row in table.iterrows()}
    assert shown[("e2.P0", "quick")] == "0.78\u2020" and shown[("e3.ablate_V_ood", "deep")] == "6.67*"
    assert shown[("e3.ablate_S_ood", "quick")] == "n/a" and shown[("e1.P3", "quick")] == "4.76e-05"
    assert shown[("e3.projection_r2_drop", "deep")] == "0.222\u2021"


def test_the_committed_grid_is_the_manifests_now():
    """A manifest changed without `taskgeom ladder` run again (the command the README names) fails here."""
    committed = (GRID / "verdicts.csv").read_text(encoding="utf-8")
    assert committed == verdict_table(published()).to_csv(index=False), (
        "redraw it: taskgeom ladder " + " ".join(published_command()) + " --out docs/ladder"
    )


def test_a_planted_change_in_a_manifest_is_caught(tmp_path):
    named = published()
    planted = tmp_path / "quick"
    shutil.copytree(named["quick"], planted, ignore=shutil.ignore_patterns("tables"))
    claims = _claims(planted)
    flipped = next(c for c in claims if c["status"] == "pass")
    flipped["status"] = "fail"
    (planted / "claims.json").write_text(json.dumps(claims), encoding="utf-8")
    table = verdict_table({**named, "quick": planted})
    committed = pd.read_csv(GRID / "verdicts.csv", keep_default_na=False, na_values=[""])
    assert table.to_csv(index=False) != (GRID / "verdicts.csv").read_text(encoding="utf-8")
    changed = table[table["status"] != committed["status"]]
    assert [(row.claim, row.profile, row.status) for row in changed.itertuples()] == [(flipped["id"], "quick", "fail")]


def test_a_claim_missing_at_a_profile_is_a_blank_cell_and_the_grid_is_drawn(tmp_path):
    named = published()
    fewer = tmp_path / "deep"
    shutil.copytree(named["deep"], fewer, ignore=shutil.ignore_patterns("tables"))
    (fewer / "claims.json").write_text(
        json.dumps([c for c in _claims(fewer) if not c["id"].startswith("e4.")]), encoding="utf-8"
    )
    table = verdict_table({"quick": named["quick"], "deep": fewer})
    assert set(table[table["recipe"] == "e4"]["profile"]) == {"quick"}
    assert any(note.startswith("- not measured") for note in footnotes(table, ["quick", "deep"]))
    plot_verdicts(table, ["quick", "deep"], {"e1": "E1"}, tmp_path / "verdicts.png")
    assert Image.open(tmp_path / "verdicts.png").size[0] > 0 and (tmp_path / "verdicts.pdf").is_file()


def test_the_committed_grid_is_readable_at_the_readmes_width():
    """Its text (FONT points at the resolution the PNG records) prints at 12 px or more once the
    image is scaled to the README's width."""
    image = Image.open(GRID / "verdicts.png")
    (width, height), dpi = image.size, image.info["dpi"][0]
    assert FONT * dpi / 72 * min(1.0, README_WIDTH / width) >= 12.0 and height < 1.5 * width
