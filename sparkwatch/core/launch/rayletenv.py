"""What an engine over Ray needs in its raylets' environment, held against what each raylet has (issue 30).

The environment that matters to an engine's ranks is the raylet's, not the serve command's: Ray starts every worker
with the environment its raylet was started with, and vLLM's Ray executor copies the driver's variables into its
workers with `setdefault`, so the raylet's value wins (measured with a real Ray: a driver with MAX_JOBS=999 gave its
actors the 4 and 8 their raylets were started with; ray#38891). Ray workers do flashinfer's JIT compile. Pure: the
facts are read by cli.launch.raycheck.

Checked, for each raylet on this node:
- MAX_JOBS set, and not over what this node's memory holds (the plan's count, core.launch.launchenv): unset, ninja
  runs nproc + 2 jobs of 3-8 GiB each;
- RAY_memory_monitor_refresh_ms=0: Ray's memory monitor counts the weights in the unified pool as system RAM and
  kills a worker by its own rule;
- ninja and nvcc on the raylet's PATH: the ranks' JIT needs both;
- locked memory unlimited: DGX OS ships memlock hard-limited to 8 MB, and NCCL over RoCE fails without more;
- NCCL_IB_GID_INDEX, where set, equal to the RoCEv2 GID index sysfs shows now: the index drifts across reboots
  (6 -> 5 on a worker while the head stayed 3) and a stale literal fails two minutes into start-up;
- the fabric: VLLM_HOST_IP set to the node's own address (the one its raylet serves, `--node-ip-address`), and
  GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME naming the interface that holds it. A Spark has more than one network
  (the QSFP fabric between Sparks, the LAN); unset, each library picks an interface of its own, and ranks that picked
  different ones never meet. The serve command needs VLLM_HOST_IP and GLOO_SOCKET_IFNAME too (check_driver): its
  engine core is a rank of the same collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

UNLIMITED = -1  # a limit of "unlimited" in /proc/PID/limits
FABRIC_VARS = ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# The raylet's variables that are checked: the only part of its environment ever kept, or told to a peer (the rest
# may hold tokens).
CHECKED_VARS = ("MAX_JOBS", "RAY_memory_monitor_refresh_ms", "NCCL_IB_GID_INDEX", *FABRIC_VARS)


@dataclass(frozen=True, slots=True)
class RayletFacts:
    """One raylet as this node's /proc and sysfs show it."""

    pid: int
    node: str  # its node's address (--node_ip_address), else its node id
    head: bool  # started by `ray start --head`
    gcs_address: str
    environ: Mapping[str, str] | None  # of CHECKED_VARS, those set; None: unreadable (another user's raylet)
    memlock_bytes: int | None  # soft limit; UNLIMITED; None: unreadable
    tools: Mapping[str, bool]  # ninja, nvcc: found on the raylet's PATH
    roce_v2_gid_index: int | None  # the RoCEv2 GID index sysfs shows now for the device NCCL uses; None: no RoCE
    uid: int = -1  # the user it runs as: only the launching user's raylets are held to the checks (mine)
    fabric_ifname: str | None = None  # the interface holding `node`'s address on its node; None: not found


@dataclass(frozen=True, slots=True)
class Problem:
    node: str
    variable: str
    have: str | None  # None: not set
    want: str
    why: str
    where: str = "raylet"  # or "serve command" (check_driver)

    def line(self) -> str:
        have = "not set" if self.have is None else f"{self.have!r}"
        return f"{self.where} on {self.node}: {self.variable} is {have}, needs {self.want}: {self.why}"


def uses_ray(argv: tuple[str, ...], env: Mapping[str, str]) -> bool:
    """Whether the engine runs its ranks on Ray: vLLM's `--distributed-executor-backend ray`, or a Ray address in
    the environment (the engine then joins that cluster)."""
    for i, arg in enumerate(argv):
        if arg in ("--distributed-executor-backend", "--distributed_executor_backend") and argv[i + 1 : i + 2] == (
            "ray",
        ):
            return True
        if arg.replace("_", "-") == "--distributed-executor-backend=ray":
            return True
    return bool(env.get("RAY_ADDRESS"))


def mine(raylets: Iterable[RayletFacts], uid: int) -> list[RayletFacts]:
    """The raylets of the user who launches (`uid`): a process of another user named `raylet` is not the cluster the
    engine joins, and must not refuse the owner's launch (any user can start one, with any node address)."""
    return [r for r in raylets if r.uid == uid]


