"""The HTML report: the claims table and every registered figure with its caption."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from taskgeom import __version__
from taskgeom.claims import summary

if TYPE_CHECKING:
    from taskgeom.claims import Claim
    from taskgeom.experiments.base import Context

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
.pass{color:#17702f;font-weight:bold}.fail{color:#b3261e;font-weight:bold}.na{color:#6b6b6b;font-weight:bold}
.warn{color:#fff;background:#b35c00;padding:0 4px;border-radius:3px;font-size:12px}.parts{font-size:12px}
.reason{font-weight:normal;font-size:12px;color:#555}figure{margin:1.5em 0}
img{max-width:100%;border:1px solid #eee}figcaption{font-size:14px;color:#555}"""
_STATUS_CLASS = {"pass": "pass", "fail": "fail", "n/a": "na"}
_STATUS_LABEL = {"pass": "pass", "fail": "FAIL", "n/a": "n/a"}


def _number(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else html.escape(str(x))


def _parts(c: "Claim") -> str:
    """The parts as a compact 'name = value' list; a true ``unreliable`` is flagged, not listed."""
    if not c.parts:
        return ""
    items = [f"{html.escape(k)}&nbsp;=&nbsp;{_number(v)}" for k, v in c.parts.items() if k != "unreliable"]
    flag = "<span class=warn>unreliable</span> " if c.parts.get("unreliable") is True else ""
    return flag + ", ".join(items)


def _row(c: "Claim") -> str:
    value = "&ndash;" if c.status == "n/a" else f"{c.value:.4g}"
    result = f"<td class='{_STATUS_CLASS[c.status]}'>{_STATUS_LABEL[c.status]}"
    if c.reason:
        result += f"<div class=reason>{html.escape(c.reason)}</div>"
    return (
        f"<tr><td>{html.escape(c.id)}</td><td>{html.escape(c.description)}</td><td>{value}</td>"
        f"<td>{html.escape(c.comparison)}&nbsp;{c.threshold:.4g}</td><td class=parts>{_parts(c)}</td>{result}</td></tr>"
    )


def write_report(ctx: "Context") -> str:
    """The report page as a string; figures are linked relative to the output folder."""
    rows = "".join(_row(c) for c in ctx.claims)
    figures = "".join(
        f"<figure><img src='{html.escape(path)}' alt='{html.escape(caption)}'><figcaption>{html.escape(caption)}</figcaption></figure>"
        for path, caption in ctx.figures
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>taskgeom report</title><style>{_STYLE}</style></head><body>"
        f"<h1>taskgeom: reproduction report</h1><p>profile <b>{html.escape(ctx.profile)}</b>, taskgeom {__version__}; "
        f"{summary(ctx.claims)} (n/a: the claim does not apply to what was measured; counted neither way).</p>"
        f"<table><tr><th>claim</th><th>what is measured</th><th>value</th><th>threshold</th><th>made of</th><th>result</th></tr>{rows}</table>"
        f"<h2>Figures</h2>{figures}{_timings(ctx.timings.as_dict())}</body></html>"
    )


def _timings(timings: dict) -> str:
    """Where the time went: wall and CPU seconds per experiment, then per stage."""
    experiments = "".join(f"<tr><td>{html.escape(name)}</td><td></td><td>{t['wall_s']:.1f}</td><td>{t['cpu_s']:.1f}</td></tr>"
                          for name, t in timings["experiments"].items())
    stages = "".join(f"<tr><td>{html.escape(s['experiment'])}</td><td>{html.escape(s['stage'])} ({s['where']})</td>"
                     f"<td>{s['wall_s']:.1f}</td><td>{s['cpu_s']:.1f}</td></tr>" for s in timings["stages"])
    total = timings["total"]
    return (f"<h2>Timings</h2><p>total {total['wall_s']:.0f} s wall, {total['cpu_s']:.0f} CPU-seconds (timings.json); "
            "stages run in a sweep's worker processes are timed there.</p>"
            f"<table><tr><th>experiment</th><th>stage</th><th>wall s</th><th>CPU s</th></tr>{experiments}{stages}</table>")
