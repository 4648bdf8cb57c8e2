"""What a newcomer reads first holds: the license in the package's metadata, the citation file,
the changelog the pages link to instead of issue numbers, ``taskgeom --version``, help texts that
read as sentences, and the Practicalities page's times, held to the published manifests."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_license_is_mit_in_the_file_and_in_the_installed_metadata():
    assert (
        (ROOT / "LICENSE")
        .read_text(encoding="utf-8")
        .startswith("MIT License\n\nCopyright (c) 2026 the taskgeom authors\n")
    )
    metadata = importlib.metadata.metadata("taskgeom")
    assert metadata.get("License") == "MIT"  # what `pip show taskgeom` prints as License:, with any pip


def test_version_prints_the_installed_version_and_exits_0():
    from typer.testing import CliRunner

    import taskgeom
    from taskgeom.cli import app

    result = CliRunner().invoke(app, ["--version"])
    number = importlib.metadata.version("taskgeom")
    assert result.exit_code == 0 and result.output == f"taskgeom {number}\n"
    assert number == taskgeom.__version__  # the package's own constant agrees with what pip installed


# The Citation File Format 1.2.0 (https://github.com/citation-file-format/citation-file-format, schema.json): the keys
# its schema requires and allows at the top level and in a reference, and the types an identifier may have. cffconvert
# --validate is not a dependency; this checks what a CITATION.cff of ours can get wrong.
CFF_REQUIRED = {"cff-version", "message", "title", "authors"}
CFF_KEYS = CFF_REQUIRED | {
    "abstract",
    "commit",
    "contact",
    "date-released",
    "doi",
    "identifiers",
    "keywords",
    "license",
    "license-url",
    "preferred-citation",
    "references",
    "repository",
    "repository-artifact",
    "repository-code",
    "type",
    "url",
    "version",
}
CFF_REFERENCE_REQUIRED = {"type", "title", "authors"}
CFF_REFERENCE_TYPES = {
    "article",
    "book",
    "conference-paper",
    "generic",
    "manual",
    "report",
    "software",
    "thesis",
    "unpublished",
}
CFF_IDENTIFIER_TYPES = {"doi", "url", "swh", "other"}


def cff_author(entry: dict) -> bool:
    """A person (family-names or given-names) or an entity (name), as the schema's definitions allow."""
    return isinstance(entry, dict) and any(
        isinstance(entry.get(key), str) and entry[key].strip() for key in ("family-names", "given-names", "name")
    )


def test_the_citation_file_is_cff_1_2_0_citing_the_software_and_the_study():
    import re

    import yaml

    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert CFF_REQUIRED <= set(cff) <= CFF_KEYS, set(cff) ^ CFF_KEYS
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software" and cff["title"] == "taskgeom"
    assert isinstance(cff["message"], str) and cff["message"].strip()
    assert cff["authors"] == [{"name": "the taskgeom authors"}] and all(map(cff_author, cff["authors"]))
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")  # (tomllib is Python >= 3.11)
    assert (
        f'\nversion = "{cff["version"]}"\n' in pyproject
        and cff["license"] == "MIT"
        and '\nlicense = {text = "MIT"}' in pyproject
    )

    (study,) = cff["references"]
    assert CFF_REFERENCE_REQUIRED <= set(study) and study["type"] in CFF_REFERENCE_TYPES
    assert study["type"] == "article"
    assert study["title"] == "Task Vector Geometry Underlies Dual Modes of Task Inference in Transformers"
    assert [a["family-names"] for a in study["authors"]] == ["Yan", "Yang", "Zhong"] and all(
        map(cff_author, study["authors"])
    )
    assert study["year"] == 2026 and study["url"] == "https://arxiv.org/abs/2605.03780"
    for identifier in study["identifiers"]:
        assert identifier["type"] in CFF_IDENTIFIER_TYPES and isinstance(identifier["value"], str)
        if identifier["type"] == "url":
            assert re.match(r"^(https|http|ftp|sftp)://.+", identifier["value"])
    assert {"type": "url", "value": "https://arxiv.org/abs/2605.03780"}.items() <= study["identifiers"][0].items()


