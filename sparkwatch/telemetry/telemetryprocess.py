"""The telemetry process: everything but the guard, in a process of its own that the guard supervises.

NVML, the telemetry loop (/proc census, compilers, JIT caches), the metrics endpoint, the alert outbox, the driver
check and its udev trigger, and the low-headroom alerts. If anything here blocks (a `dlopen` of a hung libnvidia-ml
holds this interpreter's GIL), leaks or crashes, the pool watch in the other process does not notice; the guard's
supervisor restarts this process with backoff.

What it knows of the guard comes over the channel (common.messages): its state when it changes, exported under the
`sparkwatch_guard_*` names through `RemoteGuard` (telemetry.remote), the guard's events (kills) for the outbox, and
the config. It sends back per-pid GPU memory, the GPU holders, and the engine and compile-job counts for the guard's
STATUS= line.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from sparkwatch.common import logs, peerproof, syscalls
from sparkwatch.common.channel import Channel, ChannelClosed
from sparkwatch.common.daemonargv import parse_daemon_argv
from sparkwatch.common.lifecycle import Component, CountersOnly, apply_all, start_all, stop_all
from sparkwatch.common.messages import (
    AckMsg,
    AppliedMsg,
    EventMsg,
    Message,
    SettingsMsg,
    StateMsg,
    TelMsg,
    WedgedMsg,
)
from sparkwatch.common.recording import open_recording
from sparkwatch.common.selfwatch import rss_bytes
from sparkwatch.common.sharing import events_gid
from sparkwatch.common.sources.enginetrees import still_letting_go
from sparkwatch.common.sources.meminfo import MeminfoError, MeminfoReader
from sparkwatch.config.settings import ConfigError, wire_settings
from sparkwatch.core.launch.rayletenv import RayletFacts
from sparkwatch.core.model import EngineTree, MemInfo, NvmlFacts, Snapshot
from sparkwatch.telemetry import peerdoc
from sparkwatch.telemetry.containerboard import ContainerBoard
from sparkwatch.telemetry.containerwatch import ContainerStore, ContainerWatch
from sparkwatch.telemetry.drivercheck import DriverWatcher
from sparkwatch.telemetry.exporter.containermetric import ContainerCollector
from sparkwatch.telemetry.exporter.gatemetric import GateCollector
from sparkwatch.telemetry.exporter.groupmetric import GroupCollector
from sparkwatch.telemetry.exporter.internal import InternalCollector
from sparkwatch.telemetry.exporter.peermetric import PeerCollector
from sparkwatch.telemetry.exporter.postmortemmetric import PostmortemCollector
from sparkwatch.telemetry.exporter.server import MetricsServer, build_registry
from sparkwatch.telemetry.gpufast import GpuFastSampler
from sparkwatch.telemetry.headroom import HeadroomWatcher
from sparkwatch.telemetry.loop import Telemetry, TelemetryLoop, gpu_bytes_by_pid, quiet
from sparkwatch.telemetry.mpwatch import MpGroupWatch
from sparkwatch.telemetry.outbox import Outbox
from sparkwatch.telemetry.peerwatch import Peer, PeerWatch
from sparkwatch.telemetry.postmortemtask import PostmortemWatch
from sparkwatch.telemetry.probewatch import Wedged
from sparkwatch.telemetry.raywatch import RayWatch
from sparkwatch.telemetry.remote import EventErrors, RemoteGuard
from sparkwatch.telemetry.shmwatch import ShmWatch
from sparkwatch.telemetry.sources.dockerapi import docker_socket
from sparkwatch.telemetry.sources.nvml import NvmlSource
from sparkwatch.telemetry.sources.nvml_preflight import NvmlOff, Preflight
from sparkwatch.telemetry.sources.rayletfacts import local_facts
from sparkwatch.telemetry.sources.udev import UdevWatcher

if TYPE_CHECKING:
    from sparkwatch.config.settings import Settings
    from sparkwatch.telemetry.afterkill import AfterKillWatch

log = logs.get("telemetry")
FIRST_SETTINGS_S = 30.0
# An unchanged `tel` is still sent this often: under the policy's GPU_STALE_S (5 s), and the guard hears us alive.
TEL_HEARTBEAT_S = 4.0
NVML_OFF = "NVML off: telemetry hung twice in a row (a hung libnvidia-ml?); restart sparkwatch to try it again"


def make_outbox(settings: Settings) -> Outbox | None:
    if settings.webhook_url is None:
        return None
    return Outbox(
        settings.outbox_dir,
        str(settings.webhook_url),
        settings.webhook_secret.get_secret_value() if settings.webhook_secret is not None else None,
        timeout_s=settings.webhook_timeout_s,
        backoff_min_s=settings.webhook_backoff_min_s,
        backoff_max_s=settings.webhook_backoff_max_s,
        max_alerts=settings.outbox_max_alerts,
        events_path=settings.events_path,
        events_group=events_gid(settings.events_group),
    )


class PeerNews:
    """What each read of the peers tells this node's group watches: groups without Ray decide (telemetry.mpwatch),
    and a proven peer that says a Ray rank of its node ended, or whose relayed Ray state changed (a rank died on the
    head's node), wakes the Ray group watch now: a second sooner than its poll, as Ray would say so only after its
    health check. Built before the peer watch, which calls it, and the Ray group watch, which asks the peer watch."""

    def __init__(self, mpwatch: MpGroupWatch, ray_wake: threading.Event) -> None:
        self.mpwatch = mpwatch
        self.ray_wake = ray_wake
        self._relays: tuple[peerdoc.RayRelay, ...] = ()  # the Ray states the proven peers relayed at their last read

    def after_poll(self, peers: list[Peer]) -> None:
        self.mpwatch.observe(peers)
        proven = [p.doc for p in peers if p.proven and p.doc is not None]
        relays = tuple(doc.ray for doc in proven if doc.ray is not None)
        if any(doc.ray_gone for doc in proven) or relays != self._relays:
            self._relays = relays
            self.ray_wake.set()


class TelemetryProcess:
    afterkill: AfterKillWatch  # built by _containers

    def __init__(
        self, settings: Settings, channel: Channel | None, *, log_handler: Any = None, nvml_off: str | None = None
    ) -> None:
        """`nvml_off`: why NVML must not be loaded in this process (None: load it)."""
        self.settings = settings
        self.nvml_off = nvml_off
        self.channel = channel
        self.host = socket.gethostname()
        self._raylet_facts_cache: list[RayletFacts] = []
        self._raylet_facts_at = -self.RAYLET_FACTS_S
        self.remote = RemoteGuard(settings)
        self.outbox = make_outbox(settings)
        gid = events_gid(settings.events_group)
        self.recording = open_recording(settings.events_path, settings.events_max_bytes, self.outbox, log_handler, gid)
        self.events, self.journal, self.router = self.recording.events, self.recording.journal, self.recording.router
        host = self._host_watchers()
        driver, shmwatch, remote = self.driver, self.shmwatch, self.remote
        loop = self.loop = TelemetryLoop(
            Telemetry(
                settings,
                gpu_source=None if nvml_off is None else NvmlOff(nvml_off),
                driver=lambda: driver.report,
                shm=lambda: shmwatch.latest,
                on_wedged=self._wedged,  # named to the guard, which checks it again before any signal
            ),
            settings.telemetry_interval_s,
            on_event=self.events.append,
            on_cycle=self._cycle_done,
            is_quiet=lambda snap: quiet(snap) and not remote.near_floor(),
        )
        self.components: list[Component[Settings]] = [*self._alerting(), *host, *self._group_watchers(loop)]
        self.components.append(
            Component(
                "telemetry",
                loop,
                Telemetry.LIVE_KEYS | {"telemetry_interval_s"},
                loop.reconfigure,
                lambda: {"cycle_errors": loop.errors_total, "launched_errors": loop.telemetry.launched.errors_total},
            )
        )
        probes = loop.telemetry.probes
        self.components.append(Component("probe", CountersOnly(), counters=probes.counters))
        # Near-budget engines' GPU bytes, sampled fast on a thread of its own (the guard names them in its state).
        source = loop.telemetry.gpu_source
        nvml = source if isinstance(source, NvmlSource) else None
        fast = self.gpu_fast = GpuFastSampler(
            None if nvml is None else nvml.process_bytes, self._send, proc_root=str(settings.proc_root)
        )
        self.components.append(
            Component(
                "gpu_fast",
                fast,
                counters=lambda: {**fast.counters(), "nvml_call_errors": nvml.fast_errors_total if nvml else 0},
            )
        )
        self.components += self._containers(settings)
        self.components += self._endpoint()
        self._apply_lock = threading.Lock()
        self._stop = threading.Event()
        self._last_sent: Snapshot | None = None
        self._last_tel: TelMsg | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._last_tel_at = 0.0

    def _alerting(self) -> list[Component[Settings]]:
        box, router = self.outbox, self.router
        if box is None or router is None:
            return []
        counters: dict[str, Callable[[], int]] = {
            "spool_errors": lambda: box.spool_errors_total,
            "failed_attempts": lambda: box.failed_attempts_total,
            "alerts_suppressed": lambda: router.suppressed_total,
            "router_errors": lambda: router.errors_total,
        }
        return [Component("outbox", box, counters=lambda: {name: read() for name, read in counters.items()})]

    def _host_watchers(self) -> list[Component[Settings]]:
        """What this node's own files say: the driver check (and the uevents that poke it), how the previous boot
        ended, the pool's headroom, and what killed engines left in /dev/shm."""
        settings = self.settings
        nvml_off = self.nvml_off
        driver = self.driver = DriverWatcher(
            settings, self.events, nvml_probe=None if nvml_off is None else (lambda: NvmlFacts(error=nvml_off))
        )
        out: list[Component[Settings]] = [
            Component(
                "driver",
                driver,
                frozenset({"driver_check_interval_s"}),
                self._apply_driver,
                lambda: {"errors": driver.errors_total},
            )
        ]
        if str(settings.root) == "/":  # uevents describe this machine: with a fixture root only the timer runs
            udev = UdevWatcher(driver.poke)
            out.append(Component("udev", udev, counters=lambda: {"errors": udev.errors_total}))
        # How the previous boot ended: once per boot, on a thread that ends with the verdict (journalctl may take
        # seconds); the outbox is already started (the components before it), so its alert goes out at once.
        postmortem = self.postmortem = PostmortemWatch(settings, self.events)
        out.append(Component("postmortem", postmortem, counters=postmortem.counters))
        headroom = self.headroom = HeadroomWatcher(settings, self.remote.available_bytes, self.events)
        out.append(
            Component(
                "headroom",
                headroom,
                HeadroomWatcher.LIVE_KEYS,
                headroom.apply,
                lambda: {"event_errors": headroom.event_errors_total},
            )
        )
        # What killed engines left in /dev/shm, on a slow timer and soon after a tree ends (sparkwatch_shm_orphaned_*):
        # each cycle's trees are handed to it (_cycle_done), so it never wakes to look for an end itself.
        shmwatch = self.shmwatch = ShmWatch(settings.root, settings.proc_root)
        out.append(Component("shm", shmwatch, counters=shmwatch.counters))
        return out

    def _group_watchers(self, loop: TelemetryLoop) -> list[Component[Settings]]:
        settings = self.settings
        # Engines spanning nodes over Ray: their groups from Ray's state API, a teardown to the guard when one loses a
        # member (telemetry.raywatch; the guard checks each member itself before any signal).
        # The other nodes' agents (`peers`): their guard's word on a group member it killed, and peer_lost.
        # Groups without Ray (`--nnodes` over the multiprocessing backends): this node's members from its own trees,
        # a peer's member that vanished (or the peer lost) ends the group here (telemetry.mpwatch).
        mpwatch = self.mpwatch = MpGroupWatch(settings, self._send, loop.latest_engines, node=self.host)
        ray_wake = threading.Event()
        news = PeerNews(mpwatch, ray_wake)
        peers = self.peers = PeerWatch(settings, self.events.append, after_poll=news.after_poll)
        # Each cycle's process table is handed to it (_cycle_done): a raylet that starts wakes it, none never does.
        raywatch = self.raywatch = RayWatch(settings, self._send, peers=peers, wake=ray_wake)
        return [
            Component("peers", peers, self.PEERS_LIVE_KEYS, self._apply_peers, peers.counters),
            Component("raywatch", raywatch, RayWatch.LIVE_KEYS, raywatch.apply, raywatch.counters),
        ]

    PEERS_LIVE_KEYS = PeerWatch.LIVE_KEYS | {"group_teardown"}

    def _apply_peers(self, settings: Settings) -> frozenset[str]:
        self.mpwatch.apply(settings)
        self.peers.apply(settings)
        return self.PEERS_LIVE_KEYS

    def _peer_doc(self) -> bytes:
        """This node's state for its peers (telemetry.peerdoc), built per request from what telemetry already holds:
        the last cycle's MemAvailable and trees, the raylets' node ids, and the guard's last kills (its state)."""
        snap = self.loop.latest
        with self.remote.lock:
            recent = list(self.remote.stats.recent_kills)
        return peerdoc.build(
            self.host,
            self.raywatch.published_node_ids(),
            self._pool_now(snap),
            () if snap is None else snap.engines,
            peerdoc.kills_from_guard(recent),
            groups=self.mpwatch.published(),
            ray_gone=self.raywatch.gone_ranks(),
            raylets=self._raylet_facts(),
            floor_bytes=self.settings.floor,
            cpus=os.cpu_count() or 1,
            letting_go=0 if snap is None else self._letting_go(snap.engines),
            budgets=() if snap is None else self._worker_budgets(snap),
            ray=self.raywatch.relay(),
        )

    def _pool_now(self, snap: Snapshot | None) -> MemInfo | None:
        """This node's meminfo as of the request: a launch on another node judges by it whether this pool has settled,
        and on a box with nothing to watch the last cycle can be QUIET_INTERVAL_S old. The last cycle's when meminfo
        cannot be read now."""
        try:
            with MeminfoReader(Path(self.settings.proc_root)) as reader:
                return reader.read()
        except (MeminfoError, OSError):
            return None if snap is None else snap.mem

    def _worker_budgets(self, snap: Snapshot) -> list[peerdoc.PeerBudget]:
        """The worker budgets of the engines launched here over Ray (`--budget worker=SIZE`, in their declarations):
        each by the placement group whose driver runs in the launched tree, on this node."""
        boots = [b for b in snap.boots if b.worker_budget_bytes]
        if not boots:
            return []
        cluster = self.raywatch.cluster  # only a cluster whose state is this node's to believe (telemetry.raywatch)
        if cluster is None:
            return []
        trees = {t.root.pid: t for t in snap.engines}
        out = []
        for boot in boots:
            tree = trees.get(boot.root_pid)
            if tree is None or boot.worker_budget_bytes is None:
                continue
            pids = {p.pid for p in tree.members}
            for group in self.raywatch.groups:
                driver = group.job.driver_pid if group.job is not None else None
                if driver in pids and group.driver_node_id in cluster.node_ids and tree.root.uid == cluster.uid:
                    out.append(peerdoc.PeerBudget(group.group, boot.worker_budget_bytes, tree.root.uid))
        return out

    def _letting_go(self, trees: tuple[EngineTree, ...]) -> int:
        """Engine processes still handing memory back, as of the last cycle (a launch on another node waits)."""
        if not trees:
            return 0
        return still_letting_go(self.loop.telemetry.last_procs, trees, str(self.settings.proc_root))

    RAYLET_FACTS_S = 10.0  # a peer's launch reads them once; the document is asked for every peer_poll_s

    def _raylet_facts(self) -> list[RayletFacts]:
        """This node's raylets as a launch on another node checks them (telemetry.sources.rayletfacts), read at most
        every RAYLET_FACTS_S: a few small files per raylet."""
        now = time.monotonic()
        if now - self._raylet_facts_at >= self.RAYLET_FACTS_S:
            root = Path(self.settings.root)
            self._raylet_facts_cache = local_facts(Path(self.settings.proc_root), root, self.raywatch.raylets)
            self._raylet_facts_at = now
        return self._raylet_facts_cache

    def _containers(self, settings: Settings) -> list[Component[Settings]]:
        """The containers on this node (docs/containers.md), built in one direction, each part given what it needs:
        the store of the containers' facts; the board (what the guard hears of containers, and the info metric) and
        the after-kill policy (a restart policy never undoes a guard kill), which read the store; then the watch, which
        writes the store from the Docker API's events and hands each event to them, and tells the after-kill policy
        when the API answers (the gates a previous telemetry process left). Without a Docker daemon: one connect
        attempt every 30 s, nothing sent, no other thread woken. The after-kill policy is imported here: it is no
        import of this module's (tests/test_telemetry_imports.py)."""
        from sparkwatch.telemetry.afterkill import AfterKillWatch  # noqa: PLC0415 - h11 comes with it

        path, where = docker_socket(settings.docker_host, os.environ)
        store = ContainerStore()
        board = self.container_board = ContainerBoard(self._offer)
        after = self.afterkill = AfterKillWatch(settings, self.events, containers=store, socket_path=path, where=where)
        watch = self.containers = ContainerWatch(
            path, where, subscribers=[board.on_event, after.container_event], store=store, on_up=[after.containers_up]
        )
        return [
            Component("afterkill", after, AfterKillWatch.LIVE_KEYS, after.apply, after.counters),
            Component("containers", watch, counters=lambda: {**watch.counters(), **board.counters()}),
        ]

    def _cycle_done(self) -> None:
        self.report()
        snap = self.loop.latest
        if snap is not None:
            self.shmwatch.observe(snap.engines)
            self.raywatch.observe(self.loop.telemetry.last_procs)
            self.afterkill.cycle(snap.engines, self.loop.telemetry.declarations, partial(self._pool_look, snap))

    def _pool_look(self, snap: Snapshot) -> tuple[int | None, int | None, int]:
        """MemAvailable, Shmem and the engine processes still letting go, as of a cycle (the after-kill gate)."""
        mem = snap.mem
        if mem is None:
            return None, None, 0
        return mem.available_bytes, mem.shmem_bytes, self._letting_go(snap.engines)

    def _endpoint(self) -> list[Component[Settings]]:
        loop = self.loop
        self.registry = build_registry(
            self.settings, lambda: loop.latest, self.remote, EventErrors(self.events, self.remote), self.outbox
        )
        self.registry.register(
            InternalCollector(self.all_counters, self.rss, self.psi_trigger, self.telemetry_restarts)
        )
        postmortem = self.postmortem
        self.registry.register(PostmortemCollector(lambda: postmortem.result))
        self.registry.register(GroupCollector(self.raywatch.view))
        self.registry.register(GateCollector(self.afterkill.gated))
        self.registry.register(ContainerCollector(self.container_board.engine_containers))
        key = self.peers.key  # the pair's key (peer_key_file): each document answers a reader's nonce with its proof
        prover = None if key is None else partial(peerproof.prove, key, self.host)
        self.metrics = MetricsServer(
            self.settings, self.registry, documents={peerdoc.PATH: self._peer_doc}, prover=prover
        )
        self.registry.register(PeerCollector(self.peers.view, self.metrics.port_taken_s))
        out: list[Component[Settings]] = [
            Component("metrics", self.metrics, counters=self.metrics.counters),
            Component("events", CountersOnly(), counters=self.recording.counters),
        ]
        if self.channel is not None:
            ch = self.channel
            out.append(
                Component(
                    "channel",
                    CountersOnly(),
                    counters=lambda: {
                        "dropped": ch.dropped_total,
                        "bad": ch.bad_total,
                        "oversized": ch.oversized_total,
                    },
                )
            )
        return out

    # --- exported
    def all_counters(self) -> dict[str, dict[str, dict[str, int]]]:
        mine = {component.name: dict(component.counters()) for component in self.components}
        with self.remote.lock:
            theirs = {c: dict(v) for c, v in self.remote.counters.items()}
        return {"telemetry": mine, "guard": theirs} if theirs else {"telemetry": mine}

    def rss(self) -> dict[str, int]:
        out = {"telemetry": rss_bytes()}
        with self.remote.lock:
            if self.remote.rss_bytes is not None:
                out["guard"] = self.remote.rss_bytes
        return out

    def psi_trigger(self) -> bool | None:
        with self.remote.lock:
            return self.remote.stats.psi_trigger if self.remote.updates_total else None

    def telemetry_restarts(self) -> int | None:
        with self.remote.lock:
            return self.remote.counters.get("telemetry", {}).get("telemetry_restarts")

    # --- reload
    def _apply_driver(self, settings: Settings) -> frozenset[str]:
        self.driver.interval_s = settings.driver_check_interval_s
        return frozenset({"driver_check_interval_s"})

    def apply(self, settings: Settings) -> tuple[frozenset[str], list[str]]:
        with self._apply_lock:
            applied, errors = apply_all(self.components, settings)
            self.settings = settings
            with self.remote.lock:
                self.remote.settings = settings
        return frozenset().union(*applied.values()), errors

    # --- the channel
    def handle(self, msg: Message) -> None:
        if isinstance(msg, StateMsg):
            self.remote.update(msg)
            if self.remote.near_floor():
                self.loop.hurry()  # a quiet wait ends: the configured cadence from the next cycle on
            self.afterkill.guard_state(msg.guard.recent_kills)
            self.headroom.tick()
            self.gpu_fast.watch([key for b in msg.guard.budgets for key in b.gpu_watch])
        elif isinstance(msg, EventMsg):
            self.loop.hurry()  # a kill: the next cycle sees what it left (the after-kill gate, /dev/shm, the peers)
            self.afterkill.guard_event(msg.event)
            if self.router is not None:
                self.router(msg.event)  # already durable in events.jsonl and in the journal: only the alert is left
            self._send(AckMsg((msg.event.id,)))  # the outbox has it (spooled, fsynced): the guard may forget it
        elif isinstance(msg, SettingsMsg) and msg.reload:
            try:
                new = wire_settings(msg.wire)
            except ConfigError as exc:
                self._send(AppliedMsg((), (f"config refused: {exc}",)))
                return
            t0 = time.monotonic()
            keys, errors = self.apply(new)
            took_s = time.monotonic() - t0
            if took_s > 1.0:
                log.warning("reload: applying took %.1f s (a telemetry cycle was running)", took_s)
            self._send(AppliedMsg(tuple(sorted(keys)), tuple(errors)))

    def _wedged(self, w: Wedged) -> None:
        """An engine wedged for kill_wedged_after_s (the serving probe's thread): named to the guard."""
        self._send(
            WedgedMsg(
                w.kind, w.root_pid, w.start_ticks, w.wedged_for_s, w.failures, w.error, w.counter, w.counter_value
            )
        )

    def _send(self, msg: Message) -> None:
        self._offer(msg)

    def _offer(self, msg: Message) -> bool:
        """Hand a message to the guard; False when the channel refused it (full), True otherwise."""
        return self.channel.send(msg) if self.channel is not None else True

    def report(self) -> None:
        """The latest cycle's parts of the guard's STATUS= line, per-pid GPU memory and the GPU holders: when they
        changed, else every TEL_HEARTBEAT_S (the guard's policy takes a GPU reading up to GPU_STALE_S old, and the
        guard's supervisor hears telemetry alive)."""
        snap = self.loop.latest
        now = time.monotonic()
        if snap is not None and snap is not self._last_sent:  # the containers its engine trees run in (names, labels)
            self.container_board.observe(snap.engines, self.containers.running())
        if snap is None or snap is self._last_sent:
            msg = TelMsg()  # alive, nothing new
        else:
            self._last_sent = snap
            reading = gpu_bytes_by_pid(snap)
            msg = TelMsg(
                engines=len(snap.engines),
                compile_jobs=snap.compile.parallel_jobs if snap.compile is not None else None,
                gpu_ts=snap.ts if snap.gpu is not None and snap.gpu.up else None,
                gpu_pids=dict(reading[1]) if reading is not None else {},
                gpu_holders=tuple(sorted(self.loop.telemetry.gpu_holder_keys)),
                engine_roots=tuple(sorted((tree.kind, tree.root.pid) for tree in snap.engines)),
            )
        key = replace(msg, gpu_ts=None)
        if key == self._last_tel and now - self._last_tel_at < TEL_HEARTBEAT_S and not self.remote.near_floor():
            return
        self._send(msg)
        self._last_tel, self._last_tel_at = key, now

    def request_stop(self) -> None:
        self._stop.set()
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def run(self) -> int:
        try:
            # A port in use is not a failure here: the server keeps trying to bind on its own thread (BIND_RETRY_S)
            # while the rest runs. Any other failure to start the endpoint (unreadable TLS files) exits, and the
            # guard's supervisor tries again after its backoff.
            # The endpoint first: it serves (a scrape before the first cycle says so) while the other components'
            # threads start, and the driver check's first dpkg read, the postmortem verdict, the uevent socket and the
            # first /proc scan no longer come before it (bench/RESULTS-telemetry-start.md). Stopped last.
            first = [c for c in self.components if c.obj is self.metrics]
            started = start_all(
                [*first, *(c for c in self.components if c.obj is not self.metrics)], essential={"metrics"}
            )
        except Exception:
            return 3
        endpoint = ""
        if self.metrics in [c.obj for c in started]:
            listen = self.settings.listen
            endpoint = f"; metrics on {listen}" if self.metrics.serving else f"; metrics waiting for {listen}"
        log.info("telemetry running (pid %d): %s%s", os.getpid(), ", ".join(c.name for c in started), endpoint)
        # This thread only answers the guard: the telemetry loop reports after each cycle (report()), so it sleeps
        # until a message comes or stop() is asked for (the signal handler's pipe write wakes it).
        while not self._stop.is_set():
            if self.channel is None:
                self._stop.wait(1.0)
                continue
            try:
                for msg in self.channel.receive(None, wake_fd=self._wake_r):
                    self.handle(msg)
            except ChannelClosed:
                log.info("the guard closed the channel; telemetry stops")
                break
        stop_all(started)
        return 0


def first_settings(channel: Channel, stop: threading.Event) -> tuple[Settings | None, list[Message]]:
    """The config the guard sends first, within FIRST_SETTINGS_S, and what came after it in the same receive (the
    guard's first state: handled once the process is built, never dropped). Raises ChannelClosed or ConfigError."""
    deadline = time.monotonic() + FIRST_SETTINGS_S
    while not stop.is_set() and time.monotonic() < deadline:
        msgs = channel.receive(0.5)
        for i, msg in enumerate(msgs):
            if isinstance(msg, SettingsMsg):
                return wire_settings(msg.wire), msgs[i + 1 :]
    return None, []


def main(argv: Sequence[str] | None = None, preflight: Preflight | None = None) -> int:
    """`preflight`: NVML's load check, already started (telemetry/__main__.py starts it before the imports); None:
    started here, unless --no-nvml."""
    stop = threading.Event()
    target: list[TelemetryProcess] = []

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()
        if target:
            target[0].request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the guard owns reloads; a terminal hangup reaches us too
    # --no-nvml: never load libnvidia-ml (after it hung twice).
    args, _ = parse_daemon_argv(
        sys.argv[1:] if argv is None else argv,
        usage="sparkwatch-telemetry --channel-fd N [--guard-pid PID] [--no-nvml]",
        numbers=("--channel-fd", "--guard-pid"),
        switches=("--no-nvml",),
        required=("--channel-fd",),
    )
    no_nvml, guard_pid = "--no-nvml" in args, args.get("--guard-pid", 0)
    if no_nvml and preflight is not None:
        preflight.abandon()
        preflight = None
    elif not no_nvml and preflight is None:
        preflight = Preflight.start()

    def give_up(status: int) -> int:
        if preflight is not None:
            preflight.abandon()  # its child is ours to reap
        return status

    # Die with the guard (even one killed with SIGKILL): a telemetry process left behind would hold the metrics port.
    syscalls.set_parent_death_signal(signal.SIGKILL)
    if guard_pid and os.getppid() != guard_pid:
        return give_up(0)  # the guard is already gone
    syscalls.set_comm("sparkwatch-tel")
    # Before any thread starts (the guard process does the same): glibc gives each thread that mallocs its own arena
    # (up to 8 per core), and memory freed in one arena is not reused by the others.
    syscalls.limit_malloc_arenas(2)
    handler = logs.setup("telemetry")
    channel = Channel.from_fd(args["--channel-fd"])
    try:
        settings, early = first_settings(channel, stop)
    except (ChannelClosed, ConfigError) as exc:
        log.error("no usable config from the guard: %s", exc)
        return give_up(2)
    if settings is None:
        return give_up(0 if stop.is_set() else 2)
    # NVML is loaded only after a child process showed it loads: a hung load would stop this whole interpreter.
    nvml_off = NVML_OFF if preflight is None else preflight.reason()
    if nvml_off is not None:
        log.error("%s", nvml_off)
    process = TelemetryProcess(settings, channel, log_handler=handler, nvml_off=nvml_off)
    target.append(process)
    for msg in early:
        process.handle(msg)
    if stop.is_set():
        return 0
    return process.run()
