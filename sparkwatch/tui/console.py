"""One place that decides how output looks: colour on a terminal, plain text on a pipe or file."""

from __future__ import annotations

import os
import sys
from typing import TextIO

from rich.console import Console, RenderableType

# On a pipe there is no terminal width; rows are not wrapped to 80 columns but given room (a long process title or a
# kill summary stays on its line, which is what grep and bug reports want).
PIPE_WIDTH = 200


def make_console(file: TextIO | None = None) -> Console:
    stream = file if file is not None else sys.stdout
    if stream.isatty():
        return Console(file=stream, highlight=False)
    width = int(os.environ["COLUMNS"]) if os.environ.get("COLUMNS", "").isdigit() else PIPE_WIDTH
    # No colour, no cursor movement, no markup-to-ANSI: plain text a script can parse.
    return Console(
        file=stream,
        force_terminal=False,
        no_color=True,
        color_system=None,
        highlight=False,
        width=width,
        soft_wrap=False,
    )


def emit(renderable: RenderableType, file: TextIO | None = None) -> None:
    """Print a renderable; on a pipe, without the trailing padding rich adds to table rows."""
    console = make_console(file)
    if console.is_terminal:
        console.print(renderable)
        return
    with console.capture() as capture:
        console.print(renderable)
    text = "\n".join(line.rstrip() for line in capture.get().splitlines())
    console.file.write(text + "\n")
    console.file.flush()