# An issue number used as a reference: "issue 26", "issues 12 and 14", "#26" (not a Markdown anchor such as page.md#p3).
ISSUE_REFERENCE = r"\bissues? #?\d+|(?<![\w/.&-])#\d+\b"


def help_texts() -> dict[str, str]:
    """What ``taskgeom --help`` and ``taskgeom COMMAND --help`` print for every command, at a wide terminal."""
    import typer
    from typer.testing import CliRunner

    from taskgeom.cli import app

    group = typer.main.get_command(app)
    runner = CliRunner()
    texts = {}
    for command in [None, *group.list_commands(group.context_class(group, info_name="taskgeom"))]:
        args = ["--help"] if command is None else [command, "--help"]
        result = runner.invoke(app, args, env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
        assert result.exit_code == 0, (args, result.output)
        texts[" ".join(["taskgeom", *args])] = result.output
    return texts


def test_no_page_readme_or_help_text_names_an_issue_number():
    import re

    pages = {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    }
    texts = {**pages, **help_texts()}
    assert len(texts) >= 20 and "taskgeom reproduce --help" in texts
    named = {
        where: re.findall(rf".{{0,40}}(?:{ISSUE_REFERENCE}).{{0,20}}", text, flags=re.I)
        for where, text in texts.items()
    }
    assert {where: found for where, found in named.items() if found} == {}
    assert re.search(ISSUE_REFERENCE, "before issue 26") and re.search(ISSUE_REFERENCE, "see #26")
    assert not re.search(ISSUE_REFERENCE, "[P3](protocol.md#3-p3) and docs/ladder-before-26/")


def test_nothing_a_user_has_cites_the_specification_file_they_do_not_have():
    """The package, its recipes, the docs, the examples and the help texts point to docs/protocol.md and
    docs/concepts.md, never to the team's PAPER.md."""
    files = [
        *(ROOT / "src").rglob("*.py"),
        *(ROOT / "src").rglob("*.yaml"),
        *(ROOT / "docs").rglob("*.md"),
        ROOT / "README.md",
        ROOT / "examples" / "quickstart.ipynb",
        *(ROOT / "examples" / "hmm_family").rglob("*.py"),
    ]
    texts = {**{path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8") for path in files}, **help_texts()}
    assert len(texts) > 60 and "src/taskgeom/cli.py" in texts
    assert [where for where, text in texts.items() if "PAPER.md" in text] == []


UNRELEASED = (
    "The ablations' S from the study's own probe (task contrasts, rank K - 1); the earlier construction is the variant s-with-mean",
    "E4's P0 and prefix probes at resid_post of the M1 block",
    "A null or unreliable share is n/a for its seed",
    "Fig. 4 at 128 x 128 at every profile",
    "A deep profile for every family; standard redefined (6 blocks)",
    "M1 claims carry their model's bayes_optimal precondition",
)


def test_the_changelog_keeps_the_form_and_holds_every_entry_the_pages_link_to():
    import re

    from markdown.extensions.toc import slugify

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d\d-\d\d))?$", text, flags=re.M)
    assert versions[0] == ("Unreleased", "") and versions[-1] == ("0.1.0", "2026-12-02")
    assert len(versions) == len(re.findall(r"^## ", text, flags=re.M))
    kinds = re.findall(r"^### (\w+)", text, flags=re.M)
    assert set(kinds) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    unreleased = " ".join(text.split("\n## [0.1.0]")[0].split())
    assert [entry for entry in UNRELEASED if entry not in unreleased] == []

    anchors = {slugify(h, "-") for h in re.findall(r"^#{1,6} (.+?)\s*$", text, flags=re.M)}
    linked = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        linked |= set(re.findall(r"\]\((?:CHANGELOG|changelog)\.md#([\w-]+)\)", page.read_text(encoding="utf-8")))
    assert {"changed-the-studys-measurement-protocol-2026-12-02", "changed-the-studys-settings-2026-12-02"} <= linked
    assert linked - anchors == set()
    assert (ROOT / "docs" / "changelog.md").read_text(encoding="utf-8").strip() == '--8<-- "CHANGELOG.md"'


def test_help_texts_read_as_sentences():
    """``taskgeom --help`` lists each command's whole summary on its row, not broken where its
    docstring's source lines break ("Mixed / precision"); rich markup does not eat "[min, max]"."""
    import re

    import typer
    from typer.testing import CliRunner

    from taskgeom.cli import app, one_line

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="taskgeom")
    panel = [
        line
        for line in CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"}).output.split("Commands")[1].splitlines()
        if line.startswith("│")
    ]
    start = len(panel[0]) - len(panel[0][1:].lstrip().split(" ", 1)[1].lstrip())  # where the summaries' column starts
    width = len(panel[0]) - 1 - start  # its width, up to the closing "│"
    rows, lines, name = {}, {}, None
    for line in panel:  # a row: "│ name  summary ... │", continued on lines that start with "│" and spaces
        if not line.startswith("│  "):
            name = line.strip("│ ").split()[0]
        lines.setdefault(name, []).append(line[start:-1].rstrip())
        rows[name] = " ".join(" ".join(lines[name]).split())
    for name, wrapped in lines.items():  # a line ends only where the next word would not fit on it
        for line, following in zip(wrapped, wrapped[1:]):
            assert len(line) + 1 + len(following.split()[0]) > width - 2, (name, line, following)
    for name in group.list_commands(root):
        summary = one_line(group.get_command(root, name).help).replace("\\[", "[")
        assert rows[name] == " ".join(summary.split()), name
    texts = help_texts()
    assert "Mixed precision: --set train.precision=bf16." in rows["train"]
    assert "median [min, max] and verdict" in " ".join(texts["taskgeom ladder --help"].split())
    assert not re.search(r"\w  \w", " ".join(rows.values()))  # no word dropped between two spaces


