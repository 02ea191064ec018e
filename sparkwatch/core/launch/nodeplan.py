"""An engine that spans nodes, planned node by node: each node's share held against that node's own pool.

`sparkwatch launch` on the head plans the whole engine on its own pool otherwise, yet each Spark holds only its
ranks: `vllm serve … -tp 2` over Ray puts one rank, half the weights, on each of two Sparks; `-pp 2` one stage
(half the layers, their KV cache) on each. The head holds more than its share: the API server and the engine core
(and, over Ray, the GCS, the dashboard and their agents), which the field saw as about 5.6 GiB of host memory the
plan did not account for on the head of two Sparks (GLM-5.3-Flash-EXL3-2x-DGX-Sparks#118). A 148 GiB checkpoint
that fits the pair in sum still fails where one node is short: that node must be named.

Pure: the caller passes each node's MemoryView (this node's from /proc, a peer's from its agent, or Ray's view of
a node no agent answers for) and names its role. One GPU a node, as on a Spark: rank r runs on node r.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sparkwatch.core.engines.enginecli import EngineCommand, EngineKind, flag_int, flag_set
from sparkwatch.core.launch.plan import FreeSource, MemoryView, ModelFacts, Plan, Term, plan_launch
from sparkwatch.core.units import GiB, MiB, format_size

# Ray's own processes, measured on this project's two-node test cluster (Ray 2.60, `ray start` with the dashboard;
# RSS summed over each node's Ray processes 20 s after start): the head's GCS, raylet, dashboard and its modules,
# autoscaler monitor, log monitor and agents 1.46 GiB; a worker node's raylet, dashboard agent, runtime-env agent and
# log monitor 306 MiB.
RAY_HEAD_BYTES = 1536 * MiB
RAY_WORKER_BYTES = 320 * MiB
# The API server and the engine core on the head: the 5.6 GiB the field found unaccounted on a head over Ray, less
# Ray's head processes above (they ran on that head too).
HEAD_SERVING_BYTES = 4 * GiB
GPUS_PER_NODE = 1  # a Spark's one GB10


class Role(StrEnum):
    HEAD = "head"  # where launch runs: the API server, the engine core, rank 0
    WORKER = "worker"


class ViewSource(StrEnum):
    """Where a node's memory figures came from."""

    LOCAL = "this node"  # /proc here
    AGENT = "sparkwatch"  # the node's own agent (its peer document)
    RAY = "ray"  # Ray's dashboard: psutil's MemAvailable as Ray's reporter last sent it; no floor known
    NONE = "none"  # nothing answered for the node


@dataclass(frozen=True, slots=True)
class Span:
    """How an engine spreads over nodes."""

    nodes: int
    tp: int
    pp: int
    ray: bool
    how: str  # for the plan's lines: "-tp 2 over Ray", "--nnodes 2"


def span_of(cmd: EngineCommand, ray: bool, gpus_per_node: int = GPUS_PER_NODE) -> Span | None:
    """The nodes `cmd` spans, or None when it runs on this node alone: vLLM with its ranks on Ray (`ray`: its
    backend flag or RAY_ADDRESS, core.launch.rayletenv.uses_ray) over more GPUs than a node has, or vLLM and SGLang
    with `--nnodes` over 1. Raises ValueError naming a flag out of range."""
    if cmd.kind not in (EngineKind.VLLM, EngineKind.SGLANG):
        return None
    tp = flag_int(cmd, "tensor_parallel_size") or 1
    pp = flag_int(cmd, "pipeline_parallel_size") or 1
    nnodes = flag_int(cmd, "nnodes") or 1
    if nnodes > 1:
        return Span(nnodes, tp, pp, ray=False, how=f"--nnodes {nnodes}")
    ranks = tp * pp
    if ray and cmd.kind == EngineKind.VLLM and ranks > gpus_per_node:
        shape = " ".join(f for f in (f"-tp {tp}" if tp > 1 else "", f"-pp {pp}" if pp > 1 else "") if f)
        return Span(math.ceil(ranks / gpus_per_node), tp, pp, ray=True, how=f"{shape} over Ray")
    return None


