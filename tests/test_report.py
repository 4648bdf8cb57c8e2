"""The report rebuilt from a results folder's files alone, its links and figures, the long table,
and the manifest's checks; read on a whole tiny reproduction (``tiny_reproduction``)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from conftest import SMOKE, TINY_SEEDS
from typer.testing import CliRunner

from taskgeom.analysis.protocol import EARLIER, STUDY
from taskgeom.claims.catalog import spec, specs
from taskgeom.cli import app
from taskgeom.report.manifest import read_claims, recorded_choices

REPORT_OUTPUTS = {"report.html", "plotly.min.js", "tables/analysis.parquet", "tables/analysis.csv"}


def _files(folder: Path) -> dict[str, tuple[str, int]]:
    """{relative path: (md5, mtime_ns)} of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (hashlib.md5(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


class _Page(HTMLParser):
    """The ids, the claim rows' links, the images and the summary table's cells of a report page."""

    def __init__(self):
        super().__init__()
        self.ids, self.links, self.images, self.summary, self.totals = set(), {}, [], [], ""
        self._claim, self._in, self._cells, self._text = None, None, None, False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "tr" and attrs.get("id", "").startswith("claim-"):
            self._claim = attrs["id"][len("claim-") :]
            self.links[self._claim] = []
        if tag == "a" and self._claim and attrs.get("href", "").startswith("#"):
            self.links[self._claim].append(attrs["href"][1:])
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "table" and attrs.get("id") == "summary-table":
            self._in = "summary"
        if tag == "tr" and self._in == "summary":
            self._cells = []
        if tag == "td" and self._cells is not None:
            self._text = True
            self._cells.append("")
        if tag == "p" and attrs.get("id") == "totals":
            self._in = "totals"

    def handle_endtag(self, tag):
        if tag == "tr":
            self._claim = None
            if self._cells:
                self.summary.append(self._cells)
            self._cells = None
        if tag == "table" and self._in == "summary" or tag == "p" and self._in == "totals":
            self._in = None
        if tag == "td":
            self._text = False

    def handle_data(self, data):
        if self._text and self._cells is not None:
            self._cells[-1] += data
        if self._in == "totals":
            self.totals += data


def _page(folder: Path) -> _Page:
    page = _Page()
    page.feed((folder / "report.html").read_text(encoding="utf-8"))
    return page


def test_the_report_command_rebuilds_the_same_page_from_the_files_alone(tiny_reproduction, tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(tiny_reproduction, copy)
    original = (copy / "report.html").read_text(encoding="utf-8")
    csv = (copy / "tables" / "analysis.csv").read_bytes()
    for name in ("report.html", "plotly.min.js", "tables/analysis.parquet"):
        (copy / name).unlink()
    before = _files(copy)

    result = CliRunner().invoke(app, ["report", str(copy)])
    assert result.exit_code == 0, result.output
    after = _files(copy)
    assert {k: v for k, v in after.items() if k not in REPORT_OUTPUTS} == {
        k: v for k, v in before.items() if k not in REPORT_OUTPUTS
    }
    assert set(after) - set(before) == {"report.html", "plotly.min.js", "tables/analysis.parquet"}
    assert (copy / "report.html").read_text(
        encoding="utf-8"
    ) == original  # nothing in the page comes from anything but the files
    assert (copy / "tables" / "analysis.csv").read_bytes() == csv
    assert result.output.strip() == str(copy / "report.html")


def test_the_summary_counts_equal_claims_json_and_every_claim_links_to_its_evidence(tiny_reproduction):
    claims = json.loads((tiny_reproduction / "claims.json").read_text())
    page = _page(tiny_reproduction)
    counts = Counter(c["status"] for c in claims)
    assert (
        f"{counts['pass']} pass, {counts['fail']} fail, {counts['unstable']} unstable, {counts['n/a']} n/a of {len(claims)} claims "
        "over seeds 0, 1"
    ) in page.totals
    summed = [sum(int(row[i]) for row in page.summary) for i in (1, 2, 3, 4)]
    assert summed == [counts["pass"], counts["fail"], counts["unstable"], counts["n/a"]]
    assert set(page.links) == {c["id"] for c in claims}
    for claim_id, targets in page.links.items():
        assert targets, f"{claim_id} links to no evidence"
        assert set(targets) <= page.ids, f"{claim_id} links to missing anchors {set(targets) - page.ids}"
    manifest = json.loads((tiny_reproduction / "reproduction.json").read_text())
    for (
        claim_id,
        targets,
    ) in page.links.items():  # the PNG figures a claim links to are exactly those registered as its evidence
        registered = {"fig-" + Path(f["path"]).stem for f in manifest["figures"] if claim_id in f["claims"]}
        assert {t for t in targets if t.startswith("fig-")} == registered, claim_id
    assert "fig-e1_m1_layers" in page.links["e1.P0"] and "e1-layers" in page.links["e1.P0"]
    assert "fig-rank_curve" in page.links["e1.ablate_V_ood"] and "dual-rank" in page.links["e1.ablate_V_ood"]


def test_every_figure_is_on_the_page_as_png_with_its_pdf(tiny_reproduction):
    manifest = json.loads((tiny_reproduction / "reproduction.json").read_text())
    page = _page(tiny_reproduction)
    assert sorted(page.images) == sorted(f["path"] for f in manifest["figures"])
    for figure in manifest["figures"]:
        assert (tiny_reproduction / figure["path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (tiny_reproduction / figure["pdf"]).read_bytes()[:5] == b"%PDF-"
    assert len(manifest["figures"]) >= 20


def test_the_long_table_holds_every_analysis_row_of_every_run(tiny_reproduction):
    table = pd.read_parquet(tiny_reproduction / "tables" / "analysis.parquet")
    expected = 0
    for run_dir in sorted((tiny_reproduction / "runs").glob("*/")):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        for path in sorted(run_dir.glob("analysis/*.json")):
            rows = json.loads(path.read_text())
            mine = table[(table["run"] == run_dir.name) & (table["analysis"] == path.stem)]
            assert len(mine) == len(rows)
            assert set(mine["recipe"]) == {config["name"]} and set(mine["diversity"]) == {config["task"]["diversity"]}
            assert [r["metric"] for r in rows] == mine["metric"].tolist()
            written = [math.nan if r.get("value") is None else r["value"] for r in rows]
            assert mine["value"].tolist() == pytest.approx(written, nan_ok=True)
            banded = [(i, r["band"]) for i, r in enumerate(rows) if r.get("band")]
            assert [(mine["band_low"].iloc[i], mine["band_high"].iloc[i]) for i, _ in banded] == [
                tuple(b) for _, b in banded
            ]
            expected += len(rows)
    e4 = json.loads((tiny_reproduction / "analysis" / "e4.json").read_text())
    expected += sum(len(rows) for rows in e4.values())
    assert len(table) == expected
    assert len(pd.read_csv(tiny_reproduction / "tables" / "analysis.csv")) == expected
    assert set(table["analysis"]) >= {"m1", "dual", "eval", "e4.p0", "e4.probes"}


def test_reproduce_trains_every_run_at_its_profile_and_records_it(tiny_reproduction):
    manifest = json.loads((tiny_reproduction / "reproduction.json").read_text())
    assert manifest["overrides"] == [] and manifest["profile"] == SMOKE
    configs = [yaml.safe_load(p.read_text()) for p in (tiny_reproduction / "runs").glob("*/config.yaml")]
    assert len(configs) == 9 * len(TINY_SEEDS)  # per seed: E1 and E3 at k = -1, 3, 8; E2; E4 at two diversities
    assert {(c["train"]["steps"], c["model"]["d_model"], c["model"]["n_layers"]) for c in configs} == {(30, 16, 1)}
    assert sorted(c["train"]["seed"] for c in configs) == sorted(list(TINY_SEEDS) * 9) and manifest["seeds"] == list(
        TINY_SEEDS
    )
    claim_ids = {c["id"] for c in json.loads((tiny_reproduction / "claims.json").read_text())}
    assert set(manifest["claims"]) == claim_ids and set(manifest["claims"].values()) == set(manifest["experiments"])
    assert manifest["forms"] == {name: getattr(STUDY, name) for name in EARLIER}  # the forms and search it used


def test_a_manifest_before_the_forms_reads_as_measured_and_judged_under_the_earlier_ones(tiny_reproduction):
    """Format 6 wrote "forms" only where ``taskgeom rejudge`` changed one: such a folder was measured
    and judged under the choices before 2026-12-08 (``protocol.EARLIER``), bar those it names."""
    found = json.loads((tiny_reproduction / "reproduction.json").read_text())
    assert recorded_choices(found) == found["forms"]
    older = {key: value for key, value in found.items() if key != "forms"}
    assert recorded_choices({**older, "format": 6}) == EARLIER
    rejudged = {**older, "format": 6, "forms": {"drop_form": "share"}}
    assert recorded_choices(rejudged) == {**EARLIER, "drop_form": "share"}


@pytest.mark.parametrize("damage", ["missing", "foreign", "unreadable"])
def test_the_report_command_refuses_a_folder_it_cannot_read_and_keeps_the_page(tiny_reproduction, tmp_path, damage):
    copy = tmp_path / "results"
    shutil.copytree(tiny_reproduction, copy)
    manifest = copy / "reproduction.json"
    if damage == "missing":
        manifest.unlink()
    elif damage == "foreign":
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 99}))
    else:
        manifest.write_bytes(b"\xff\xfe{")
    page = (copy / "report.html").read_bytes()
    result = CliRunner().invoke(app, ["report", str(copy)])
    assert result.exit_code == 2, result.output
    assert "reproduction.json" in result.output and "taskgeom reproduce --out" in result.output
    assert (copy / "report.html").read_bytes() == page


def _plot_specs(page: str) -> dict[str, dict]:
    return {
        m.group(1): json.loads(m.group(2).replace("<\\/", "</"))
        for m in re.finditer(r"<script type='application/json' id='([^']+)-spec'>(.*?)</script>", page, re.S)
    }


def test_every_line_of_every_interactive_figure_is_one_series(tiny_reproduction):
    """A line holds one value per x (a line mixing tasks, seeds or runs zigzags through several)."""
    specs = _plot_specs((tiny_reproduction / "report.html").read_text(encoding="utf-8"))
    assert len(specs) >= 15
    traces = [(anchor, trace) for anchor, spec in specs.items() for trace in spec["data"] if trace["type"] == "scatter"]
    lines = [(anchor, trace["name"], trace["x"]) for anchor, trace in traces if trace.get("fill") != "toself"]
    assert lines and [(a, n) for a, n, xs in lines if len(xs) != len(set(map(str, xs)))] == []
    # two seeds: each per-layer, per-position and diversity line has its range over the seeds drawn as a band
    bands = {
        (anchor, trace["name"].removesuffix(" (range over seeds)"))
        for anchor, trace in traces
        if trace.get("fill") == "toself"
    }
    banded = {(a, n) for a, n, _ in lines if a in ("e1-layers", "e3-positions", "dual-projection")}
    assert {a for a, _ in banded} == {"e1-layers", "e3-positions", "dual-projection"} and banded <= bands


def test_the_report_shows_only_the_runs_and_sections_of_its_reproduction(tiny_reproduction, tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(tiny_reproduction, copy)
    manifest = json.loads((copy / "reproduction.json").read_text())
    m1_e1 = next(
        name
        for name in manifest["runs"]
        if (copy / "runs" / name / "analysis" / "m1.json").exists() and name.startswith("e1-")
    )
    shutil.copytree(
        copy / "runs" / m1_e1, copy / "runs" / "e1-of-another-reproduction"
    )  # e.g. a smoke run in the same runs/
    claims = [
        c for c in json.loads((copy / "claims.json").read_text()) if c["id"].startswith("e4.")
    ]  # as `--only e4` writes
    (copy / "claims.json").write_text(json.dumps(claims))
    only = {
        **manifest,
        "experiments": ["e4"],
        "claims": {c["id"]: "e4" for c in claims},
        "figures": [f for f in manifest["figures"] if f["experiment"] == "e4"],
    }
    (copy / "reproduction.json").write_text(json.dumps(only))

    result = CliRunner().invoke(app, ["report", str(copy)])
    assert result.exit_code == 0, result.output
    table = pd.read_parquet(copy / "tables" / "analysis.parquet")
    assert "e1-of-another-reproduction" not in set(table["run"])
    page = _page(copy)
    assert {i for i in page.ids if i.startswith("sec-")} == {"sec-e4"}
    assert set(page.links) == {"e4.P0_failure", "e4.prefix_probe"}


def test_a_table_shows_a_missing_integer_as_a_dash():
    from taskgeom.report.html import _table

    page = _table(pd.DataFrame({"layer": pd.array([1, None], "Int64"), "value": [0.5, float("nan")]}))
    assert page.count("&ndash;") == 2 and "<td>1</td>" in page and "<td>0.5</td>" in page


def test_the_manifest_records_the_machine_and_every_model_s_bits(tiny_reproduction):
    manifest = json.loads((tiny_reproduction / "reproduction.json").read_text())
    machine = manifest["machine"]
    assert (
        machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and machine["torch"] == torch.__version__
    )
    assert machine["cpu"] and machine["mkl"] in torch.__config__.show() and machine["onednn"] in torch.__config__.show()
    assert machine["torch_threads"] == torch.get_num_threads() and isinstance(machine["kernel_environment"], dict)
    assert set(manifest["models"]) == set(manifest["runs"])
    for name, digest in manifest["models"].items():  # against an independent hash of the file
        assert (
            digest == hashlib.sha256((tiny_reproduction / "runs" / name / "model.safetensors").read_bytes()).hexdigest()
        )


def _claims_file(folder: Path) -> list[dict]:
    return json.loads((folder / "claims.json").read_text())


def test_compare_names_the_run_whose_bits_differ_and_the_claims_whose_verdict_differs(tiny_reproduction, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(tiny_reproduction, a)
    shutil.copytree(tiny_reproduction, b)
    same = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert same.exit_code == 0, same.output
    runs = json.loads((a / "reproduction.json").read_text())["runs"]
    assert (
        f"runs in both: {len(runs)} ({len(runs)} bitwise equal, 0 differ)" in same.output
        and "claims that differ: 0" in same.output
    )
    n_claims = len(_claims_file(a))
    assert (
        f"claims in both: {n_claims} ({n_claims} with the same verdict and every seed's value exactly equal)"
        in same.output
    )
    # b: one run trained to other bits (as on another CPU), one claim judged otherwise
    changed = runs[0]
    manifest = json.loads((b / "reproduction.json").read_text())
    manifest["models"][changed] = hashlib.sha256(b"other weights").hexdigest()
    planted = "planted-" + manifest["machine"]["cpu_capability"]  # differs from a's on any machine
    manifest["machine"]["cpu_capability"] = planted
    (b / "reproduction.json").write_text(json.dumps(manifest))
    claims = _claims_file(b)
    flipped = next(c for c in claims if c["status"] in ("pass", "fail"))
    flipped["status"] = "unstable"
    (b / "claims.json").write_text(json.dumps(claims))
    result = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 1, result.output
    assert f"({len(runs) - 1} bitwise equal, 1 differ)" in result.output and f"differs: {changed}" in result.output
    assert re.search(rf"cpu_capability +\S+ +!= {re.escape(planted)}", result.output)
    assert f"({n_claims - 1} with the same verdict and every seed's value exactly equal)" in result.output
    assert "claims that differ: 1" in result.output and re.search(
        rf"{re.escape(flipped['id'])} .*-> unstable .*verdict", result.output
    )


def test_each_claim_names_its_recipe_the_experiment_that_measured_it_and_its_one_description(tiny_reproduction):
    """A claim's description is its catalog entry's, the text the thresholds table prints: one text per claim."""
    manifest = json.loads((tiny_reproduction / "reproduction.json").read_text())
    experiments = {spec.experiment for spec in specs()}
    claims = _claims_file(tiny_reproduction)
    for claim in claims:
        assert claim["recipe"] == claim["id"].split(".")[0] and claim["recipe"] in manifest["recipes"], claim["id"]
        assert claim["experiment"] == manifest["claims"][claim["id"]] and claim["experiment"] in experiments, claim[
            "id"
        ]
        entry = spec(claim["experiment"], claim["id"].split(".", 1)[1])
        assert claim["description"] == entry.description, claim["id"]
    assert len(claims) > 40


def test_a_folder_whose_claims_name_their_recipe_experiment_is_read_as_today_s(tiny_reproduction, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(tiny_reproduction, old)
    manifest = json.loads((old / "reproduction.json").read_text())
    (old / "reproduction.json").write_text(json.dumps({**manifest, "format": 4}))
    claims = _claims_file(old)
    for claim in claims:  # what format 4 wrote: the recipe under "experiment", no "recipe"
        claim["experiment"] = claim.pop("recipe")
    (old / "claims.json").write_text(json.dumps(claims))
    assert read_claims(old) == _claims_file(tiny_reproduction)
    result = CliRunner().invoke(app, ["compare", str(old), str(tiny_reproduction)])
    assert result.exit_code == 0 and "claims that differ: 0" in result.output, result.output
    assert CliRunner().invoke(app, ["report", str(old), "--markdown"]).exit_code == 0


def test_the_markdown_table_is_the_claims_file_with_its_machine(tiny_reproduction):
    result = CliRunner().invoke(app, ["report", str(tiny_reproduction), "--markdown"])
    assert result.exit_code == 0, result.output
    claims = _claims_file(tiny_reproduction)
    counts = Counter(c["status"] for c in claims)
    assert (
        f"**{counts['pass']} pass, {counts['fail']} fail, {counts['unstable']} unstable, {counts['n/a']} n/a of {len(claims)} claims**"
        in result.output
    )
    assert (
        f"seeds {', '.join(map(str, TINY_SEEDS))}" in result.output
        and torch.backends.cpu.get_cpu_capability() in result.output
    )
    full, by_recipe = result.output.split(
        "| claim | threshold |"
    )  # the table per claim, then the same verdicts per recipe
    rows = [line for line in full.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [c["id"] for c in claims]
    assert {row.split("`")[1] for row in by_recipe.splitlines() if row.startswith("| `")} == {
        c["id"].split(".", 1)[1] for c in claims
    }
    for row, claim in zip(rows, claims):
        seeds = row.split(" | ")[4]
        assert [int(cell.split(":")[0]) for cell in seeds.split(", ")] == [r["seed"] for r in claim["seeds"]]
