"""One place that decides how output looks: colour on a terminal, plain text on a pipe or file.

And the terminal's last line of defence for remote text (a process title, a Ray actor's class name, a peer's word):
no string is read as rich markup or emoji codes (`[red]`, `[link=…]` and `:fire:` print as written), and every
character rich is handed passes through core.redact.safe_text on its way out (`inert`), so an escape sequence that
slipped past its source's own cleaning prints as `?`, never clears the screen or moves the cursor.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.segment import Segment

from sparkwatch.core.redact import safe_text

# On a pipe there is no terminal width; rows are not wrapped to 80 columns but given room (a long process title or a
# kill summary stays on its line, which is what grep and bug reports want).
PIPE_WIDTH = 200


def make_console(file: TextIO | None = None) -> Console:
    stream = file if file is not None else sys.stdout
    if stream.isatty():
        return Console(file=stream, highlight=False, markup=False, emoji=False)
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else PIPE_WIDTH
    # No colour, no cursor movement, no markup-to-ANSI: plain text a script can parse.
    return Console(
        file=stream,
        force_terminal=False,
        no_color=True,
        color_system=None,
        highlight=False,
        markup=False,
        emoji=False,
        width=width,
        soft_wrap=False,
    )


class Inert:
    """`renderable` as rich draws it, with every text segment through safe_text (line breaks kept) and no control
    segment of its own: sparkwatch's views move no cursor, so one inside is not theirs."""

    def __init__(self, renderable: RenderableType) -> None:
        self.renderable = renderable

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        return _inert_segments(console.render(self.renderable, options))


def _inert_segments(segments: Iterable[Segment]) -> Iterator[Segment]:
    for segment in segments:
        if segment.control:
            continue
        text = segment.text
        clean = "\n".join(safe_text(line) for line in text.split("\n")) if "\n" in text else safe_text(text)
        yield segment if clean == text else Segment(clean, segment.style)


def inert(renderable: RenderableType) -> Inert:
    return Inert(renderable)


def emit(renderable: RenderableType, file: TextIO | None = None) -> None:
    """Print a renderable (made inert); on a pipe, without the trailing padding rich adds to table rows."""
    console = make_console(file)
    if console.is_terminal:
        console.print(inert(renderable))
        return
    with console.capture() as capture:
        console.print(inert(renderable))
    text = "\n".join(line.rstrip() for line in capture.get().splitlines())
    console.file.write(text + "\n")
    console.file.flush()
