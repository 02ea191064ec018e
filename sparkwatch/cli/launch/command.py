"""`sparkwatch launch [OPTIONS] -- COMMAND [ARGS…]`: start an engine only where it fits, and show its boot.

    sparkwatch launch -- vllm serve Qwen/Qwen3-8B --gpu-memory-utilization 0.8
    sparkwatch launch --budget 60GiB -- llama-server -m model.gguf -c 32768
    sparkwatch launch --plan --json -- vllm serve /models/llama
    sparkwatch launch --forget 'vllm|Qwen/Qwen3-8B|gpu_memory_utilization=0.8'   # or --forget-all

1. Settle: wait (up to --settle-timeout) while an engine tree is exiting, memory is still coming back (MemAvailable
   rising, Shmem falling) or orphaned engine workers hold the GPU (core.launch.settle), here and, for an engine that
   spans nodes, on every other node as its agent says (cli.launch.settlewait.settle_nodes). Steady engines are no reason
   to wait: the plan counts them. Then the files a killed engine left in /dev/shm, which no process holds, are named
   with their bytes (core.launch.shmleft); `--fix` removes those named like an engine's before the plan reads the pool.
2. Plan (core.launch.plan): the footprint as named terms, held against MemAvailable - floor - margin, the engine's own
   start-up check (MemAvailable or MemFree), the free high-order blocks, and what running engines may still take.
   The measured peak of earlier runs with the same key (core.launch.peaks) replaces the estimate once two runs agree
   within 25 %; `--forget KEY` (the key `--plan` prints) or `--forget-all` drops what was learned.
3. Gate: when it does not fit, one line says by how much and the fix, and the command does not start (exit 75).
   An engine over Ray (`--distributed-executor-backend ray`, or RAY_ADDRESS) is also held to what its ranks read:
   the environment of the raylets on this node (core.launch.rayletenv: MAX_JOBS, RAY_memory_monitor_refresh_ms,
   ninja and nvcc on PATH, memlock, NCCL_IB_GID_INDEX), and to the placement groups it would wait behind (held by a
   stopped driver, or by a job that ended: core.launch.stalepg); one line per problem and its fix, and the command
   does not start (exit 78). `--fix` removes such groups through Ray.
   `--fix` applies the fixes that need no guessing (drop caches, compact memory) where the user may, `--force`
   starts anyway, `--plan` prints the plan and exits 0 (fits) or 1 (does not).
4. Environment (core.launch.launchenv), declaration (common.launched), run (cli.launch.runner): the command's output
   passes through unchanged, its boot phases are recognised (core.launch.bootphase), Ctrl-C goes to the whole tree, and
   the exit code comes back; a guard kill is reported in one line and exits 137. A container (`docker run …`, `docker
   compose up SERVICE`) is planned by the engine inside (cli.launch.docker) and run by cli.launch.incontainer.

Exit codes: the command's own; 128+N when it died of signal N (137: killed, by the guard when the line says so);
75 the plan does not fit (nothing started); 78 the Ray cluster needs a fix first: a raylet here lacks what the
engine's ranks need, or a stale placement group holds its resources (nothing started);
2 bad usage or config; 127 the command was not found; with --plan 0 fits (and the raylets have what the ranks need),
1 does not; with --forget/--forget-all 0 dropped, 1 nothing to drop.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from sparkwatch.cli import argtypes

EXIT_DOES_NOT_FIT = 75  # sysexits' EX_TEMPFAIL: try again when memory is back
EXIT_CLUSTER = 78  # sysexits' EX_CONFIG: the Ray cluster needs a fix first (a raylet, a stale group)
EXIT_NOT_FOUND = 127
DEFAULT_SETTLE_TIMEOUT_S = 60.0


def add_parser(sub: Any, parent: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "launch",
        parents=[parent],
        help="start an engine only when the box can hold it; shows its boot phases, reports a guard kill",
        usage="sparkwatch launch [OPTIONS] -- COMMAND [ARGS...]",
        description="Start an engine only into a box that can hold it: wait for a previous engine's teardown, plan "
        "its footprint against MemAvailable, the floor and running budgets, then run it with its output passed "
        "through, its boot phases shown and its budget declared to the guard. Exit 75: it does not fit.",
    )
    p.add_argument("--plan", action="store_true", help="print the plan and exit: 0 fits, 1 does not")
    p.add_argument("--json", action="store_true", help="with --plan: one JSON object")
    p.add_argument(
        "--fix",
        action="store_true",
        help="apply the fixes that need no guessing (a killed engine's /dev/shm files, drop caches, compact)",
    )
    p.add_argument("--force", action="store_true", help="start even when the plan does not fit")
    from sparkwatch.core.launch.nodeplan import Role

    p.add_argument(
        "--budget",
        type=argtypes.role_sizes(tuple(Role), "auto"),
        metavar="SIZE|auto|head=SIZE,worker=SIZE",
        help="the tree's memory budget, enforced by the guard (auto: the plan's need plus 10 %%); for an engine "
        "that spans nodes, one per role: each node's launch takes its own role's",
    )
    p.add_argument(
        "--margin",
        type=argtypes.size,
        default=None,
        metavar="SIZE",
        help="headroom kept above the floor besides the engine (default 1GiB)",
    )
    p.add_argument(
        "--engine-reads",
        choices=("MemAvailable", "MemFree"),
        help="which figure the engine's own start-up check reads (vLLM before its UMA fix: MemFree)",
    )
    p.add_argument(
        "--settle-timeout",
        type=argtypes.seconds(),
        default=DEFAULT_SETTLE_TIMEOUT_S,
        metavar="S",
        help="wait at most S seconds for exiting engines and returning memory (default %(default)g; 0: do not wait)",
    )
    p.add_argument("--no-scope", action="store_true", help="never run the command in its own systemd scope")
    p.add_argument(
        "--probe",
        metavar="URL",
        help="the engine's OpenAI-compatible base URL (http://HOST:PORT), where its command line does not say it: "
        "ready comes with the first one-token completion there, and telemetry probes it",
    )
    p.add_argument(
        "--forget",
        metavar="KEY",
        help="drop the peaks learned for KEY (the key --plan prints) and exit: the estimate stands again",
    )
    p.add_argument("--forget-all", action="store_true", help="drop every learned peak and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="only the lines that matter (gate, kill, exit)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    p.set_defaults(handler=handle)


def _command(args: argparse.Namespace) -> list[str]:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    return cmd


def handle(args: argparse.Namespace) -> int:
    from sparkwatch.cli import settings_from
    from sparkwatch.cli.launch import planview as view
    from sparkwatch.cli.launch.gather import PlanInputs, gather, replan
    from sparkwatch.core.engines.serving import endpoint_of_url

    if args.forget is not None or args.forget_all:
        return _forget(settings_from(args), None if args.forget_all else args.forget)
    cmd = _command(args)
    if args.probe is not None and endpoint_of_url(args.probe) is None:
        print(f"sparkwatch launch: --probe: {args.probe!r} is not http://HOST:PORT[/PATH]", file=sys.stderr)
        return 2
    if not cmd:
        print("sparkwatch: launch needs a command: sparkwatch launch -- vllm serve MODEL", file=sys.stderr)
        return 2
    settings = settings_from(args)
    from sparkwatch.core.engines.enginecli import CONTAINER_CLIENTS

    box = None
    if Path(cmd[0]).name in CONTAINER_CLIENTS:  # a bare engine's plan loads none of docker's parsing
        from sparkwatch.cli.launch.docker import prepared

        box = prepared(
            cmd, os.environ
        )  # `docker run …`, `docker compose up SERVICE`: the engine inside; int: exit code
    if isinstance(box, int):
        return box
    inputs = PlanInputs(
        argv=tuple(box.engine if box else cmd),
        budget=args.budget,  # bytes, "auto" or None: argtypes.size_or checked it
        margin_bytes=args.margin,
        engine_reads=args.engine_reads,
        env=box.plan_env(os.environ) if box else dict(os.environ),
        view=box,
    )
    out = sys.stderr if not args.plan else sys.stdout
    settled_peers: list[Any] | None = None
    if not args.plan and args.settle_timeout > 0:
        from sparkwatch.cli.launch.settlewait import settle, settle_nodes

        until = time.monotonic() + args.settle_timeout
        settle(settings, args.settle_timeout, quiet=args.quiet)
        if settings.peers and _spans(inputs):  # and every other node of the engine, as its agent says
            settled_peers = settle_nodes(settings, max(until - time.monotonic(), 0.1), quiet=args.quiet)
    if not args.plan:  # what a killed engine left in /dev/shm; --fix removes it before the plan reads the pool
        from sparkwatch.cli import shm_fix

        shm_fix.say(settings.root, settings.proc_root, args.fix, "sparkwatch launch", quiet=args.quiet)
    try:
        plan, ctx = gather(settings, inputs)
    except ValueError as exc:
        print(f"sparkwatch: {exc}", file=sys.stderr)
        return 2
    from sparkwatch.core.launch.rayletenv import uses_ray

    ray = uses_ray(inputs.argv, inputs.env)
    # one read of each agent serves every check: the settle's last, else one now
    peers = settled_peers if settled_peers is not None else _peers(settings) if ray or ctx.span is not None else []
    raylets, stale, stale_note = _cluster(settings, plan.estimate.jobs, peers) if ray else ([], (), None)
    serve, serve_fix = _serve_command(inputs.env, raylets)
    if stale and args.fix and not args.plan:
        from sparkwatch.cli.launch.raycheck import remove

        lines, (stale, stale_note) = remove(settings, stale)
        for line in lines:
            print(f"sparkwatch: fix: {line}", file=sys.stderr)
        plan, ctx = replan(settings, inputs, ctx)  # the removed group's ranks gave their memory back
    cluster_fix = any(lacks for _where, _raylet, lacks, _fix in raylets) or bool(stale) or bool(serve)
    worker_budget = args.budget.get("worker") if isinstance(args.budget, dict) else None
    nodes = _nodes(settings, plan, ctx, peers=peers, raylets=raylets, reads=inputs.engine_reads, worker=worker_budget)
    if args.plan:
        fits = plan.fits and view.nodes_fit(nodes)
        if args.json:
            doc = view.plan_json(plan, ctx)
            doc["fits"] = fits
            doc["nodes"] = view.nodes_json(nodes)
            doc["raylets"] = [view.raylet_json(*r) for r in raylets]
            doc["stale_placement_groups"] = [view.stale_json(g) for g in stale]
            doc["serve_command"] = {"problems": [view.problem_json(p) for p in serve], "fix": serve_fix}
            print(json.dumps(doc, indent=None, separators=(",", ":")))
        else:
            print(view.plan_text(plan, ctx))
            for line in (
                view.node_lines(nodes)
                + view.raylet_lines(raylets, serve, serve_fix)
                + view.stale_lines(stale, stale_note)
            ):
                print(line)
        return 0 if fits and not cluster_fix else 1
    if not args.quiet:
        print(view.plan_text(plan, ctx, short=True), file=out)
    _warn_budget(plan)
    if not plan.fits and args.fix:
        from sparkwatch.cli.launch.fix import apply_fixes

        for line in apply_fixes(plan, settings.proc_root):
            print(f"sparkwatch: fix: {line}", file=out)
        plan, ctx = replan(settings, inputs, ctx)
        nodes = _nodes(
            settings, plan, ctx, peers=peers, raylets=raylets, reads=inputs.engine_reads, worker=worker_budget
        )
        if not args.quiet:
            print(view.plan_text(plan, ctx, short=True), file=out)
    # what the cluster lacks is said whether or not the memory fits
    cluster = view.raylet_lines(raylets, serve, serve_fix) + view.stale_lines(stale, stale_note)
    for line in view.node_lines(nodes, quiet=args.quiet) + cluster:
        print(line, file=sys.stderr)
    if not plan.fits:
        from sparkwatch.core.launch.plan import fix_line

        print(fix_line(plan), file=sys.stderr)
    fits = plan.fits and view.nodes_fit(nodes)
    if (cluster_fix or not fits) and not args.force:
        return EXIT_CLUSTER if cluster_fix else EXIT_DOES_NOT_FIT  # the cluster's fix first: a `ray start`, --fix
    if cluster_fix or not fits:
        print("sparkwatch: --force: starting anyway", file=sys.stderr)
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).exists():
        print(f"sparkwatch: {cmd[0]}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    from sparkwatch.cli.launch.runner import Launch

    started = time.time()
    if box is not None:
        from sparkwatch.cli.launch.incontainer import ContainerLaunch

        launch: Launch = ContainerLaunch(settings, plan, ctx, box, quiet=args.quiet, probe=args.probe)
    else:
        launch = Launch(
            settings, plan, ctx, cmd, quiet=args.quiet, use_scope=not args.no_scope, probe=args.probe,
            ray=bool(raylets), worker_budget_bytes=_ray_worker_budget(ctx, nodes),
        )  # fmt: skip
    code = launch.run()
    if not args.quiet:
        took = time.time() - started
        ended = "runs on" if launch.detached else "exited"
        print(f"sparkwatch: {plan.estimate.kind} {ended} after {took:.0f} s: {launch.exit_text}", file=sys.stderr)
    return code


def _spans(inputs: Any) -> bool:
    """Whether the engine spans nodes (core.launch.nodeplan); a flag out of range is the plan's to report."""
    from sparkwatch.core.engines.enginecli import recognise
    from sparkwatch.core.launch.nodeplan import span_of
    from sparkwatch.core.launch.rayletenv import uses_ray

    try:
        return span_of(recognise(inputs.argv), uses_ray(inputs.argv, inputs.env)) is not None
    except ValueError:
        return False


