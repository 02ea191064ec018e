"""`sparkwatch assets list|write DIR`: the files the package ships for the rest of the stack, written out.

A `pip install` has no clone to copy from, so the dashboard, Grafana's provisioning files, the Prometheus snippet and
alert rules, the Alertmanager example and an example config travel in the wheel as package data
(sparkwatch/data/, the one copy: grafana/build.py writes the dashboard there and the tests read them there). This
command writes them to a directory, where README's "Dashboards and alerts in five minutes" takes them from.

It never overwrites a file that differs from the shipped one unless told to (`--force`): a dashboard or rule file
someone edited is not lost.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

# What each shipped file is for, in the order `list` shows them; a test holds the package data to this list.
ASSETS: tuple[tuple[str, str], ...] = (
    ("config.example.toml", "every config key with its default: copy to ~/.config/sparkwatch/config.toml"),
    ("grafana/dashboards/sparkwatch-node.json", "the Grafana dashboard (Dashboards > New > Import)"),
    ("grafana/provisioning/dashboards/sparkwatch.yaml", "Grafana dashboard provider: /etc/grafana/provisioning/"),
    ("grafana/provisioning/datasources/sparkwatch.yaml", "Grafana datasource (not the default one)"),
    ("grafana/prometheus.yml", "sparkwatch's scrape job and rule file: merge into your prometheus.yml"),
    ("grafana/sparkwatch-alerts.yml", "Prometheus alert rules: copy next to prometheus.yml"),
    ("grafana/alertmanager.yml", "Alertmanager example: every alert to one webhook"),
)

DESCRIPTION = (
    "Write out what the package ships for the rest of the stack: the Grafana dashboard and provisioning files, "
    "sparkwatch's Prometheus scrape job and alert rules, an Alertmanager example and an example config. "
    "Needed after `pip install`, where there is no clone to copy them from."
)


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "assets",
        parents=[parent],
        help="write out the dashboard, alert rules, Prometheus/Alertmanager examples and example config",
        description=DESCRIPTION,
    )
    actions = p.add_subparsers(dest="assets_action", metavar="ACTION", required=True)
    lst = actions.add_parser(
        "list",
        help="list the shipped files and what each is for",
        description="List the files the package ships, with what each is for.",
    )
    lst.set_defaults(handler=handle_list)
    write = actions.add_parser(
        "write",
        help="write them under DIR",
        description="Write every shipped file under DIR (created if missing), keeping the layout `list` shows. A file "
        "already there that differs is left alone (exit 2) unless --force.",
    )
    write.add_argument("dir", type=Path, metavar="DIR", help="where to write them, e.g. ./sparkwatch-assets")
    write.add_argument("--force", action="store_true", help="overwrite files that differ from the shipped ones")
    write.set_defaults(handler=handle_write)


def data_root() -> Traversable:
    return resources.files("sparkwatch") / "data"


def shipped(rel: str) -> bytes:
    node = data_root()
    for part in rel.split("/"):
        node = node / part
    return node.read_bytes()


def handle_list(args: argparse.Namespace) -> int:
    width = max(len(rel) for rel, _ in ASSETS)
    for rel, what in ASSETS:
        print(f"{rel:<{width}}  {what}")
    return 0


def handle_write(args: argparse.Namespace) -> int:
    target: Path = args.dir
    if target.exists() and not target.is_dir():
        print(f"sparkwatch: error: {target}: not a directory", file=sys.stderr)
        return 2
    contents = [(rel, shipped(rel)) for rel in (r for r, _ in ASSETS)]
    clashes = []
    for rel, data in contents:
        dest = target / rel
        if dest.is_dir() or (dest.exists() and not args.force and dest.read_bytes() != data):
            clashes.append(rel)
    if clashes:  # nothing written: all or nothing, so a second run with --force is the whole answer
        print(
            f"sparkwatch: error: {target / clashes[0]} exists and differs from the shipped file "
            f"({len(clashes)} such); nothing written; --force overwrites",
            file=sys.stderr,
        )
        return 2
    for rel, data in contents:
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        print(dest)
    print(f"next: README 'Dashboards and alerts in five minutes' with these files ({target})", file=sys.stderr)
    return 0