SET_UP = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && taskgeom reproduce",
    'python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ".[test,docs]" -e '
    "examples/hmm_family && python -m pytest",
)
CPU_WHEEL = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def test_the_install_text_says_what_pip_fetches_and_where_the_cpu_wheel_is():
    import re

    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = page.read_text(encoding="utf-8")
        blocks = re.findall(r"^```bash\n(.*?)\n```", text, flags=re.S | re.M)
        assert blocks[-2:] == list(SET_UP) and f"&& {CPU_WHEEL}" in blocks[0], (
            page.name
        )  # the two set-up lines as CI runs them
        prose = " ".join(text.split())
        assert "fetches the CUDA build" in prose and "--device cuda" in prose, page.name
        assert "Nothing in the published results was measured on a GPU" in prose, page.name
    texts = help_texts()  # the option the GPU note names, on the commands it names
    assert all("--device" in texts[f"taskgeom {name} --help"] for name in ("train", "sweep", "reproduce"))


PUBLISHED = (
    "quick",
    "quick-bcbd461",
    "deep",
    "standard",
    "quick-6c99fae",
    "quick-41ff3c0",
    "quick-c65b65f",
    "deep-7e255e1",
    "standard-7e255e1",
    "deep-e3-4x",
    "quick-cc12df1",
    "wide",
    "long-e1",
)  # docs/results/<name>: the published reproductions, in the Practicalities page's order


def duration(seconds: float) -> str:
    """``49 min 31 s``, ``1 h 5 min 51 s``."""
    hours, rest = divmod(round(seconds), 3600)
    minutes, secs = divmod(rest, 60)
    return " ".join(([f"{hours} h"] if hours else []) + [f"{minutes} min", f"{secs} s"])


