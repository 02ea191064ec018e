"""`sparkwatch postmortem [--json] [--journal-dir DIR] [--state-dir DIR]`: how the previous boot ended.

It reads what the daemon reads at start (the previous boot's journal, pstore, the flight recorder, events.jsonl) and
judges it the same way (core.postmortem.verdict), without recording anything; the daemon's own verdict is the
`previous_boot` event. `--json` prints one object: the verdict's fields (docs/contract.md) plus `summary` and
`recorder` (`{"last_sample_at", "path", "samples": [the last minute]}`, or null without samples of that boot).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "postmortem",
        parents=[parent],
        help="how the previous boot ended, and its last minute",
        description="How the previous boot ended (clean, kernel_oom, driver_no_memory, xid, sparkwatch_kill, abrupt or "
        "unknown), from its journal, pstore and sparkwatch's events, with the lines that say so and its last minute "
        "from the flight recorder.",
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--journal-dir", type=Path, metavar="DIR", help="read this journal directory instead of the system journal"
    )
    p.add_argument("--state-dir", metavar="DIR", help="where events.jsonl and the flight recorder live")
    p.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.common.sources.boot import read_boot_id, read_boot_time
    from sparkwatch.common.wiretypes import to_json
    from sparkwatch.core.postmortem.flight import last_minute
    from sparkwatch.core.postmortem.verdict import judge, verdict_fields
    from sparkwatch.telemetry.sources.prevboot import gather
    from sparkwatch.tui.postmortem_view import postmortem_lines

    settings = settings_from(args, state_dir=args.state_dir, postmortem_journal_dir=args.journal_dir)
    gathered = gather(
        state_dir=settings.state_dir,
        root=settings.root,
        running_boot_id=read_boot_id(settings.proc_root),
        boot_started_at=read_boot_time(settings.proc_root),
        journal_dir=settings.postmortem_journal_dir,
    )
    verdict = judge(gathered.boot)
    samples = last_minute(gathered.boot.samples)
    if args.json:
        recorder = None
        if samples:
            recorder = {
                "last_sample_at": samples[-1].t,
                "path": gathered.ring.path if gathered.ring is not None else None,
                "samples": [to_json(s) for s in samples],
            }
        out = {**verdict_fields(verdict), "summary": verdict.summary, "recorder": recorder}
        print(json.dumps(out, default=str))
        return 0
    print("\n".join(postmortem_lines(verdict, samples)))
    return 0