def _peers(settings: Any) -> list[Any]:
    from sparkwatch.cli.launch.raycheck import read_peers

    return read_peers(settings)


def _cluster(settings: Any, jobs: int, peers: list[Any]) -> tuple[list[Any], Any, str | None]:
    """For an engine over Ray: each raylet with where it was seen and what it lacks (cli.launch.raycheck.problems),
    the placement groups the engine would wait behind, and why those could not be checked, if so
    (cli.launch.raycheck.stale)."""
    from sparkwatch.cli.launch.raycheck import problems, stale

    return problems(settings, max(1, jobs), peers), *stale(settings)


def _serve_command(env: Any, raylets: list[Any]) -> tuple[Any, str | None]:
    if not raylets:
        return (), None
    from sparkwatch.cli.launch.raycheck import serve_command

    return serve_command(env, raylets)


def _nodes(
    settings: Any, plan: Any, ctx: Any, *, peers: list[Any], raylets: list[Any], reads: str | None, worker: Any = None
) -> Any:
    """Each node's share of an engine that spans nodes (cli.launch.nodes); this node alone otherwise."""
    from sparkwatch.core.launch.nodeplan import NodePlan, Role, ViewSource

    if ctx.span is None or ctx.role != Role.HEAD:  # a worker's launch plans its own share (its head plans the rest)
        import socket

        return (NodePlan(socket.gethostname(), ctx.role, ViewSource.LOCAL, plan),)
    from sparkwatch.cli.launch.nodes import node_plans
    from sparkwatch.core.launch.plan import FreeSource

    return node_plans(settings, plan, ctx, peers=peers, raylets=raylets,
                      engine_reads=FreeSource(reads) if reads else None, worker_budget=worker)  # fmt: skip