def role_of(cmd: EngineCommand) -> Role:
    """This node's role in an engine that spans nodes, by its own command line: a `--node-rank` above 0, or vLLM's
    `--headless` (the nodes that run ranks only), is a worker; the rest is the head."""
    if flag_set(cmd, "headless"):
        return Role.WORKER
    return Role.WORKER if (flag_int(cmd, "node_rank") or 0) > 0 else Role.HEAD


def rank_facts(facts: ModelFacts, span: Span) -> ModelFacts:
    """The checkpoint as one pipeline stage holds it: its share of the weights and of the layers (whose KV cache
    it keeps). Tensor parallelism splits within the estimate (core.launch.plan: weights over tp, KV heads over tp)."""
    if span.pp <= 1:
        return facts
    layers = None if facts.layers is None else math.ceil(facts.layers / span.pp)
    return replace(facts, weights_bytes=facts.weights_bytes // span.pp, layers=layers)


def role_terms(role: Role, span: Span) -> tuple[Term, ...]:
    """What a node holds besides its ranks."""
    out: list[Term] = []
    if role == Role.HEAD:
        out.append(Term("head_serving", HEAD_SERVING_BYTES, "the API server and the engine core"))
        if span.ray:
            out.append(Term("ray_head", RAY_HEAD_BYTES, "GCS, raylet, dashboard and agents (measured)"))
    elif span.ray:
        out.append(Term("ray_worker", RAY_WORKER_BYTES, "raylet and its agents (measured)"))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class NodeInput:
    node: str
    role: Role
    view: MemoryView | None  # None: nothing tells this node's memory
    source: ViewSource
    env_problems: tuple[str, ...] = ()  # what its raylets lack (core.launch.rayletenv), as lines


@dataclass(frozen=True, slots=True)
class NodePlan:
    node: str
    role: Role
    source: ViewSource
    plan: Plan | None  # None: its memory is unknown (said, never a refusal: a node nothing answers for)
    env_problems: tuple[str, ...] = ()

    @property
    def fits(self) -> bool | None:
        return None if self.plan is None else self.plan.fits

    def line(self) -> str:
        """One line for the node: `does not fit on spark-b: needs 61 GiB, 52 GiB free`."""
        where = f"{self.node} ({self.role}"
        where += f", memory as {self.source} reports it)" if self.source != ViewSource.LOCAL else ")"
        if self.plan is None:
            return f"memory of {where} unknown (no agent and no Ray view answered): its share is not checked"
        p = self.plan
        free = format_size(max(p.available_bytes, 0))
        if p.fits:
            return f"fits on {where}: needs {format_size(p.needs_bytes)}, {free} free"
        return f"does not fit on {where}: needs {format_size(p.needs_bytes)}, {free} free"


def plan_nodes(
    cmd: EngineCommand,
    facts: ModelFacts,
    span: Span,
    nodes: Sequence[NodeInput],
    *,
    jobs: int | None = None,
    engine_version: tuple[int, ...] | None = None,
    engine_reads: FreeSource | None = None,
) -> tuple[NodePlan, ...]:
    """Each node's share, planned on its own pool as launch plans its own (core.launch.plan.plan_launch, with
    role_terms): a fix suggested for a node is planned again on that node with it applied, its role's terms
    included (the arithmetic fix left out `ray_worker` and suggested 0.84 again on a worker it did not fit). The
    caller passes launch's own plan in place of this one for the head where it has one."""
    per_rank = rank_facts(facts, span)
    out = []
    for node in nodes:
        if node.view is None:
            out.append(NodePlan(node.node, node.role, node.source, None, node.env_problems))
            continue
        plan = plan_launch(
            cmd, per_rank, node.view, jobs=jobs, engine_version=engine_version, engine_reads=engine_reads,
            extra=role_terms(node.role, span),
        )  # fmt: skip
        out.append(NodePlan(node.node, node.role, node.source, plan, node.env_problems))
    return tuple(out)