def check(raylet: RayletFacts, jobs: int) -> tuple[Problem, ...]:
    """What this raylet lacks for an engine whose compile may run `jobs` jobs on this node (the plan's MAX_JOBS)."""
    env = raylet.environ
    out: list[Problem] = []
    node = raylet.node
    if env is not None:
        have = env.get("MAX_JOBS") or None
        if have is None:
            out.append(Problem(node, "MAX_JOBS", None, str(jobs), "unset, each rank's JIT runs nproc + 2 compilers"))
        elif not have.isdigit() or not 1 <= int(have) <= jobs:
            out.append(Problem(node, "MAX_JOBS", have, f"1 to {jobs}", "what this node's memory holds"))
        monitor = env.get("RAY_memory_monitor_refresh_ms")
        if monitor != "0":
            out.append(Problem(node, "RAY_memory_monitor_refresh_ms", monitor, "0",
                               "Ray's memory monitor kills workers for the weights in the unified pool"))  # fmt: skip
        gid = env.get("NCCL_IB_GID_INDEX")
        if gid is not None and raylet.roce_v2_gid_index is not None and gid != str(raylet.roce_v2_gid_index):
            out.append(Problem(node, "NCCL_IB_GID_INDEX", gid, str(raylet.roce_v2_gid_index),
                               "the RoCEv2 GID index sysfs shows now (it drifts; resolve it at start)"))  # fmt: skip
        out += fabric(env, raylet)
    for tool in ("ninja", "nvcc"):
        if raylet.tools.get(tool) is False:
            out.append(Problem(node, f"PATH ({tool})", None, f"a directory with {tool}", "the ranks' JIT runs it"))
    if raylet.memlock_bytes is not None and raylet.memlock_bytes != UNLIMITED:
        out.append(Problem(node, "memlock", f"{raylet.memlock_bytes >> 10} KiB", "unlimited",
                           "NCCL over RoCE registers its buffers"))  # fmt: skip
    return tuple(out)


def fabric(
    env: Mapping[str, str], raylet: RayletFacts, where: str = "raylet", names: Iterable[str] = FABRIC_VARS
) -> list[Problem]:
    """The fabric variables of `env` (a raylet's, or the serve command's: `where`) against the node's address and the
    interface that holds it. A node known by its id only (no address) is not checked."""
    node, ifname = raylet.node, raylet.fabric_ifname
    if not _is_ipv4(node):
        return []
    want_if = ifname or "the interface that holds " + node
    out = []
    for var in names:
        have = env.get(var) or None
        if var == "VLLM_HOST_IP":
            if have != node:
                out.append(Problem(node, var, have, node, "each node's own fabric address (unset: the default "
                                   "route's, which ranks on another network never reach)", where))  # fmt: skip
        elif have is None or (ifname is not None and not names_interface(var, have, ifname)):
            why = f"the interface that holds {node}" if have is not None else "unset, the library picks an interface"
            out.append(Problem(node, var, have, want_if, why, where))
    return out


def check_driver(env: Mapping[str, str], raylet: RayletFacts) -> tuple[Problem, ...]:
    """What the serve command's environment lacks on this node, whose raylet is `raylet`: its engine core joins the
    ranks' collectives over Gloo from this node's address."""
    return tuple(fabric(env, raylet, "serve command", ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME")))


def names_interface(var: str, value: str, ifname: str) -> bool:
    """Whether `value` selects `ifname` as the library reads it: NCCL_SOCKET_IFNAME is a list of prefixes (`=name`:
    exact; `^…`: all but those: nccl/src/misc/socket.cc matchIfList), GLOO_SOCKET_IFNAME a list of names."""
    items = [v.strip() for v in value.split(",") if v.strip()]
    if var != "NCCL_SOCKET_IFNAME":
        return ifname in items
    if value.startswith("^"):
        items[0] = items[0][1:]
        return not any(_nccl_match(i, ifname) for i in items)
    return any(_nccl_match(i, ifname) for i in items)


def _nccl_match(item: str, ifname: str) -> bool:
    exact = item.startswith("=")
    name = item.lstrip("=").split(":")[0]
    return ifname == name if exact else ifname.startswith(name)


def _is_ipv4(text: str) -> bool:
    parts = text.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)


def fix_line(raylet: RayletFacts, problems: tuple[Problem, ...], jobs: int) -> str:
    """The `ray start` that gives this raylet what it lacks (run on its node, after `ray stop`)."""
    env: list[str] = []
    names = {p.variable for p in problems}
    if "MAX_JOBS" in names:
        env.append(f"MAX_JOBS={jobs}")
    if "RAY_memory_monitor_refresh_ms" in names:
        env.append("RAY_memory_monitor_refresh_ms=0")
    if "NCCL_IB_GID_INDEX" in names and raylet.roce_v2_gid_index is not None:
        env.append(f"NCCL_IB_GID_INDEX={raylet.roce_v2_gid_index}")
    if any(n.startswith("PATH") for n in names):
        env.append('PATH="/usr/local/cuda/bin:$PATH"')
    env += fabric_settings(raylet, names)
    start = "ray start --head" if raylet.head else f"ray start --address={raylet.gcs_address}"
    prefix = "ulimit -l unlimited && " if "memlock" in names else ""
    return f"on {raylet.node}: ray stop && {prefix}{' '.join([*env, start])}"


def fabric_settings(raylet: RayletFacts, names: Iterable[str]) -> list[str]:
    """`VAR=value` for each fabric variable named, as the node's address and interface give it."""
    ifname = raylet.fabric_ifname or "IFNAME"
    values = {"VLLM_HOST_IP": raylet.node, "GLOO_SOCKET_IFNAME": ifname, "NCCL_SOCKET_IFNAME": ifname}
    wanted = set(names)
    return [f"{var}={values[var]}" for var in FABRIC_VARS if var in wanted]


def roce_v2_gid_index(types: Mapping[int, str], gids: Mapping[int, str]) -> int | None:
    """The lowest GID index of type "RoCE v2" holding an IPv4-mapped address (`::ffff:a.b.c.d`, as NCCL picks for
    IPv4), from one port's sysfs gid_attrs/types/N and gids/N; None when there is none."""
    for index in sorted(types):
        gid = gids.get(index, "").strip().lower()
        if types[index].strip() == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
            return index
    return None
