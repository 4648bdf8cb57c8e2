"""The HTML report, rebuilt from a results folder's files alone (``taskgeom report``): a summary
per section, one section per experiment (E1-E4, the dual modes) holding its claims beside the
figures and tables they come from, interactive Plotly figures (the library written once as
``plotly.min.js`` beside the page: no network needed), the PNG figures with their PDFs, sortable
tables, and the run settings and timings at the foot.

Reads ``claims.json``, ``reproduction.json`` (``manifest``), ``timings.json`` and every run's
``analysis/*.json`` (through ``tables/analysis.parquet``, which it writes too); writes
``report.html`` and ``plotly.min.js``; touches nothing else.
"""

from __future__ import annotations

import html
from collections import Counter
from pathlib import Path

import pandas as pd

from taskgeom.report.interactive import Evidence, evidence
from taskgeom.report.manifest import figure_section, read_claims, read_json, read_manifest, section
from taskgeom.report.manifest import sections as section_titles
from taskgeom.report.tables import run_config, write_analysis_table
from taskgeom.runs.storage import atomic_write_text

PLOTLY_JS = "plotly.min.js"

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1180px;margin:1em auto;padding:0 1em;color:#222}
nav{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:6px 0;z-index:10}nav a{margin-right:1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px}
th.sort{cursor:pointer;background:#f4f4f4}th.sort:after{content:" \\2195";color:#999}
.pass{color:#17702f;font-weight:bold}.fail{color:#b3261e;font-weight:bold}.na{color:#6b6b6b;font-weight:bold}
.unstable{color:#b35c00;font-weight:bold}.seed{display:block}
.warn{color:#fff;background:#b35c00;padding:0 4px;border-radius:3px;font-size:12px}.parts{font-size:12px}
.reason{font-weight:normal;font-size:12px;color:#555}figure{margin:1.2em 0}.evidence a{display:block;font-size:12px}
img{max-width:100%;border:1px solid #eee}figcaption{font-size:13px;color:#555}.plot{min-height:380px;border:1px solid #eee;margin:1em 0}
.scroll{max-height:420px;overflow:auto}section{border-top:2px solid #444;margin-top:2em}:target{outline:3px solid #f0c000}"""

_SCRIPT = """document.querySelectorAll('div.plot').forEach(function (div) {
  var spec = JSON.parse(document.getElementById(div.id + '-spec').textContent);
  Plotly.newPlot(div, spec.data, spec.layout, {responsive: true, displaylogo: false});
});
document.querySelectorAll('table.sortable th').forEach(function (th, _, all) {
  th.classList.add('sort');
  th.addEventListener('click', function () {
    var table = th.closest('table'), body = table.tBodies[0], col = th.cellIndex;
    var up = th.dataset.order !== 'up'; th.dataset.order = up ? 'up' : 'down';
    var value = function (row) { var t = row.cells[col].textContent, n = parseFloat(t); return isNaN(n) ? t : n; };
    Array.from(body.rows).sort(function (a, b) {
      var x = value(a), y = value(b), c = (typeof x === typeof y) ? (x < y ? -1 : x > y ? 1 : 0) : (typeof x === 'number' ? -1 : 1);
      return up ? c : -c;
    }).forEach(function (row) { body.appendChild(row); });
  });
});"""
_NAV = {"dual": "Dual modes", "other": "Other"}
_STATUS_CLASS = {"pass": "pass", "fail": "fail", "unstable": "unstable", "n/a": "na"}
_STATUS_LABEL = {"pass": "pass", "fail": "FAIL", "unstable": "unstable", "n/a": "n/a"}
_DOT = {"pass": "#17702f", "fail": "#b3261e", "n/a": "#999"}


def _number(x) -> str:
    if x is None:
        return "&ndash;"
    return f"{x:.4g}" if isinstance(x, float) else html.escape(str(x))


def _parts(parts: dict | None) -> str:
    """Parts as a compact 'name = value' list; a true ``unreliable`` is flagged, not listed."""
    parts = parts or {}
    items = [f"{html.escape(k)}&nbsp;=&nbsp;{_number(v)}" for k, v in parts.items() if k != "unreliable"]
    flag = "<span class=warn>unreliable</span> " if parts.get("unreliable") is True else ""
    return flag + ", ".join(items)


def _seed_parts(claim: dict) -> str:
    """Each seed's value, status and parts (a claim judged over seeds), else the claim's own parts."""
    rows = claim.get("seeds")
    if not rows:
        return _parts(claim.get("parts"))
    return "".join(
        f"<span class=seed>seed {row['seed']}: <span class={_STATUS_CLASS[row['status']]}>{_number(row['value'])}</span>"
        f"{' ' + _parts(row['parts']) if row['parts'] else ''}{_precondition(row.get('precondition'))}</span>"
        for row in rows
    )


def _precondition(precondition: dict | None) -> str:
    """' (model: e2.bayes_optimal 0.487, fail)' for a seed judged on a model that fails its precondition."""
    if not precondition or precondition["status"] == "pass":
        return ""
    return f" <span class=warn>(model: {html.escape(precondition['claim'])} {_number(precondition['value'])}, {precondition['status']})</span>"


def strip(claim: dict, width: int = 150, height: int = 22) -> str:
    """An inline SVG of the claim's per-seed values as dots (coloured by their status) against its
    threshold (a vertical line), on a linear axis spanning both; empty when no seed has a value."""
    values = [
        (row["value"], row["status"])
        for row in claim.get("seeds") or []
        if row["status"] != "n/a" and row["value"] is not None
    ]
    if not values:
        return ""
    threshold = claim["threshold"]
    low, high = min(min(v for v, _ in values), threshold), max(max(v for v, _ in values), threshold)
    pad = (high - low) * 0.08 or abs(threshold) * 0.1 or 1.0
    low, high = low - pad, high + pad
    x = lambda v: 6 + (width - 12) * (v - low) / (high - low)  # noqa: E731
    dots = "".join(
        f"<circle cx='{x(v):.1f}' cy='{height / 2}' r='4' fill='{_DOT[status]}' fill-opacity='0.75'><title>{v:.4g}</title></circle>"
        for v, status in values
    )
    return (
        f"<svg class=strip width={width} height={height} role=img aria-label='per-seed values against the threshold'>"
        f"<line x1=4 x2={width - 4} y1={height / 2} y2={height / 2} stroke='#ddd'/>"
        f"<line x1='{x(threshold):.1f}' x2='{x(threshold):.1f}' y1=2 y2={height - 2} stroke='#444' stroke-dasharray='3,2'/>{dots}</svg>"
    )


def _claim_row(claim: dict, links: list[tuple[str, str]]) -> str:
    status = claim["status"]
    value = "&ndash;" if status == "n/a" or claim["value"] is None else f"{claim['value']:.4g}"
    if claim.get("seeds") and len(claim["seeds"]) > 1 and claim.get("min") is not None:
        value += f"<div class=reason>median; range {claim['min']:.4g} .. {claim['max']:.4g}</div>"
    result = f"<td class='{_STATUS_CLASS[status]}'>{_STATUS_LABEL[status]}"
    if claim.get("reason"):
        result += f"<div class=reason>{html.escape(claim['reason'])}</div>"
    if claim.get("caveat"):
        result += f"<div class='reason warn'>{html.escape(claim['caveat'])}</div>"
    evidence = "".join(f"<a href='#{html.escape(anchor)}'>{html.escape(title)}</a>" for anchor, title in links)
    return (
        f"<tr id='claim-{html.escape(claim['id'])}'><td>{html.escape(claim['id'])}</td><td>{html.escape(claim['description'])}</td>"
        f"<td>{value}</td><td>{strip(claim)}</td><td>{html.escape(claim['comparison'])}&nbsp;{claim['threshold']:.4g}</td>"
        f"<td class=parts>{_seed_parts(claim)}</td>{result}</td><td class=evidence>{evidence}</td></tr>"
    )


def _figure_anchor(path: str) -> str:
    return "fig-" + Path(path).stem


def _table(frame: pd.DataFrame) -> str:
    """A sortable HTML table of ``frame`` (a missing value shown as a dash)."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_number(None if pd.isna(v) else v)}</td>" for v in row) + "</tr>"
        for row in frame.itertuples(index=False)
    )
    return f"<div class=scroll><table class=sortable><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _piece(piece: Evidence) -> str:
    title = f"<h4>{html.escape(piece.title)}</h4>"
    if piece.figure is not None:
        spec = piece.figure.replace("</", "<\\/")
        return (
            f"{title}<div class=plot id='{piece.anchor}'></div>"
            f"<script type='application/json' id='{piece.anchor}-spec'>{spec}</script>"
        )
    return f"<div id='{piece.anchor}'>{title}{_table(piece.table)}</div>"


def _png(figure: dict) -> str:
    anchor = _figure_anchor(figure["path"])
    return (
        f"<figure id='{anchor}'><img src='{html.escape(figure['path'])}' alt='{html.escape(figure['caption'])}'>"
        f"<figcaption>{html.escape(figure['caption'])} (<a href='{html.escape(figure['pdf'])}'>PDF</a>)</figcaption></figure>"
    )


def _summary(
    claims: list[dict], sections: dict[str, str], titles: dict[str, str], timings: dict, order: list[str], seeds: str
) -> str:
    counts = {name: Counter(c["status"] for c in claims if sections[c["id"]] == name) for name in titles}
    rows = "".join(
        f"<tr><td><a href='#sec-{name}'>{html.escape(titles[name])}</a></td><td class=pass>{n['pass']}</td>"
        f"<td class=fail>{n['fail']}</td><td class=unstable>{n['unstable']}</td><td class=na>{n['n/a']}</td></tr>"
        for name, n in counts.items()
        if sum(n.values())
    )
    total = Counter(c["status"] for c in claims)
    steps = timings.get("experiments", {})
    ranked = sorted(steps, key=lambda name: order.index(name) if name in order else len(order))  # in the order they ran
    times = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{steps[name]['wall_s']:.0f}</td><td>{steps[name]['cpu_s']:.0f}</td></tr>"
        for name in ranked
    )
    wall = timings.get("total", {}).get("wall_s")
    return (
        f"<h2 id=summary>Summary</h2><p id=totals><b>{total['pass']} pass, {total['fail']} fail, {total['unstable']} unstable, "
        f"{total['n/a']} n/a of {len(claims)} claims</b> over seeds {seeds} (pass: every seed passes; fail: every seed fails; "
        "unstable: the seeds disagree; n/a: the claim does not apply to what was measured, counted neither way)"
        f"{f'; {wall:.0f} s wall in all' if wall is not None else ''}.</p>"
        f"<div style='display:flex;gap:2em;align-items:flex-start'><table id=summary-table><tr><th>section</th><th>pass</th>"
        f"<th>fail</th><th>unstable</th><th>n/a</th></tr>{rows}</table>"
        f"<table id=time-table><tr><th>step of the reproduction</th><th>wall s</th><th>CPU s</th></tr>{times}</table></div>"
    )


def _settings(out: Path, manifest: dict) -> str:
    runs = []
    for name in manifest["runs"]:
        config = run_config(out / "runs" / name)
        task, model, train = config["task"], config["model"], config["train"]
        runs.append(
            f"<tr><td>{html.escape(name)}</td><td>{task['family']}</td><td>{task['diversity']}</td>"
            f"<td>{train['seed']}</td><td>{model['n_layers']}</td><td>{model['d_model']}</td><td>{model['n_heads']}</td>"
            f"<td>{model['max_len']}</td><td>{train['steps']}</td><td>{train['batch_size']}</td><td>{train['lr']:g}</td>"
            f"<td><code>{(manifest['models'].get(name) or '-')[:16]}</code></td></tr>"
        )
    machine = ", ".join(f"{k} {html.escape(str(v))}" for k, v in manifest["machine"].items())
    overrides = " ".join(manifest["overrides"]) or "none"
    return (
        f"<h2 id=settings>Run settings</h2><p>profile <b>{html.escape(manifest['profile'])}</b>; overrides: "
        f"{html.escape(overrides)}; taskgeom {html.escape(manifest['taskgeom'])}; device {html.escape(manifest['device'])}; "
        f"executor {html.escape(manifest['executor'])}.<br>machine: {machine}.</p>"
        "<table class=sortable><thead><tr><th>run</th><th>family</th><th>diversity k</th><th>seed</th><th>layers</th>"
        f"<th>width</th><th>heads</th><th>context</th><th>steps</th><th>batch</th><th>lr</th><th>model sha256</th></tr></thead><tbody>{''.join(runs)}"
        "</tbody></table>"
    )


def _megabytes(peak: float | None) -> str:
    return "-" if peak is None else f"{peak:.0f}"


def _timings(timings: dict) -> str:
    """Where the time went: wall and CPU seconds per stage."""
    if not timings:
        return ""
    stages = "".join(
        f"<tr><td>{html.escape(s['experiment'])}</td><td>{html.escape(s['stage'])} ({s['where']})</td>"
        f"<td>{s['wall_s']:.1f}</td><td>{s['cpu_s']:.1f}</td><td>{_megabytes(s.get('peak_mb'))}</td></tr>"
        for s in timings.get("stages", [])
    )
    total = timings.get("total", {"wall_s": float("nan"), "cpu_s": float("nan")})
    peak = f", peak resident memory {_megabytes(total['peak_mb'])} MB in one process" if total.get("peak_mb") else ""
    return (
        f"<h2 id=timings>Timings</h2><p>total {total['wall_s']:.0f} s wall, {total['cpu_s']:.0f} CPU-seconds{peak} "
        "(timings.json); stages run in a worker process are timed there, and their peak is their process's up to "
        "the stage's end.</p>"
        f"<table class=sortable><thead><tr><th>experiment</th><th>stage</th><th>wall s</th><th>CPU s</th>"
        "<th>peak MB</th></tr></thead>"
        f"<tbody>{stages}</tbody></table>"
    )


def _write_plotly(out: Path) -> None:
    """``plotly.min.js`` beside the page, written only when missing or different."""
    from plotly.offline import get_plotlyjs

    script, path = get_plotlyjs(), out / PLOTLY_JS
    if not path.is_file() or path.read_text(encoding="utf-8") != script:
        atomic_write_text(path, script)


def write_report(out: Path) -> None:
    """Rebuild ``out/report.html`` (and the long table, and ``plotly.min.js``) from the files of
    results folder ``out``."""
    out = Path(out)
    manifest = read_manifest(out)
    again = f"rerun `taskgeom reproduce --out {out}` (finished runs and analyses are reused)"
    claims = read_claims(out)
    timings = read_json(out / "timings.json", again) if (out / "timings.json").is_file() else {}
    titles = section_titles(manifest)
    sections = {c["id"]: section(c["id"], manifest["claims"].get(c["id"], ""), manifest["sections"]) for c in claims}
    pieces = evidence(write_analysis_table(out, manifest["runs"]), manifest)
    figures = manifest["figures"]
    targets = [(piece.claims, piece.anchor, piece.title) for piece in pieces]
    targets += [(f["claims"], _figure_anchor(f["path"]), f"figure: {Path(f['path']).name}") for f in figures]
    links = {c["id"]: [(anchor, title) for ids, anchor, title in targets if c["id"] in ids] for c in claims}
    body, present = [], []
    for name, title in titles.items():
        mine = [c for c in claims if sections[c["id"]] == name]
        if not mine:  # a section of an experiment this reproduction did not run
            continue
        pngs = [f for f in figures if figure_section(f, manifest["sections"]) == name]
        shown = [p for p in pieces if p.section == name]
        present.append(name)
        rows = "".join(_claim_row(c, links[c["id"]]) for c in mine)
        body.append(
            f"<section id='sec-{name}'><h2>{html.escape(title)}</h2>"
            "<table><tr><th>claim</th><th>what is measured</th><th>value</th><th>seeds</th><th>threshold</th><th>made of</th><th>result</th>"
            f"<th>evidence</th></tr>{rows}</table><h3>Interactive figures and tables</h3>{''.join(_piece(p) for p in shown)}"
            f"<h3>Figures</h3>{''.join(_png(f) for f in pngs)}</section>"
        )
    nav = (
        "<a href='#summary'>Summary</a>"
        + "".join(f"<a href='#sec-{name}'>{_NAV.get(name, name.upper())}</a>" for name in present)
        + "<a href='#settings'>Settings</a>"
        + ("<a href='#timings'>Timings</a>" if timings else "")
    )
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>taskgeom report</title><style>{_STYLE}</style>"
        f"<script src='{PLOTLY_JS}'></script></head><body><nav>{nav}</nav><h1>taskgeom: reproduction report</h1>"
        f"{_summary(claims, sections, titles, timings, ['schedule', *manifest['experiments']], ', '.join(map(str, manifest['seeds'])))}{''.join(body)}{_settings(out, manifest)}{_timings(timings)}"
        f"<script>{_SCRIPT}</script></body></html>"
    )
    _write_plotly(out)
    atomic_write_text(out / "report.html", page)
