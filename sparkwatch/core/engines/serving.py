"""Is an engine serving, not just up? Where its OpenAI-compatible endpoint is, and what a run of one-token probes
says about it. Pure: telemetry (telemetry/serving.py) reads /proc and sends the probes; launch waits for the first.

An engine that looks up but does not serve is the field's hardest failure: `/v1/models` answered 200 while
generation was dead (vllm#53157), `/health` answered 200 after the workers died (vllm#16259, #11996), SGLang's
health server kept answering after an NCCL abort (sglang PR #21486). So the probe asks for a real token: a
completion of `max_tokens: 1`, temperature 0, and only a choice in a 200 answer counts.

Where the endpoint is, read from the engine's own command line as its CLI reads it:
- vLLM (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`): `--host`, `--port` (default 8000),
  `--api-key` (or VLLM_API_KEY), vllm/entrypoints/openai/cli_args.py;
- SGLang (`python -m sglang.launch_server`, `sglang serve`): `--host`, `--port` (default 30000), `--api-key`,
  sglang/srt/server_args.py;
- llama.cpp's llama-server: `--host`, `--port` (default 8080), `--api-key` (or LLAMA_API_KEY), common/arg.cpp;
- llama-cpp-python's server (`python -m llama_cpp.server`): `--host`, `--port` (default 8000), `--api_key`/`--api-key`
  (pydantic-settings: API_KEY), llama_cpp/server/settings.py.
An engine `sparkwatch launch --probe URL` started is probed at that URL's host and port instead.

The schedule (ServingParams): every `interval_s` (30 s) while it serves; `retry_s` (5 s) after a failure; each probe
within `timeout_s`. `failures_wedged` failures in a row while the process lives make it wedged (one `engine_wedged`
event); the next good answer makes it serving again (one `engine_serving_again`). Failures count only once the
engine's boot is over: a launched engine still in a boot phase, or one that listens on no port of its own yet, is
booting, not wedged. An answer that refuses the key (401, 403) says the engine is up but not what it serves: it
counts neither way. An engine whose own socket cannot be reached for certain (it listens on loopback inside a
container's network namespace, or no link of the host reaches its address there: telemetry.sources.listeners) is
`not_probed`, with the reason: never failing, never wedged, never killed as wedged.

Busy is not wedged (core.engines.progress). After a failed probe telemetry reads the engine's own progress counters and
hands `step` the read: counters that moved since the last look of the same failing run make it busy (the failures in
a row start again from 0; `engine_serving_again` if it was wedged); counters as they were, a first read, a read that
got no answer, or an engine that serves no counters count the failure as before. An engine is killable as wedged
(`killable`) only while it is wedged and its last look found its counters as they were: the stall is proven by its
own counters. One that serves none is never killable (`uncounted`): it may be shown wedged, the guard is never asked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

from sparkwatch.core.engines.enginecli import EngineKind, parse_flags, recognise
from sparkwatch.core.engines.progress import Counters, Look, MetricsRead, Read, look, moved_by

DEFAULT_PORTS: Mapping[str, int] = {
    "vllm": 8000,
    "sglang": 30000,
    "llama-server": 8080,
    "llama_cpp.server": 8000,
}
# What each binds without --host (the probe connects to the listening socket the engine owns, whatever it is).
DEFAULT_HOSTS: Mapping[str, str] = {
    "vllm": "0.0.0.0",
    "sglang": "127.0.0.1",
    "llama-server": "127.0.0.1",
    "llama_cpp.server": "localhost",
}
_ENDPOINT_FLAGS: Mapping[str, str] = {
    "--host": "host",
    "--port": "port",
    "--api-key": "api_key",
    "--api_key": "api_key",
}
# The environment variables an engine takes its key from when no flag gives one.
KEY_VARIABLES: Mapping[str, tuple[str, ...]] = {
    "vllm": ("VLLM_API_KEY",),
    "llama-server": ("LLAMA_API_KEY",),
    "llama_cpp.server": ("API_KEY",),
}
PORT_MAX = 65535
# The request body: one token, deterministic; no model named (every engine here then serves its own one).
PROBE_BODY = b'{"prompt": "Hi", "max_tokens": 1, "temperature": 0}'
PROBE_PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an engine serves: the host it binds (may be a wildcard), the port, the path prefix, and whether its
    command line names a key (the key itself never enters this record: it is read when the probe is sent)."""

    host: str
    port: int
    server: str  # "vllm" | "sglang" | "llama-server" | "llama_cpp.server" | "url"
    prefix: str = ""  # a path before /v1/completions (launch --probe URL)
    key_flag: bool = False