def published_times() -> list[dict[str, str]]:
    """The rows of the Practicalities page's table of times, read from each published reproduction's
    reproduction.json and timings.json (``python -c 'import test_newcomer as t; print(t.times_table())'``
    in ``tests/`` prints the table)."""
    import json

    rows = []
    for name in PUBLISHED:
        folder = ROOT / "docs" / "results" / name
        manifest = json.loads((folder / "reproduction.json").read_text(encoding="utf-8"))
        timings = json.loads((folder / "timings.json").read_text(encoding="utf-8"))
        machine = manifest["machine"]
        grid = manifest["grid"]
        rows.append(
            {
                "manifests": f"`docs/results/{name}/`",
                "profile": f"`{manifest['profile']}`" + "".join(f", `{o}`" for o in manifest["overrides"]),
                "recipes": ", ".join(manifest["recipes"]),
                "experiments": ", ".join(manifest["experiments"]),
                "k": "the profile's" if grid is None else ", ".join(map(str, grid)),
                "seeds": ", ".join(map(str, manifest["seeds"])),
                "runs": str(len(manifest["runs"])),
                "wall": duration(timings["total"]["wall_s"]),
                "wall s": f"{timings['total']['wall_s']:,.1f}",
                "CPU s": f"{timings['total']['cpu_s']:,.1f}",
                "training wall s": f"{timings['experiments']['schedule']['wall_s']:,.1f}",
                "machine": f"{machine['cpu']}, {machine['cpu_capability']}, {machine['cores']} cores, {machine['torch_threads']} torch threads, "
                f"kernels {machine['kernels']}, torch {machine['torch']}",
                "commit": manifest["commit"].removeprefix("commit "),
            }
        )
    return rows


def times_table() -> str:
    rows = published_times()
    header = [
        "manifests",
        "profile",
        "recipes",
        "experiments",
        "k",
        "seeds",
        "runs",
        "wall",
        "wall s",
        "CPU s",
        "training wall s",
        "machine",
        "commit",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row[key] for key in header) + " |" for row in rows])


def test_the_practicalities_page_times_are_the_published_manifests():
    """Every cell of the page's table of times is what the published reproduction.json and
    timings.json say, each number read back and compared; every duration the page states is one
    of the table's; the exit codes it lists are the CLI's."""
    import json
    import re

    from taskgeom import cli

    page = (ROOT / "docs" / "practicalities.md").read_text(encoding="utf-8")
    table = re.search(r"^\| manifests \| profile \|.*?\n\n", page, flags=re.S | re.M).group(0).strip().splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in table[2:]]
    assert rows == published_times()  # the table as the manifests print it ...
    for row in rows:  # ... and each number read back from the page against the files
        folder = ROOT / row["manifests"].strip("`")
        timings = json.loads((folder / "timings.json").read_text(encoding="utf-8"))
        manifest = json.loads((folder / "reproduction.json").read_text(encoding="utf-8"))
        assert float(row["wall s"].replace(",", "")) == timings["total"]["wall_s"]
        assert float(row["CPU s"].replace(",", "")) == timings["total"]["cpu_s"]
        assert float(row["training wall s"].replace(",", "")) == timings["experiments"]["schedule"]["wall_s"]
        h, m, s = re.fullmatch(r"(?:(\d+) h )?(\d+) min (\d+) s", row["wall"]).groups()
        assert abs(int(h or 0) * 3600 + int(m) * 60 + int(s) - timings["total"]["wall_s"]) <= 0.5
        assert int(row["runs"]) == len(manifest["runs"]) and row["seeds"] == ", ".join(map(str, manifest["seeds"]))
        assert row["commit"] in manifest["commit"] and f"{manifest['machine']['cores']} cores" in row["machine"]
    assert {row["manifests"] for row in rows} == {
        f"`docs/results/{p.name}/`" for p in (ROOT / "docs" / "results").iterdir() if (p / "timings.json").is_file()
    }  # every published reproduction
    durations = re.findall(r"\b(?:\d+ h )?\d+ min \d+ s\b", page)
    assert durations and set(durations) <= {row["wall"] for row in rows}

    codes = re.findall(r"^\| (\d) \| ", page, flags=re.M)
    assert codes == ["0", *map(str, sorted({cli.EXIT_FAILED, cli.EXIT_BAD_INPUT, cli.EXIT_REFUSED, cli.EXIT_BUG}))]
    prose = " ".join(page.split())
    assert "taskgeom reproduce --plan" in prose and "## Troubleshooting" in page
    assert all(
        name in prose for name in ("Ray", "transformers", "wandb", "TensorBoard", "Selenium", "Chromium")
    )  # the [test] extra