def _ray_worker_budget(ctx: Any, nodes: Any) -> int | None:
    """The budget of the engine's ranks that Ray starts on the other nodes (`--budget worker=…` on the head): put in
    its declaration, told to the other nodes' agents (telemetry.peerdoc), held there by their guards. Over `--nnodes`
    each node's own launch declares its own."""
    if ctx.span is None or not ctx.span.ray or str(ctx.role) != "head":
        return None
    sizes = [n.plan.budget_bytes for n in nodes[1:] if n.plan is not None and n.plan.budget_bytes]
    return max(sizes) if sizes else None


def _warn_budget(plan: Any) -> None:
    """A budget under the need, said before anything starts (quiet or not): the guard would kill the engine during
    its boot. A worker node's is among its node lines."""
    from sparkwatch.core.launch.plan import budget_warning

    warning = budget_warning(plan)
    if warning:
        print(f"sparkwatch: WARNING: {warning}", file=sys.stderr)


def _forget(settings: Any, key: str | None) -> int:
    """`--forget KEY` / `--forget-all`: 0 when something was dropped, 1 when there was nothing to drop."""
    from sparkwatch.common import peakstore

    try:
        dropped = peakstore.forget(settings.state_dir, key)
    except OSError as exc:
        print(
            f"sparkwatch: --forget: {peakstore.peaks_path(settings.state_dir)}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    if not dropped:
        none = "no peak was learned" if key is None else f"no peak was learned for {key}"
        print(f"sparkwatch: --forget: {none}", file=sys.stderr)
        return 1
    what = "every learned peak" if key is None else f"the peaks learned for {key}"
    print(f"sparkwatch: forgot {what}: the estimate stands again", file=sys.stderr)
    return 0