def _words(argv: Sequence[str]) -> Sequence[str]:
    """A retitled process (setproctitle) shows its whole command line as one argument: its words."""
    return argv[0].split() if len(argv) == 1 and " " in argv[0] else argv


def endpoint_of(argv: Sequence[str]) -> Endpoint | None:
    """The OpenAI-compatible endpoint an engine's command line serves, or None (not a server we know, a bad port)."""
    cmd = recognise(_words(argv))
    if cmd.kind == EngineKind.OTHER or cmd.subcommand == "llama-cli":
        return None
    server = cmd.subcommand if cmd.kind == EngineKind.LLAMA_CPP else str(cmd.kind)
    if server not in DEFAULT_PORTS:
        return None
    args = list(cmd.argv)
    flags, _pos = parse_flags(args[1:], _ENDPOINT_FLAGS, vllm=cmd.kind == EngineKind.VLLM)
    port = DEFAULT_PORTS[server]
    if "port" in flags:
        text = flags["port"]
        if not text.isdigit() or not 0 < int(text) <= PORT_MAX:
            return None
        port = int(text)
    host = flags.get("host") or DEFAULT_HOSTS[server]
    return Endpoint(host=host, port=port, server=server, key_flag=bool(flags.get("api_key")))


def api_key_of(argv: Sequence[str], environ: Mapping[str, str], server: str) -> str | None:
    """The key the engine checks: its `--api-key` flag, else its own environment variable. Never logged."""
    cmd = recognise(_words(argv))
    flags, _pos = parse_flags(list(cmd.argv)[1:], _ENDPOINT_FLAGS, vllm=cmd.kind == EngineKind.VLLM)
    if flags.get("api_key"):
        return flags["api_key"]
    for name in KEY_VARIABLES.get(server, ()):
        if environ.get(name):
            return environ[name]
    return None


