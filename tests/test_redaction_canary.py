"""Canaries: every secret form planted in real processes' titles and argv and in the config, a real kill and its
alerts driven through a real daemon and a loopback receiver, and every output grepped for every canary."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from sparkwatch.common.eventlog import EventLog, make_event, read_events
from sparkwatch.common.systemd import JournalSink
from sparkwatch.core.eventkinds import EventKind
from sparkwatch.core.redact import redact, redact_argv, remember_secrets
from tests.conftest import Spawner, floor_that_fires_at_once, wait_until
from tests.daemon import sparkwatch_run
from tests.receiver import Receiver

# Each canary is the secret part only; the forms around them are what a real command line or title looks like.
C = {
    "title_key": "sk-canaryTitleKey0001abcdefgh",
    "api_key": "canaryApiKey0002",
    "hf_token": "hf_canaryHfToken0003abcdefghij",
    "bearer": "canaryBearer0004.abc.def",
    "k": "canaryDashK0005",
    "pass": "canaryPass0006",
    "pwd": "canaryPwd0007",
    "creds": "canaryCreds0008",
    "cookie": "canaryCookie0009",
    "json": "canaryJson0010",
    "userinfo": "canaryUserPw0011",
    "ghp": "ghp_canaryGhp0012abcdefghijklm",
    "xox": "xoxb-canaryXox0013-abcdef",
    "shc": "canaryShC0014",
    "env": "canaryEnv0015",
    "hook_path": "canaryHookPath0016",
    "hook_secret": "canary-hook-secret-0017",
    "x_api_key": "canaryXApiKey0018",
    "cookie_header": "canaryCookieHeader0019",
    "nvapi": "nvapi-canaryNgc0020abcdefghijklmnop",
    "github_pat": "github_pat_canaryPat0021_abcdefghij",
    "ghp_cut": "ghp_canary22ab",  # a token cut short (the scanner reads 8 KiB of a command line)
    "hf_cut": "hf_canary0023x",
    "mysql_p": "canaryMysql0024",
    "scp": "canaryScpPw0025",
    "api_token": "canaryApiToken0026",
}

WORKER_ARGV = [
    "--api-key",
    C["api_key"],
    f"--hf-token={C['hf_token']}",
    f"Authorization: Bearer {C['bearer']}",
    "-k",
    C["k"],
    "--pass",
    C["pass"],
    "--pwd",
    C["pwd"],
    "--creds",
    C["creds"],
    "--cookie",
    C["cookie"],
    json.dumps({"token": C["json"]}),
    f"https://user:{C['userinfo']}@models.example/x",
    C["ghp"],
    C["xox"],
    f"HF_TOKEN={C['env']}",
]
# A second worker: a kill record shows the first 240 characters of a command line, so these come first in theirs.
WORKER2_ARGV = [
    f"X-Api-Key: {C['x_api_key']}",
    f"Cookie: theme=dark; sid={C['cookie_header']}",
    C["nvapi"],
    C["github_pat"],
    C["ghp_cut"],
    C["hf_cut"],
    f"ubuntu:{C['scp']}@nas.example:/models/m",  # scp's and rsync's user:password@host:/path
    f"--api-token={C['api_token']}",
]
# mysql-style: the password glued to -p, as mysql, mysqldump and mariadb take it.
MYSQL_ARGV = ["mysql", "-c", "import time; time.sleep(120)", "-uroot", f"-p{C['mysql_p']}", "db"]

ROOT = f"""
import setproctitle, subprocess, sys, time
setproctitle.setproctitle("VLLM::EngineCore --api-key {C["title_key"]}")
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *{WORKER_ARGV!r}])
worker2 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *{WORKER2_ARGV!r}])
shell = subprocess.Popen(["sh", "-c", "sleep 120; echo --password {C["shc"]}"])
mysql = subprocess.Popen({MYSQL_ARGV!r}, executable=sys.executable)  # a python titled mysql by its argv[0]
print("up", flush=True)
time.sleep(120)
"""


def leaks(text: str) -> list[str]:
    return [name for name, value in C.items() if value in text]


def test_redact_covers_every_form() -> None:
    remember_secrets([f"/services/T/B/{C['hook_path']}", C["hook_secret"]])
    text = " ".join(
        [
            f"VLLM::EngineCore --api-key {C['title_key']}",
            *WORKER_ARGV,
            *WORKER2_ARGV,
            f"sh -c 'sleep 1; echo --password {C['shc']}'",
            f"sh -c 'mysqldump -uroot -p{C['mysql_p']} --all-databases > x.sql'",
            f"https://hooks.example/services/T/B/{C['hook_path']} {C['hook_secret']}",
        ]
    )
    assert leaks(redact(text)) == []
    # What is not a secret stays readable.
    kept = redact("vllm serve m --max-num-batched-tokens 8192 --tokenizer meta/x --port 8000")
    assert kept == "vllm serve m --max-num-batched-tokens 8192 --tokenizer meta/x --port 8000"
    for plain in (
        "gcc -pthread -pipe -O2 -c x.c",  # -p glued to a flag, not a password: only mysql's -p is
        "docker run -p8080:80 img",
        "reload: webhook_secret: changed (value hidden)",  # sparkwatch's own messages are prose, not headers
        "Content-Type: application/json",
        "pip install hf_transfer",
        # sparkwatch's own prose: a word ending in -token is not a flag, and `token` in it not a `Token X` scheme
        "whether each serves (one one-token completion to its own port)",
        "one-token probes failed in a row",
        "git clone git@github.com:org/repo",  # scp's form with a user but no password
    ):
        assert redact(plain) == plain
    for secret_form in (f"--hf-token {C['hf_token']}", f"--api-token={C['api_token']}", f"HF_TOKEN={C['env']}"):
        assert leaks(redact(secret_form)) == [], secret_form
    assert redact_argv(MYSQL_ARGV)[4] == "-p<redacted>"
    assert redact_argv(["gcc", "-pthread", "-pipe"]) == ["gcc", "-pthread", "-pipe"]


def test_journal_datagrams_carry_no_canary(tmp_path: Path) -> None:
    path = tmp_path / "journal.socket"
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(str(path))
    try:
        log = EventLog(tmp_path / "events.jsonl")
        log.subscribe(JournalSink(backend="native", socket_path=path))
        summary = f"Killed vllm (root VLLM::EngineCore --api-key {C['title_key']})"
        victims = [{"cmdline": " ".join(WORKER_ARGV)}, {"cmdline": " ".join(WORKER2_ARGV)}]
        log.append(make_event(EventKind.KILL, summary, {"victims": victims}))
        rx.settimeout(10)
        data = rx.recv(1 << 20).decode(errors="replace")
    finally:
        rx.close()
    assert "SPARKWATCH_EVENT" in data
    assert leaks(data) == []


@pytest.mark.slow
def test_no_canary_reaches_any_output(spawner: Spawner, tmp_path: Path) -> None:
    receiver = Receiver().start()
    try:
        root = spawner.popen([sys.executable, "-c", ROOT], stdout=subprocess.PIPE)
        assert root.stdout is not None and root.stdout.readline() == b"up\n"
        floor = floor_that_fires_at_once()
        cfg = tmp_path / "config.toml"
        cfg.write_text(
            f'webhook_url = "{receiver.url_base}/services/T0/B0/{C["hook_path"]}"\n'
            f'webhook_secret = "{C["hook_secret"]}"\n'
            "webhook_timeout_s = 2.0\nwebhook_backoff_min_s = 0.05\nwebhook_backoff_max_s = 0.3\n"
            f'floor = "{floor}B"\nrearm_headroom = "1MiB"\nmlock = false\n'
        )
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")},
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        }
        outputs: dict[str, str] = {}
        for args in (["engines", "--json"], ["engines"]):
            res = subprocess.run(
                [sys.executable, "-m", "sparkwatch", *args, "--config", str(cfg)],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            assert res.returncode == 0, res.stderr
            outputs[" ".join(args)] = res.stdout + res.stderr
        assert "VLLM::EngineCore" in outputs["engines --json"]  # the engine was there to be shown
        with sparkwatch_run(tmp_path, "--config", str(cfg)) as daemon:
            assert wait_until(lambda: any(e["kind"] == "kill" for e in read_events(daemon.events_path)), 60)
            assert wait_until(lambda: any(d.payload["kind"] == "kill" for d in receiver.deliveries), 30)
            with urllib.request.urlopen(f"http://127.0.0.1:{daemon.port}/metrics", timeout=10) as r:
                outputs["/metrics"] = r.read().decode()
            time.sleep(0.5)
        outputs["events.jsonl"] = daemon.events_path.read_text()
        outputs["stderr"] = "\n".join(daemon.stderr_lines)
        outputs["webhook bodies"] = "\n".join(d.body.decode(errors="replace") for d in receiver.deliveries)
        assert "sparkwatch: KILL vllm tree" in outputs["stderr"]
        kill = next(e for e in read_events(daemon.events_path) if e["kind"] == "kill")
        assert len(kill["victims"]) >= 5  # root, two workers, shell (and its sleep), mysql
        found = {where: leaks(text) for where, text in outputs.items() if leaks(text)}
        assert found == {}, found
    finally:
        receiver.stop()
