"""The progress bar a sweep draws on stderr (only on a terminal, and not with ``--quiet``)."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class SweepProgress:
    """A rich progress bar whose total grows as searches submit runs."""

    def __init__(self, description: str, disable: bool) -> None:
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),
            disable=disable,
            transient=False,
        )
        self._description = description

    def __enter__(self) -> tuple[Progress, Any]:
        self._progress.start()
        return self._progress, self._progress.add_task(self._description, total=0)

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()
