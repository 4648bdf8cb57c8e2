"""Progress bars for long work (rich), quiet when output is not a terminal."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


@contextmanager
def step_bar(description: str, total: int) -> Iterator:
    """Yields ``update(done, total, loss)`` for the trainer's progress callback."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total, loss=float("nan"))

        def update(done: int, total: int, loss: float) -> None:
            bar.update(task, completed=done, loss=loss)

        yield update


@contextmanager
def job_bar(description: str, total: int) -> Iterator:
    """Yields ``advance(label)``, called once per finished job."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total, last="")

        def advance(label: str) -> None:
            bar.update(task, advance=1, last=f"done: {label}")
            if not console.is_terminal:
                console.log(f"{description}: done {label}")

        yield advance
