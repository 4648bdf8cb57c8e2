"""The documentation site (mkdocs, mkdocs-material, mkdocstrings; ``mkdocs.yml``) builds with
``mkdocs build --strict`` and reads right in headless Chromium: the API reference renders
``StudyRun`` and every public name, the CLI reference every option of ``reproduce``, the Protocol
page its section on projection R^2, and no internal link of the built site is broken. The README
stays short, and every link in it resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import typer
from markdown.extensions.toc import slugify

import taskgeom as tg
from taskgeom.cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = (
    "index",
    "getting-started",
    "concepts",
    "protocol",
    "cli",
    "python-api",
    "api",
    "adding-a-family",
    "hmm-example",
    "scaling-out",
    "results",
    "quick-seeds-0-5",
    "scale-ladder",
    "benchmarks",
    "changelog",
    "practicalities",
    "device-check",
    "contributing",
)
README_LIMIT = 160


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site as ``mkdocs build --strict`` writes it (a warning fails the build)."""
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert not re.search(r"^(WARNING|ERROR)", built.stderr, re.M), built.stderr
    return out


def reproduce_options() -> list[str]:
    """Every option name of ``taskgeom reproduce``, read from the Typer app itself."""
    group = typer.main.get_command(app)
    command = group.get_command(group.context_class(group, info_name="taskgeom"), "reproduce")
    return [name for param in command.params for name in param.opts if name.startswith("--")]


def test_the_site_builds_strict_with_every_page(site):
    assert [page for page in PAGES if not (site / f"{page}.html").is_file()] == []
    assert (site / "ladder" / "ladder_e1.png").is_file() and (site / "search" / "search_index.json").is_file()


def test_the_api_reference_documents_every_public_name(site):
    page = (site / "api.html").read_text(encoding="utf-8")
    documented = set(re.findall(r'id="(taskgeom[\w.]*)"', page))
    public = [
        name for name in tg.__all__ if name not in ("__version__", "tasks", "results", "MIN_RELIABLE_GAIN", "STUDY")
    ]
    assert {f"taskgeom.{name}" for name in public} - documented == set()
    assert {
        "taskgeom.results.results",
        "taskgeom.analysis.measures.shares.MIN_RELIABLE_GAIN",
        "taskgeom.analysis.protocol.STUDY",
        "taskgeom.tasks",
        "taskgeom.tasks.make",
    } <= documented
    for verb in (
        "StudyRun.heldout",
        "StudyRun.cache",
        "StudyRun.geometry",
        "StudyRun.loss",
        "StudyRun.ablate",
        "StudyRun.orthogonal_search",
        "Geometry.steer",
        "Geometry.ablate",
        "Geometry.projection_r2",
        "Geometry.p3",
    ):
        assert f"taskgeom.{verb}" in documented, verb
    for name in public + ["results", "MIN_RELIABLE_GAIN"]:  # each with its own docstring, not only a signature
        obj = getattr(tg, name)
        doc = (obj.__doc__ or "").strip()
        assert isinstance(obj, float) or (doc and not re.fullmatch(rf"{name}\(.*\)", doc, re.S)), name


@pytest.mark.browser
def test_the_site_reads_in_chromium_with_no_broken_internal_link(site, browser):
    from selenium.webdriver.common.by import By

    browser.get((site / "api.html").as_uri())
    study_run = browser.find_element(By.ID, "taskgeom.StudyRun")
    assert study_run.is_displayed() and "StudyRun" in study_run.text
    assert "heldout" in browser.find_element(By.ID, "taskgeom.StudyRun.heldout").text

    browser.get((site / "cli.html").as_uri())
    section = browser.execute_script("""var h = document.getElementById('reproduce'), text = h.textContent;
        for (var e = h.nextElementSibling; e && e.tagName !== 'H3' && e.tagName !== 'H2'; e = e.nextElementSibling) text += '\\n' + e.textContent;
        return text;""")
    options = reproduce_options()
    assert len(options) >= 10 and [name for name in options if name not in section] == []

    browser.get((site / "protocol.html").as_uri())
    headings = browser.execute_script(
        "return Array.from(document.querySelectorAll('article h2')).map(function (h) { return [h.id, h.textContent]; })"
    )
    (r2,) = [id_ for id_, text in headings if re.match(r"Projection R\^2", text)]
    following = browser.execute_script(
        "var e = document.getElementById(arguments[0]).nextElementSibling; return e ? e.textContent : ''", r2
    )
    assert "OOD" in following

    ids, hrefs = {}, {}  # page: its element ids; page: the href of every link on it, as the browser resolves it
    for page in sorted(
        set(site.rglob("*.html")) - {site / "404.html"}
    ):  # 404.html links from the server's root, for a web server
        browser.get(page.as_uri())
        ids[page], hrefs[page] = (
            browser.execute_script("""return [Array.from(document.querySelectorAll('[id]')).map(function (e) { return e.id; }),
            Array.from(document.querySelectorAll('a[href]')).map(function (a) { return a.href; })];""")
        )
    broken = []
    for page, links in hrefs.items():
        for href in links:
            url = urlsplit(href)
            target = Path(unquote(url.path))
            if url.scheme == "file" and not (
                target.is_file()
                and site in target.parents
                and (not url.fragment or unquote(url.fragment) in ids.get(target, ()))
            ):
                broken.append((page.name, href))
    assert len(ids) >= len(PAGES) and broken == [], broken


