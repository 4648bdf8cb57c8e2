"""The HTML report: the claims table and every registered figure with its caption."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from taskgeom import __version__

if TYPE_CHECKING:
    from taskgeom.experiments.base import Context

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
.pass{color:#17702f;font-weight:bold}.fail{color:#b3261e;font-weight:bold}figure{margin:1.5em 0}
img{max-width:100%;border:1px solid #eee}figcaption{font-size:14px;color:#555}"""


def write_report(ctx: "Context") -> str:
    """The report page as a string; figures are linked relative to the output folder."""
    passed = sum(c.passed for c in ctx.claims)
    rows = "".join(
        f"<tr><td>{html.escape(c.id)}</td><td>{html.escape(c.description)}</td><td>{c.value:.4g}</td>"
        f"<td>{html.escape(c.comparison)} {c.threshold:.4g}</td><td class={'pass' if c.passed else 'fail'}>{'pass' if c.passed else 'FAIL'}</td></tr>"
        for c in ctx.claims
    )
    figures = "".join(
        f"<figure><img src='{html.escape(path)}' alt='{html.escape(caption)}'><figcaption>{html.escape(caption)}</figcaption></figure>"
        for path, caption in ctx.figures
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>taskgeom report</title><style>{_STYLE}</style></head><body>"
        f"<h1>taskgeom: reproduction report</h1><p>profile <b>{html.escape(ctx.profile)}</b>, taskgeom {__version__}; "
        f"{passed} of {len(ctx.claims)} claims pass.</p>"
        f"<table><tr><th>claim</th><th>what is measured</th><th>value</th><th>threshold</th><th>result</th></tr>{rows}</table>"
        f"<h2>Figures</h2>{figures}</body></html>"
    )
