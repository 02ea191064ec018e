"""The plan as launch prints it (`--plan`, `--plan --json`, and the short line before a start): this node's terms
against its pool, what was learned, and the checks beyond this node: each node's share of an engine that spans nodes
(cli.launch.nodes), the raylets and the serve command (cli.launch.raycheck), the stale placement groups. Rendering
only: it reads nothing, and imports nothing a plan without them would not load.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sparkwatch.core.engines.enginecli import EngineKind
from sparkwatch.core.launch import peaks
from sparkwatch.core.launch.plan import Plan, budget_warning, fix_text, miss_reasons
from sparkwatch.core.units import format_size

if TYPE_CHECKING:
    from sparkwatch.cli.launch.gather import PlanContext
    from sparkwatch.core.launch.nodeplan import NodePlan


def _learned_line(plan: Plan, ctx: PlanContext) -> str | None:
    learned = plan.learned
    record = ctx.record
    if learned is None and record is not None and record.recent:
        runs = ", ".join(format_size(b) for b in record.recent)
        return (
            f"measured {runs} in {len(record.recent)} run(s), not used yet: the estimate stands until two runs agree "
            f"within {peaks.AGREE_RATIO:.0%} (sparkwatch launch --forget {shlex.quote(ctx.key)} drops them)"
        )
    if learned is None:
        return None
    err = peaks.error_ratio(plan.estimate.needs_bytes, learned.peak_bytes)
    err_text = "" if err is None else f", estimate {format_size(plan.estimate.needs_bytes)} ({err:+.0%})"
    ready = "" if learned.ready_s is None else f", ready in {learned.ready_s:.0f} s"
    return f"measured peak {format_size(learned.peak_bytes)} over {learned.runs} run(s){err_text}{ready}"


def plan_text(plan: Plan, ctx: PlanContext, short: bool = False) -> str:
    est = plan.estimate
    view = plan.view
    verdict = "fits"
    if not plan.fits:  # the reason, never a bare "short by 0 B"; the fix here too, but where the gate's line follows
        verdict = f"does NOT fit: {'; '.join(miss_reasons(plan, figures=False))}"
        verdict += "" if short else f"; fix: {fix_text(plan)}"
    head = f"sparkwatch: plan for {est.kind}" + (f" {est.model}" if est.model else "")
    if ctx.span is not None:
        head += f" ({ctx.span.how}: this node's share, as the {ctx.role})"
    basis = "measured peak" if plan.learned is not None else "estimate"
    summary = (
        f"{head}: {basis} {format_size(plan.needs_bytes)}, {format_size(max(plan.available_bytes, 0))} free above "
        f"floor {format_size(view.floor_bytes)} + margin {format_size(view.margin_bytes)}: {verdict}"
    )
    if short:
        learned = _learned_line(plan, ctx)
        return summary + (f"\nsparkwatch: {learned}" if learned else "")
    lines = [summary, ""]
    width = max(len(t.name) for t in est.terms)
    for term in est.terms:
        lines.append(f"  {term.name:<{width}}  {format_size(term.bytes):>10}  {term.note}")
    lines.append(f"  {'needs':<{width}}  {format_size(est.needs_bytes):>10}  the peak phase")
    learned = _learned_line(plan, ctx)
    if learned:
        lines.append(f"  {learned}")
    lines.append("")
    lines.append(
        f"  MemAvailable {format_size(view.available_bytes)}, MemFree {format_size(view.free_bytes)}, "
        f"page cache {format_size(view.cached_bytes)}, total {format_size(view.total_bytes)}"
    )
    if view.contiguous_free_bytes is not None:
        lines.append(f"  free in blocks of 2 MiB or more: {format_size(view.contiguous_free_bytes)}")
    reserved = [r for r in plan.reservations if r.reserved_bytes]
    for r in reserved:
        whose = "" if r.other_uid is None else f", another user's: uid {r.other_uid}"
        lines.append(f"  reserved for {r.name} (pid {r.root_pid}{whose}): {format_size(r.reserved_bytes)}, {r.why}")
    check = est.check
    if check is not None and check.required_bytes:
        ok = "ok" if check.ok else "FAILS"
        lines.append(
            f"  engine check: {check.source} {format_size(check.value_bytes)} >= "
            f"{format_size(check.required_bytes)}: {ok} ({check.why})"
        )
    if plan.budget_bytes is not None:
        lines.append(f"  budget: {format_size(plan.budget_bytes)} (declared to the guard: its kill limit for the tree)")
    warning = budget_warning(plan)
    if warning:
        lines.append(f"  WARNING: {warning}")
    if ctx.facts.error and est.kind != EngineKind.OTHER:
        lines.append(f"  note: {ctx.facts.error}")
    for note in (*est.notes, *est.problems):
        lines.append(f"  note: {note}")
    for fix in plan.fixes:
        lines.append(f"  fix: {fix.text}" + (" (--fix applies it)" if fix.automatic else ""))
    return "\n".join(lines)


def plan_json(plan: Plan, ctx: PlanContext) -> dict[str, Any]:
    est = plan.estimate
    view = plan.view
    check = est.check
    learned = plan.learned
    return {
        "fits": plan.fits,
        "needs_bytes": plan.needs_bytes,
        "available_bytes": plan.available_bytes,
        "short_bytes": plan.short_bytes,
        "terms": [{"name": t.name, "bytes": t.bytes, "note": t.note} for t in est.terms],
        "estimate_bytes": est.needs_bytes,
        "kind": str(est.kind),
        "model": est.model,
        "model_source": ctx.facts.source,
        "weight_files": ctx.facts.files,
        "key": ctx.key,
        "engine_version": ".".join(map(str, ctx.engine_version)) if ctx.engine_version else None,
        "engine_check": None
        if check is None
        else {
            "reads": str(check.source),
            "required_bytes": check.required_bytes,
            "value_bytes": check.value_bytes,
            "ok": check.ok,
        },
        "fragmented": plan.fragmented,
        "budget_bytes": plan.budget_bytes,
        "budget_warning": budget_warning(plan),
        "learned": None
        if learned is None
        else {
            "peak_bytes": learned.peak_bytes,
            "estimate_bytes": learned.estimate_bytes,
            "runs": learned.runs,
            "ready_s": learned.ready_s,
            "estimate_error": peaks.error_ratio(est.needs_bytes, learned.peak_bytes),
        },
        "measured_peaks_bytes": list(ctx.record.recent) if ctx.record is not None else [],
        "memory": {
            "total_bytes": view.total_bytes,
            "available_bytes": view.available_bytes,
            "free_bytes": view.free_bytes,
            "cached_bytes": view.cached_bytes,
            "floor_bytes": view.floor_bytes,
            "margin_bytes": view.margin_bytes,
            "contiguous_free_bytes": view.contiguous_free_bytes,
        },
        "reserved": [
            {
                "kind": r.kind,
                "root_pid": r.root_pid,
                "name": r.name,
                "reserved_bytes": r.reserved_bytes,
                "why": r.why,
                "uid": r.other_uid,  # another user's declaration; null: the planning user's own, or undeclared
            }
            for r in plan.reservations
        ],
        "fixes": [
            {
                "action": str(f.action),
                "text": f.text,
                "automatic": f.automatic,
                "flags": [list(pair) for pair in f.flags],
                "max_jobs": f.max_jobs,
            }
            for f in plan.fixes
        ],
        "notes": list(est.notes),
        "problems": list(est.problems),
        "plan_seconds": round(ctx.took_s, 4),
    }


def nodes_fit(nodes: Any) -> bool:
    """Every node whose memory is known holds its share (the head's plan is launch's own)."""
    return all(n.fits is not False for n in nodes)


def node_lines(nodes: Any, quiet: bool = False) -> list[str]:
    """One line a node of an engine that spans nodes: each that does not fit, and (unless quiet) the others."""
    if len(nodes) < 2:
        return []
    out = []
    for n in nodes[1:] if quiet else nodes:  # the head's own fix is launch's fix line
        warning = budget_warning(n.plan) if n.plan is not None and n.role != "head" else None
        if quiet and n.fits is not False and not warning:
            continue
        out.append(f"sparkwatch: {n.line()}")
        if n.fits is False and n.role != "head" and n.plan is not None:
            out += [f"sparkwatch: fix on {n.node}: {f.text}" for f in n.plan.fixes]
        if warning:
            out.append(f"sparkwatch: WARNING on {n.node}: {warning}")
    return out


def raylet_lines(raylets: list[Any], serve: Any = (), serve_fix: str | None = None) -> list[str]:
    out = []
    for _where, raylet, lacks, fix in raylets:
        if raylet.environ is None:
            out.append(f"sparkwatch: raylet on {raylet.node} (pid {raylet.pid}): its environment is not ours to read")
        out += [f"sparkwatch: {p.line()}" for p in lacks]
        if fix is not None:
            out.append(f"sparkwatch: fix: {fix}")
    out += [f"sparkwatch: {p.line()}" for p in serve]
    if serve_fix is not None:
        out.append(f"sparkwatch: fix: {serve_fix}")
    return out


def problem_json(p: Any) -> dict[str, Any]:
    return {"variable": p.variable, "have": p.have, "want": p.want, "why": p.why}


def raylet_json(_where: str, raylet: Any, lacks: Any, fix: str | None) -> dict[str, Any]:
    return {
        "node": raylet.node,
        "pid": raylet.pid,
        "head": raylet.head,
        "environment_read": raylet.environ is not None,
        "problems": [problem_json(p) for p in lacks],
        "fix": fix,
    }


def stale_lines(stale: Any, note: str | None) -> list[str]:
    out = [f"sparkwatch: {note}: placement groups not checked"] if note else []
    for g in stale:
        out.append(f"sparkwatch: {g.line()}: the engine would wait behind it (vLLM: up to 1800 s)")
    if stale:
        out.append(
            "sparkwatch: fix: sparkwatch launch --fix … removes it through Ray (or `ray stop --force` on every node)"
        )
    return out


def stale_json(g: Any) -> dict[str, Any]:
    return {"group": g.group, "state": g.state, "job_id": g.job_id, "driver_pid": g.driver_pid,
            "driver_ip": g.driver_ip, "why": g.why}  # fmt: skip


def nodes_json(nodes: Sequence[NodePlan]) -> list[dict[str, Any]]:
    return [
        {
            "node": n.node,
            "role": str(n.role),
            "source": str(n.source),
            "fits": n.fits,
            "needs_bytes": None if n.plan is None else n.plan.needs_bytes,
            "available_bytes": None if n.plan is None else n.plan.available_bytes,
            "budget_bytes": None if n.plan is None else n.plan.budget_bytes,
            "terms": []
            if n.plan is None
            else [{"name": t.name, "bytes": t.bytes, "note": t.note} for t in n.plan.terms],
            # what would fit there, planned again on that node with it applied (the head's: the plan's own `fixes`)
            "fixes": []
            if n.plan is None
            else [
                {"action": str(f.action), "text": f.text, "flags": [list(p) for p in f.flags], "max_jobs": f.max_jobs}
                for f in n.plan.fixes
            ],
            "env_problems": list(n.env_problems),
        }
        for n in nodes
    ]