def markdown_links(text: str) -> list[str]:
    """The targets of every Markdown link and image of a page (not inside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose)


def headings(path: Path) -> set[str]:
    """The anchors mkdocs (Python-Markdown's toc) gives the headings of a Markdown page."""
    prose = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return {slugify(h, "-") for h in re.findall(r"^#{1,6} (.+?)\s*$", prose, flags=re.M)}


def test_the_readme_is_short_and_every_link_in_it_resolves():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_LIMIT
    links = markdown_links(readme)
    assert len(links) >= 10
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path).resolve()
        assert target.is_file() and ROOT in target.parents, link
        if anchor:
            assert anchor in headings(target), link


def test_every_file_of_the_repository_the_docs_name_is_in_it():
    """A path such as ``docs/results/quick/`` named in the README or a page (a published manifest, a
    figure) is there in a clean clone: once, a ``.gitignore`` rule kept the published manifests out
    of git while the pages sent readers to them."""
    named = set()
    for page in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        named |= {
            (page.name, path.rstrip(".,")) for path in re.findall(r"\bdocs/[\w./-]+", page.read_text(encoding="utf-8"))
        }
    missing = sorted((page, path) for page, path in named if not (ROOT / path).exists())
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *{path for _, path in named}], cwd=ROOT, capture_output=True, text=True
    ).stdout
    assert len(named) >= 10 and missing == [] and ignored == "", (missing, ignored)


@pytest.mark.parametrize("name", ["quick", "quick-bcbd461", "deep", "standard", "deep-7e255e1", "standard-7e255e1"])
def test_the_published_tables_are_what_their_manifests_print(name):
    """``taskgeom report docs/results/NAME --markdown``, the counts, the table and the unstable
    claims' parts, stands on the Results page as printed."""
    from taskgeom.report.markdown import claims_markdown

    assert claims_markdown(ROOT / "docs" / "results" / name) in (ROOT / "docs" / "results.md").read_text(
        encoding="utf-8"
    )


def test_the_protocols_thresholds_table_is_the_catalogs_and_the_published_claims_were_judged_by_it():
    """docs/protocol.md#thresholds holds ``claims.catalog.thresholds_table()`` as it prints, and every
    claim of every published reproduction has its catalog entry's comparison and threshold, in the
    forms it was judged under (an experiment that judged by a threshold of its own would differ)."""
    import json

    from taskgeom.claims.catalog import spec, specs, thresholds_table
    from taskgeom.report.manifest import MANIFEST, recorded_choices
    from taskgeom.studies.e2.claims import G_INTERVAL

    page = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    table = re.search(r"<!-- thresholds: generated .*? -->\n\n(.*?)\n\n<!-- end of thresholds -->", page, re.S)
    assert table and table.group(1) == thresholds_table(), (
        "regenerate it: python -c 'from taskgeom.claims.catalog import thresholds_table; print(thresholds_table())'"
    )
    claims = specs()
    assert len(table.group(1).splitlines()) == len(claims) + 2 and len({(c.experiment, c.name) for c in claims}) == len(
        claims
    )
    judged = 0
    for folder in sorted((ROOT / "docs" / "results").iterdir()):
        if not (folder / MANIFEST).exists():
            continue
        found = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
        experiments = found["claims"]
        # the one form whose threshold is not the catalog's: ood_between's before the rule (<= 1/2)
        earlier = {"ood_between": G_INTERVAL} if recorded_choices(found)["ood_between_form"] == "g-interval" else {}
        for claim in json.loads((folder / "claims.json").read_text(encoding="utf-8")):
            name = claim["id"].split(".", 1)[1]
            entry = earlier.get(name) or spec(experiments[claim["id"]], name)
            assert (claim["comparison"], claim["threshold"]) == (entry.comparison, entry.threshold), (
                folder.name,
                claim["id"],
            )
            judged += 1
    assert judged > 100