def test_the_sites_stylesheet_wraps_code_blocks_and_keeps_table_code_whole():
    import re

    import yaml

    config = yaml.load(
        (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader
    )  # (mkdocs.yml holds no custom tags)
    assert "stylesheets/extra.css" in config["extra_css"]
    nav = [next(iter(entry.values())) for entry in config["nav"]]
    assert "practicalities.md" in nav and "changelog.md" in nav
    css = re.sub(
        r"/\*.*?\*/", "", (ROOT / "docs" / "stylesheets" / "extra.css").read_text(encoding="utf-8"), flags=re.S
    )
    rules = {" ".join(selector.split()): body for selector, body in re.findall(r"([^{}]+)\{([^}]*)\}", css)}
    assert any("pre > code" in selector and "white-space: pre-wrap" in body for selector, body in rules.items())
    assert any("td code" in selector and "white-space: nowrap" in body for selector, body in rules.items())
    home = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    assert "## Set up and run" in home and "## A study in Python" in home
    assert "(getting-started.md#install-and-reproduce)" in home and "(python-api.md)" in home


def test_the_reproduction_times_the_readme_and_getting_started_give_are_the_manifests():
    """The set-up line's times, in whole minutes, are the published quick reproductions' wall times."""
    import json
    import re

    minutes = {
        name: round(json.loads((ROOT / "docs" / "results" / name / "timings.json").read_text())["total"]["wall_s"] / 60)
        for name in ("quick", "quick-41ff3c0", "quick-cc12df1", "quick-c65b65f")
    }
    for page in (ROOT / "README.md", ROOT / "docs" / "getting-started.md"):
        text = " ".join(page.read_text(encoding="utf-8").split())
        now, beside, amd, intel = re.search(
            r"(\d+) minutes on a 2-core AMD EPYC with nothing else running under the claim forms of 2026-12-08, "
            r"(\d+) beside the test suite under the corrections of 2026-12-04, "
            r"(\d+) on a 2-core AMD EPYC and (\d+) on a 2-core Intel Xeon before them",
            text,
        ).groups()
        assert (int(now), int(beside), int(amd), int(intel)) == (
            minutes["quick"],
            minutes["quick-41ff3c0"],
            minutes["quick-cc12df1"],
            minutes["quick-c65b65f"],
        ), page.name


def test_the_help_names_each_published_folders_cpu_as_its_manifest_records_it():
    """``taskgeom --help`` says which published quick folder is which CPU's; each named folder's
    reproduction.json records that CPU (the text went stale once when the folders moved)."""
    import json
    import re

    from typer.testing import CliRunner

    from taskgeom.cli import app

    text = " ".join(CliRunner().invoke(app, ["--help"], env={"COLUMNS": "250"}).output.replace("│", " ").split())
    named = re.findall(r"docs/results/([\w.-]+) (?:is )?an? (AMD EPYC|Intel Xeon)'s", text)
    assert len(named) == 2, text
    for folder, vendor in named:
        cpu = json.loads((ROOT / "docs" / "results" / folder / "reproduction.json").read_text())["machine"]["cpu"]
        assert cpu.startswith(vendor.split()[0]), (folder, vendor, cpu)  # "AMD EPYC", "Intel(R) Xeon(R) ..."
