"""An mkdocs hook: the CLI page's reference, written from the Typer app's own command definitions.

Where ``cli.md`` holds the marker ``<!-- cli-reference -->``, each command of ``taskgeom`` gets a
section: its help text, its usage line and a table of its arguments and options, each with the
text ``taskgeom COMMAND --help`` prints for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))  # this checkout's taskgeom, not another install


def cell(text: str) -> str:
    """One Markdown table cell: a single line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def params_table(command, ctx) -> list[str]:
    """The rows of a command's arguments and options: [name, help] as ``--help`` prints them."""
    records = [param.get_help_record(ctx) for param in command.params if not param.hidden]
    rows = [f"| `{cell(name)}` | {cell(text)} |" for name, text in filter(None, records)]
    return ["| argument or option | what it does |", "|---|---|", *rows] if rows else []


def reference() -> str:
    """The Markdown of every command: ``### name``, its help, usage and parameters."""
    import typer

    from taskgeom.cli import app

    group = typer.main.get_command(app)
    root = group.context_class(group, info_name="taskgeom")
    lines = [f"The command group's own option: {', '.join(f'`{r[0]}` ({r[1]})' for p in group.params if (r := p.get_help_record(root)))}.", ""]
    for name in group.list_commands(root):
        command = group.get_command(root, name)
        ctx = command.context_class(command, info_name=name, parent=root)
        usage = " ".join(["taskgeom", name, *command.collect_usage_pieces(ctx)])
        lines += [f"### {name}", "", (command.help or "").strip(), "", "```text", usage, "```", "", *params_table(command, ctx), ""]
    return "\n".join(lines)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    """Replace the marker with the generated reference."""
    return markdown.replace(MARKER, reference()) if MARKER in markdown else markdown