def test_the_readme_runs_the_tests_with_the_docs_extra_and_holds_the_sites_table():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    line = re.search(r"^Run the tests.*?^```bash\n(.*?)\n", readme, flags=re.S | re.M).group(1)  # what .ci/run extracts
    assert "python -m pytest" in line and '".[test,docs]"' in line and "&& taskgeom reproduce" in readme
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert (
        re.search(r'^docs = \[.*"mkdocs-material.*"mkdocstrings\[python\]', pyproject, flags=re.M)
        and "pdoc" not in pyproject
    )

    from taskgeom.report.markdown import claims_markdown

    printed = claims_markdown(ROOT / "docs" / "results" / "quick")
    source, table = (
        printed.splitlines()[0],
        printed[printed.index("| claim | threshold |") :],
    )  # the line it came from, the condensed table
    for page in (
        readme,
        (ROOT / "docs" / "index.md").read_text(encoding="utf-8"),
    ):  # the README holds what the site holds
        assert source in page and table in page


@pytest.mark.browser
def test_code_blocks_fit_the_page_and_claim_ids_stay_whole_at_1280_px(site, browser):
    """At a 1280 px window the set-up commands and the results/ tree wrap inside their code blocks
    (docs/stylesheets/extra.css) instead of running off the page, and a claim id in a table cell
    is on one line, not broken mid-word."""
    browser.set_window_size(1280, 1000)
    try:
        browser.get((site / "getting-started.html").as_uri())
        blocks = browser.execute_script("""return Array.from(document.querySelectorAll('article pre > code')).map(function (c) {
            return [c.scrollWidth, c.clientWidth, c.textContent.slice(0, 200)]; });""")
        assert len(blocks) >= 5 and any("pip install torch==2.13.0" in text for _, _, text in blocks)
        assert [text for scroll, client, text in blocks if scroll > client + 1] == []
        browser.get((site / "index.html").as_uri())
        cells = browser.execute_script("""return Array.from(document.querySelectorAll('article td code')).map(function (c) {
            return [c.textContent, c.getClientRects().length]; });""")
        assert any(text == "projection_r2_high_diversity" for text, _ in cells)
        assert [text for text, lines in cells if lines != 1] == []
    finally:
        browser.set_window_size(1300, 1800)


E3_TRAINING = {
    "deep": "deep-7e255e1",
    "deep-e3-4x": "deep-e3-4x",
}  # rung: its docs/results/<folder>, beside docs/ladder-e3-4x/places_<rung>.csv
BY_BLOCK = {"p0.cell_r2": "P0", "p1.additive_share": "P1", "p2.r2_task": "P2"}


def by_block_table() -> str:
    """E3's P0-P2 at resid_post of every block, median [min, max] over the seeds, at both rungs of
    docs/ladder-e3-4x (from ``taskgeom sensitivity --places --csv``), as the scale-ladder page has it."""
    import pandas as pd

    cells = {}
    for rung in E3_TRAINING:
        places = pd.read_csv(ROOT / "docs" / "ladder-e3-4x" / f"places_{rung}.csv")
        places = places[(places["analysis"] == "m1") & (places["site"] == "resid_post")]
        for (metric, layer), values in places.groupby(["metric", "layer"])["value"]:
            cells[metric, rung, layer] = f"{values.median():.3g} [{values.min():.3g}, {values.max():.3g}]"
    columns = [(metric, rung) for metric in BY_BLOCK for rung in E3_TRAINING]
    lines = [
        "| block | " + " | ".join(f"{BY_BLOCK[m]}, {r}" for m, r in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    layers = sorted({layer for _, _, layer in cells})
    return "\n".join(
        lines + [f"| {layer} | " + " | ".join(cells[m, r, layer] for m, r in columns) + " |" for layer in layers]
    )


def test_the_e3_training_section_is_its_manifests_and_the_places_of_the_same_runs():
    """The scale-ladder page's E3 rows are `taskgeom ladder`'s, its per-block table is the places
    CSVs', and those CSVs hold the runs the claims judged: at the block the claims read (3 of 6,
    resid_post) each seed's P0-P2 is claims.json's."""
    import json

    import pandas as pd

    page = (ROOT / "docs" / "scale-ladder.md").read_text(encoding="utf-8")
    ladder = (ROOT / "docs" / "ladder-e3-4x" / "ladder.md").read_text(encoding="utf-8").splitlines()
    rows = [line for line in page.splitlines() if line.startswith("| `e3.")]
    assert rows and all(row in ladder for row in rows)
    assert by_block_table() in page
    for rung, folder in E3_TRAINING.items():
        claims = {c["id"]: c for c in json.loads((ROOT / "docs" / "results" / folder / "claims.json").read_text())}
        places = pd.read_csv(ROOT / "docs" / "ladder-e3-4x" / f"places_{rung}.csv")
        for metric, claim in BY_BLOCK.items():
            read = places[(places["metric"] == metric) & (places["layer"] == 3) & (places["site"] == "resid_post")]
            assert dict(zip(read["seed"], read["value"])) == pytest.approx(
                {s["seed"]: s["value"] for s in claims[f"e3.{claim}"]["seeds"]}, rel=1e-12
            )
