"""`sparkwatch engines [--json]`: the engine trees the guard would kill now, and the groups over Ray that span nodes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sparkwatch.cli import argtypes
from sparkwatch.core.model import EngineTree, GpuHolder
from sparkwatch.core.redact import redact, safe_cmdline

if TYPE_CHECKING:
    from sparkwatch.common.sources.enginetrees import EngineFinder
    from sparkwatch.config.settings import Settings
    from sparkwatch.core.container import ContainerFacts, ContainerNotes
    from sparkwatch.core.kill.mpgroup import Member
    from sparkwatch.core.kill.policy import Candidate
    from sparkwatch.core.kill.raygroup import GroupRow
    from sparkwatch.core.model import Proc


# The guard's own growth window is 5 s (core.kill.policy.GROWTH_WINDOW_S); a minute is more than any ranking needs.
WINDOW_MAX_S = 60.0


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "engines",
        parents=[parent],
        help="list the engine trees the guard would kill now",
        description="List the engine trees the guard would kill now, drawn as trees (root, workers, compilers), and "
        "the order in which it would kill them, with the reason for each, and whether each serves (one one-token "
        "completion to its own port); where a raylet runs on this node, the engines that span nodes over Ray "
        "(groups: their nodes, driver and ranks, which run here), from Ray's state API (ray_dashboard_url). Reads "
        "/proc and Ray's state, and asks each engine for that token only: it signals nothing and needs no daemon. "
        "docs/engines.md lists every process shape it recognises; docs/multinode.md the groups.",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--all",
        action="store_true",
        help="also list processes NVML says hold GPU memory that no engine rule names (the guard does not kill them)",
    )
    p.add_argument(
        "--window",
        type=argtypes.seconds(0, WINDOW_MAX_S),
        default=1.0,
        metavar="S",
        help="seconds to watch for growth before ranking (0: none)",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="do not ask each engine for one token (the serving probe: docs/engines.md)",
    )
    p.set_defaults(handler=handle)


PROBE_TIMEOUT_S = 3.0  # a terminal command: each engine's one-token probe waits at most this long


def serving_rows(settings: Settings, trees: Sequence[EngineTree]) -> dict[int, dict[str, object]]:
    """One serving probe per engine whose endpoint is known (telemetry/probewatch.py's, with a short timeout), all at
    once on threads: root pid -> {state, endpoint, latency_s, error}. An engine not listening on its port is said so,
    never asked; one whose socket cannot be reached for certain is `not_probed`, the reason in `error`."""
    if not trees:
        return {}
    import threading

    from sparkwatch.core.engines.serving import Outcome, ServingParams
    from sparkwatch.telemetry.probewatch import ProbeWatch, targets_of

    watch = ProbeWatch(str(settings.proc_root), ServingParams(timeout_s=min(settings.probe_timeout_s, PROBE_TIMEOUT_S)))
    targets = targets_of(tuple(trees), ())
    rows: dict[int, dict[str, object]] = {}

    def one(pid: int, target: Any) -> None:
        result = watch.probe(target)
        ep = target.endpoint
        state = {
            Outcome.OK: "serving",
            Outcome.NOT_LISTENING: "not_listening",
            Outcome.UNAUTHORIZED: "unknown",
            Outcome.NOT_PROBED: "not_probed",
        }
        rows[pid] = {
            "state": state.get(result.outcome, "not_serving"),
            "endpoint": f"{ep.host}:{ep.port}",
            "latency_s": result.latency_s,
            "error": result.error,
        }

    threads = [threading.Thread(target=one, args=(t.root_pid, t), daemon=True) for t in targets.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PROBE_TIMEOUT_S + 2.0)
    return rows


def serving_text(row: Mapping[str, object]) -> str:
    """`serving: a token in 41 ms from 127.0.0.1:8000` (one-token probe)."""
    ep, state = row["endpoint"], row["state"]
    latency = row.get("latency_s")
    if state == "serving":
        ms = f" in {float(latency) * 1000:.0f} ms" if isinstance(latency, float) else ""
        return f"serving: a token{ms} from {ep}"
    if state == "not_listening":
        return f"serving: unknown, nothing of the engine listens on {ep} (booting?)"
    if state == "unknown":
        return f"serving: unknown, {ep} refused the probe's key ({row.get('error')})"
    if state == "not_probed":  # its own socket cannot be reached for certain (a container's loopback, no route)
        return f"serving: not probed, {row.get('error')}"
    return f"NOT SERVING: a one-token completion to {ep} failed ({row.get('error')})"


def container_json(tree: EngineTree, facts: Mapping[str, ContainerFacts]) -> dict[str, object] | None:
    """The container a tree runs in: its id and runtime from the cgroup path, and what the Docker API says of it
    (name, image, compose service, restart policy, network mode) where it answered; None for a bare tree."""
    ref = tree.container
    if ref is None:
        return None
    out: dict[str, object] = {"id": ref.id, "runtime": ref.runtime}
    f = facts.get(ref.id)
    if f is not None:
        out.update(
            name=redact(f.name),
            image=redact(f.image),
            compose_project=f.compose_project,
            compose_service=f.compose_service,
            restart_policy=f.restart_policy,
            network_mode=f.network_mode,
        )
    return out


def container_text(tree: EngineTree, facts: Mapping[str, ContainerFacts]) -> str | None:
    ref = tree.container
    if ref is None:
        return None
    from sparkwatch.core.container import container_line

    return container_line(ref, facts.get(ref.id))


def tree_json(tree: EngineTree, containers: Mapping[str, ContainerFacts] | None = None) -> dict[str, object]:
    return {
        "root_pid": tree.root.pid,
        "engine": tree.kind,
        "rss_bytes": tree.rss_bytes,
        "container": container_json(tree, containers or {}),
        "members": [
            {
                "pid": p.pid,
                "ppid": p.ppid,
                "name": redact(p.display_name),
                "rss_bytes": p.rss_bytes,
                "cmdline": safe_cmdline(p.argv),
            }
            for p in tree.members
        ],
    }


def holder_json(holder: GpuHolder) -> dict[str, object]:
    p = holder.proc
    return {
        "pid": p.pid,
        "name": redact(p.display_name),
        "used_gpu_memory_bytes": holder.used_gpu_memory_bytes,
        "cmdline": safe_cmdline(p.argv),
    }


def gpu_source(settings: Settings) -> Any:
    """The NVML source `--all` reads (a seam for tests, which hand in a fake NVML)."""
    from sparkwatch.telemetry.sources.nvml import NvmlSource

    return NvmlSource(proc_root=settings.proc_root)


def _gpu_used(settings: Settings) -> tuple[dict[int, int | None], str | None]:
    """pid -> GPU memory NVML reports, or a note saying why there is none."""
    from sparkwatch.core.model import GpuReport

    source = gpu_source(settings)
    try:
        report = source.collect()
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    if not isinstance(report, GpuReport) or not report.up:
        why = getattr(report, "error", None) or "NVML not available"
        return {}, f"not listed ({why})"
    return {p.pid: p.used_gpu_memory_bytes for p in report.processes}, None


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.common.sources.enginetrees import EngineFinder
    from sparkwatch.core.engines.identity import unknown_gpu_holders

    # The trees the guard would kill now: this user's engines, or every user's when run as root.
    settings = settings_from(args)
    finder = EngineFinder.from_settings(settings, settings.proc_root)
    holders: tuple[GpuHolder, ...] | None = None
    note: str | None = None
    if args.all:
        used, note = _gpu_used(settings)
        procs, _ = finder.scan()
        keys = frozenset(p.key for p in procs if p.pid in used)
        procs, holder_trees = finder.scan(keys)
        holders = unknown_gpu_holders(procs, holder_trees, used, finder.rules)
    trees, ranking, containers, containers_note = kill_order_now(finder, settings, args.window)
    budgets = budget_rows(settings, finder, trees, used if args.all else None, containers)
    serving = {} if args.no_probe else serving_rows(settings, trees)
    groups, group_note = ray_groups(settings, finder.scan()[0])
    local = local_groups(settings, trees)
    from sparkwatch.tui.kill_order_view import kill_order_json, kill_order_view

    if args.json:
        engines = [
            {**tree_json(t, containers), "budget": budgets.get(t.root.pid), "serving": serving.get(t.root.pid)}
            for t in trees
        ]
        out: dict[str, object] = {"engines": engines, "kill_order": kill_order_json(ranking)}
        out["containers_note"] = containers_note
        out["groups"] = [group_json(g) for g in groups]
        out["groups_note"] = group_note
        out["groups_without_ray"] = [local_group_json(m) for m in local]
        if holders is not None:
            out["gpu_unknown"] = [holder_json(h) for h in holders]
            out["gpu_note"] = note
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Group
    from rich.text import Text

    from sparkwatch.tui.console import emit
    from sparkwatch.tui.engines_view import engines_view, groups_view, local_groups_view

    emit(
        Group(
            engines_view(
                trees,
                finder.rules,
                holders,
                note,
                {pid: budget_text(b) for pid, b in budgets.items()},
                serving={pid: serving_text(row) for pid, row in serving.items()},
                containers={t.root.pid: text for t in trees if (text := container_text(t, containers))},
                containers_note=containers_note,
            ),
            *((Text(""), kill_order_view(ranking)) if trees else ()),
            *((Text(""), groups_view(groups, group_note)) if groups or group_note else ()),
            *((Text(""), local_groups_view(local)) if local else ()),
        )
    )
    return 0


def local_groups(settings: Settings, trees: Sequence[EngineTree]) -> tuple[Member, ...]:
    """This node's members of groups without Ray (telemetry.mpwatch, as the agent lists them for its peers): the
    engine trees whose root names a rendezvous (`--nnodes`) or rpc-servers (a llama.cpp head), and the rpc-servers
    a head reached. The other nodes' members are theirs to list: `sparkwatch engines` there. No engine tree, no
    import of the group watch's modules (a box without engines pays nothing for them)."""
    if not trees:
        return ()
    from pathlib import Path

    from sparkwatch.telemetry.mpwatch import local_members, rpc_workers

    proc_root = Path(settings.proc_root)
    return local_members(trees, proc_root) + rpc_workers(trees, proc_root)


def local_group_json(m: Member) -> dict[str, object]:
    from sparkwatch.core.kill.mpgroup import member_role

    return {"group": m.key, "node_rank": m.node_rank, "pid": m.pid, "role": member_role(m)}


def ray_groups(settings: Settings, procs: tuple[Proc, ...]) -> tuple[tuple[GroupRow, ...], str | None]:
    """The groups over Ray, where a raylet runs in this node's network namespace (else none, and Ray is never
    asked), and a note when Ray's state API did not answer (the groups are then unknown, never guessed)."""
    from pathlib import Path

    from sparkwatch.telemetry.sources.raylets import local_raylets

    raylets = local_raylets(procs, Path(settings.proc_root))
    if not raylets or not settings.ray_dashboard_url:
        return (), None  # no raylet: Ray's state API and its records are never loaded
    from sparkwatch.core.kill.raygroup import group_rows
    from sparkwatch.telemetry.sources.raystate import RayStateError, RayStateSource

    source = RayStateSource(settings.ray_dashboard_url)
    try:
        state = source.poll()
    except RayStateError as exc:  # the URL is never printed: it may carry credentials
        return (), f"unknown: a raylet runs here, but Ray's state API did not answer ({exc.kind}: {exc})"
    finally:
        source.close()
    return group_rows(state, frozenset(r.node_id for r in raylets)), None


def group_json(group: GroupRow) -> dict[str, object]:
    death = group.death
    return {
        "group": group.group,
        "job_id": group.job_id,
        "nodes": list(group.nodes),
        "members": [
            {
                "role": m.role,
                "name": m.name,
                "node_id": m.node_id,
                "node_ip": m.node_ip,
                "pid": m.pid,
                "state": m.state,
                "local": m.local,
            }
            for m in group.members
        ],
        "first_death": None
        if death is None
        else {"cause": death.cause, "node_id": death.node_id, "node_ip": death.node_ip, "pid": death.pid},
    }


def budget_rows(
    settings: Settings,
    finder: EngineFinder,
    trees: list[EngineTree],
    gpu_used: dict[int, int | None] | None,
    containers: Mapping[str, ContainerFacts] | None = None,
) -> dict[int, dict[str, object]]:
    """Per tree with a budget (its declaration's, its container's io.sparkwatch.budget label, or the config's
    engine_budgets): the budget, the footprint now as this command can count it (core.kill.footprint: RSS or the
    scope's memory.current, plus NVML's bytes with --all) and the peak launch measured."""
    if not trees:
        return {}
    from sparkwatch.common.sources.cgroupmem import read_memory_current
    from sparkwatch.core.container import label_asks
    from sparkwatch.core.kill.footprint import FootprintInputs, footprint, owned_scope
    from sparkwatch.core.kill.policy import first_match, parse_engine_budgets

    patterns = parse_engine_budgets(settings.engine_budgets)
    by_root = {d.tree_key: d for d in finder.declarations if d.exited_at is None}
    out: dict[int, dict[str, object]] = {}
    for tree in trees:
        decl = by_root.get(tree.root.key)
        budget, source = (decl.budget_bytes, "launch") if decl is not None and decl.budget_bytes else (None, "")
        ref = tree.container
        facts = (containers or {}).get(ref.id) if ref is not None else None
        if budget is None and facts is not None:
            budget, source = label_asks(facts.labels).budget_bytes, "label"
        if budget is None:
            budget, source = first_match(tree, patterns), "config"
        if budget is None and decl is None:
            continue
        gpu = None if gpu_used is None else sum(gpu_used.get(p.pid) or 0 for p in tree.members)
        fp = footprint(
            FootprintInputs(
                rss_bytes=tree.rss_bytes,
                gpu_bytes=gpu,
                gpu_age_s=0.0 if gpu is not None else None,
                cgroup_bytes=read_memory_current(
                    owned_scope(tree.root.cgroup, decl.cgroup, decl.container) if decl else None
                ),
            )
        )
        out[tree.root.pid] = {
            "budget_bytes": budget,
            "budget_source": source if budget is not None else None,
            "footprint_bytes": fp.bytes,
            "footprint_source": str(fp.source),
            "peak_bytes": decl.peak_bytes if decl is not None else None,
            "phase": str(decl.phase) if decl is not None else None,
        }
    return out


def budget_text(row: dict[str, object]) -> str:
    from sparkwatch.core.units import format_size

    def size(key: str) -> str:
        value = row.get(key)
        return format_size(value) if isinstance(value, int) else "-"

    parts = [f"footprint {size('footprint_bytes')} ({row['footprint_source']})"]
    if row.get("budget_bytes") is not None:
        parts.insert(0, f"budget {size('budget_bytes')} ({row['budget_source']})")
    if row.get("peak_bytes") is not None:
        parts.append(f"peak {size('peak_bytes')}")
    if row.get("phase"):
        parts.append(f"phase {row['phase']}")
    return "  ".join(parts)


def engine_containers(settings: Settings, trees: Sequence[EngineTree]) -> tuple[dict[str, ContainerFacts], str | None]:
    """What the Docker API says of the containers the trees run in (read here: no daemon needed), and a note when it
    could not be read (the trees are then named by container id only); nothing asked when no tree is in one."""
    ids = {ref.id for t in trees if (ref := t.container) is not None}
    if not ids:
        return {}, None
    from sparkwatch.telemetry.sources.dockerapi import ContainerLookup

    lookup = ContainerLookup(settings.docker_host)
    facts = lookup.lookup(ids)
    return facts, lookup.note


def container_notes(facts: Mapping[str, ContainerFacts]) -> ContainerNotes:
    """The containers' io.sparkwatch.* labels as the guard holds them (core.container), for the ranking."""
    from sparkwatch.core.container import ContainerNotes, note_of

    return ContainerNotes.of(note_of(f) for f in facts.values())


def kill_order_now(
    finder: EngineFinder, settings: Settings, window_s: float
) -> tuple[list[EngineTree], tuple[Candidate, ...], dict[str, ContainerFacts], str | None]:
    """Two scans `window_s` apart, ranked as the guard ranks (core.kill.policy; no GPU bytes: this command has no
    NVML; the containers' protect and priority labels as the Docker API gives them), with the containers' facts and a
    note when the API could not be read."""
    import time

    from sparkwatch.core.kill import policy

    params = policy.PolicyParams.build(settings.kill_order, settings.kill_priority, settings.never_kill)
    history = policy.GrowthHistory()
    if window_s > 0:
        history = policy.observe(history, time.monotonic(), finder.find(), None)
        time.sleep(window_s)
    now = time.monotonic()
    trees = finder.find()
    history = policy.observe(history, now, trees, None)
    containers, note = engine_containers(settings, trees)
    return (
        trees,
        policy.rank(trees, history, now, None, params, containers=container_notes(containers)),
        containers,
        note,
    )