def endpoint_of_url(url: str) -> Endpoint | None:
    """`launch --probe http://HOST:PORT[/PREFIX]`: the endpoint it names, or None for anything else."""
    scheme, sep, rest = url.partition("://")
    if sep == "" or scheme != "http":
        return None
    hostport, _slash, path = rest.partition("/")
    if hostport.startswith("["):
        host, _b, tail = hostport[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _c, port_text = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    if not host or not port_text.isdigit() or not 0 < int(port_text) <= PORT_MAX:
        return None
    prefix = ("/" + path).rstrip("/") if path else ""
    for tail in (PROBE_PATH, "/v1"):  # the base URL as clients write it, or the completions URL itself
        if prefix.endswith(tail):
            prefix = prefix[: -len(tail)]
            break
    return Endpoint(host=host, port=int(port_text), server="url", prefix=prefix)


class Serving(StrEnum):
    UNKNOWN = "unknown"  # not probed yet, or not listening on its port (booting)
    SERVING = "serving"  # the last probe got a token
    FAILING = "failing"  # failures in a row, fewer than failures_wedged
    BUSY = "busy"  # the last probe failed, but the engine's own counters moved since the look before: not wedged
    WEDGED = "wedged"  # failures_wedged in a row, the process alive
    NOT_PROBED = "not_probed"  # it owns a socket out of reach for certain (the reason: `last.error`)


class Outcome(StrEnum):
    OK = "ok"  # a 200 with a choice
    FAILED = "failed"  # no answer within the timeout, refused, a non-200, or a 200 without a choice
    NOT_LISTENING = "not_listening"  # the engine's processes own no listening socket on the port: not probed
    UNAUTHORIZED = "unauthorized"  # 401/403: up, but the key is not one we know
    NOT_PROBED = "not_probed"  # its socket cannot be reached for certain (another namespace's loopback, no route)


_NOT_SENT = frozenset({Outcome.NOT_LISTENING, Outcome.NOT_PROBED})  # outcomes of a probe that asked nothing


@dataclass(frozen=True, slots=True)
class ServingParams:
    interval_s: float = 30.0
    retry_s: float = 5.0
    timeout_s: float = 10.0
    failures_wedged: int = 3


@dataclass(frozen=True, slots=True)
class ProbeResult:
    outcome: Outcome
    ts: float  # wall clock when it ended
    latency_s: float | None = None  # for OK: request sent to answer read
    error: str = ""  # for FAILED: why, in words (never the key, never the body we sent)


@dataclass(frozen=True, slots=True)
class ServingTrack:
    """One engine's probes so far. `booting`: its boot is not over (a launched engine in a boot phase)."""

    state: Serving = Serving.UNKNOWN
    failures: int = 0  # in a row
    probes: int = 0
    last: ProbeResult | None = None
    last_ok_ts: float | None = None
    first_ok_ts: float | None = None
    wedged_since: float | None = None  # wall clock of the first failure of the run that wedged it
    failing_since: float | None = None
    next_due: float = 0.0  # monotonic
    # The counters at the last look of this failing run (None: none read since the last token), that look's verdict,
    # whether the engine served progress counters at its last answer (None: never looked), and how far the lead
    # counter moved at the last look that found it busy.
    counters: Counters | None = None
    look: Look | None = None
    counted: bool | None = None
    moved: float | None = None

    @property
    def killable(self) -> bool:
        """Wedged, and its own counters proved the stall at the last look: the guard may be asked to kill it."""
        return self.state == Serving.WEDGED and self.look == Look.STALLED and self.counters is not None

    @property
    def uncounted(self) -> bool:
        """It answered without progress counters: a wedge cannot be told from busy, it is never killed as wedged."""
        return self.counted is False


@dataclass(frozen=True, slots=True)
class Change:
    """A state change worth an event: to WEDGED (engine_wedged), or from WEDGED back to SERVING or to BUSY (its
    counters moved: engine_serving_again)."""

    old: Serving
    new: Serving
    failures: int
    since_ts: float | None  # when the failing run started (wedged) / when it was wedged (serving again)
    error: str


def step(
    track: ServingTrack,
    result: ProbeResult,
    now_mono: float,
    params: ServingParams,
    *,
    booting: bool = False,
    counters: MetricsRead | None = None,
) -> tuple[ServingTrack, Change | None]:
    """A probe's result folded into the track: the new track, and the change worth an event (or None). `counters`:
    the read of the engine's progress counters made after this probe failed (None: none was made)."""
    probes = track.probes + (result.outcome not in _NOT_SENT)
    if result.outcome == Outcome.NOT_PROBED:
        # Nothing of the engine's could be asked for certain: no word on whether it serves, so no failure, no wedge
        # (a wedge found before is dropped: it can no longer be shown, nor acted on). The reason stays in `last`.
        new = replace(
            track,
            state=Serving.NOT_PROBED,
            failures=0,
            last=result,
            wedged_since=None,
            failing_since=None,
            next_due=now_mono + params.interval_s,
            counters=None,
            look=None,
            moved=None,
        )
        return new, None
    if result.outcome == Outcome.OK:
        new = replace(
            track,
            state=Serving.SERVING,
            failures=0,
            probes=probes,
            last=result,
            last_ok_ts=result.ts,
            first_ok_ts=track.first_ok_ts if track.first_ok_ts is not None else result.ts,
            wedged_since=None,
            failing_since=None,
            next_due=now_mono + params.interval_s,
            counters=None,
            look=None,
            moved=None,
        )
        change = None
        if track.state == Serving.WEDGED:
            change = Change(Serving.WEDGED, Serving.SERVING, track.failures, track.wedged_since, "")
        return new, change
    if result.outcome in (Outcome.NOT_LISTENING, Outcome.UNAUTHORIZED) or booting:
        # Not a failure of serving: booting, not listening yet, or a key we do not know. The state stands, except that
        # a listener gone is no longer known to serve.
        state = track.state if result.outcome != Outcome.NOT_LISTENING else Serving.UNKNOWN
        if track.state == Serving.WEDGED and result.outcome == Outcome.NOT_LISTENING:
            state = Serving.WEDGED  # a wedged engine that closed its socket is still not serving
        wait = params.retry_s if result.outcome == Outcome.NOT_LISTENING or booting else params.interval_s
        return replace(track, state=state, probes=probes, last=result, next_due=now_mono + wait), None
    seen = look(track.counters, counters) if counters is not None else None
    counted = track.counted
    if counters is not None and counters.read != Read.UNREAD:
        counted = counters.read == Read.COUNTERS
    if seen == Look.MOVING:
        # Busy: it made progress since the last look; the probe waited behind other requests. Not a failure of
        # serving: the run starts again from this read, and the next look is a whole interval away.
        new = replace(
            track,
            state=Serving.BUSY,
            failures=0,
            probes=probes,
            last=result,
            failing_since=None,
            wedged_since=None,
            next_due=now_mono + params.interval_s,
            counters=counters.counters if counters is not None else None,
            look=seen,
            counted=True,
            moved=moved_by(track.counters, counters.counters if counters is not None else None),
        )
        change = None
        if track.state == Serving.WEDGED:
            change = Change(Serving.WEDGED, Serving.BUSY, track.failures, track.wedged_since, result.error)
        return new, change
    kept = track.counters
    if counters is not None and counters.read == Read.COUNTERS:
        kept = counters.counters
    elif counters is not None and counters.read == Read.NONE:
        kept = None
    failures = track.failures + 1
    failing_since = track.failing_since if track.failing_since is not None else result.ts
    state = Serving.WEDGED if failures >= params.failures_wedged else Serving.FAILING
    if track.state == Serving.WEDGED:
        state = Serving.WEDGED
    wedged_since = failing_since if state == Serving.WEDGED else None
    if track.state == Serving.WEDGED:
        wedged_since = track.wedged_since
    new = replace(
        track,
        state=state,
        failures=failures,
        probes=probes,
        last=result,
        failing_since=failing_since,
        wedged_since=wedged_since,
        next_due=now_mono + params.retry_s,
        counters=kept,
        look=seen,
        counted=counted,
        moved=None,
    )
    change = None
    if state == Serving.WEDGED and track.state != Serving.WEDGED:
        change = Change(track.state, Serving.WEDGED, failures, failing_since, result.error)
    return new, change


def wedged_for_s(track: ServingTrack, now: float) -> float | None:
    """How long the engine has been failing, once it is wedged (from its first failure in a row), else None."""
    if track.state != Serving.WEDGED or track.wedged_since is None:
        return None
    return max(now - track.wedged_since, 0.0)


def judge_answer(status: int, body: bytes) -> tuple[Outcome, str]:
    """An HTTP answer to the probe: OK only for a 200 whose JSON has a choice."""
    if status in (401, 403):
        return Outcome.UNAUTHORIZED, f"HTTP {status}"
    if status != 200:
        return Outcome.FAILED, f"HTTP {status}"
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return Outcome.FAILED, "HTTP 200 without JSON"
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        return Outcome.FAILED, "HTTP 200 without a choice"
    return Outcome.OK, ""
