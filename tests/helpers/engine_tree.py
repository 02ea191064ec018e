"""Start real fake-engine process trees (tests/helpers/staged_engine.py) and always tear them down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STAGED_ENGINE = Path(__file__).with_name("staged_engine.py")


@dataclass
class EngineTreeProc:
    popen: subprocess.Popen[str]
    pids: list[int]  # root first, then the children it forked

    @property
    def root_pid(self) -> int:
        return self.pids[0]


@contextmanager
def staged_engine(
    title: str = "VLLM::EngineCore",
    children: Sequence[str] = ("VLLM::Worker_TP0",),
    extra: Sequence[str] = (),
    command: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Iterator[EngineTreeProc]:
    argv = [sys.executable, str(STAGED_ENGINE), "--title", title]
    for child in children:
        argv += ["--child", child]
    argv += list(extra)
    if command:
        argv += ["--", *command]
    # Its own session and process group: teardown signals exactly this tree (and what it spawned), nothing else.
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        assert popen.stdout is not None
        line = popen.stdout.readline()
        assert line.strip(), f"fake engine did not start (rc={popen.poll()})"
        yield EngineTreeProc(popen, [int(x) for x in line.split()])
    finally:
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        popen.wait(10)
        if popen.stdout is not None:
            popen.stdout.close()
