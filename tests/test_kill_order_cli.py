"""`sparkwatch engines` shows the order in which the guard would kill now, and why: real trees, a real command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import Spawner, pids_in


def engines(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sparkwatch", "engines", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def root(pidfile: Path) -> int:
    return next(pid for pid, (_t, role) in pids_in(pidfile).items() if role == "root")


def test_engines_ranks_the_growing_tree_first_and_names_never_kill(spawner: Spawner, tmp_path: Path) -> None:
    old, new, kept = tmp_path / "old.pids", tmp_path / "new.pids", tmp_path / "kept.pids"
    spawner.engine("--hog-rate-mib", "1024", "--hog-limit-mib", "64", pidfile=old, wait_for=2)
    spawner.engine("--title", "llama-server", pidfile=kept, wait_for=1)
    time.sleep(0.5)
    # Grows 64 MiB/s for 8 s: well past the growth threshold within the command's 2 s window, and bounded.
    spawner.engine("--hog-rate-mib", "64", "--hog-limit-mib", "512", pidfile=new, wait_for=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env.update(
        {
            "SPARKWATCH_ANCESTOR_PID": str(os.getpid()),
            "SPARKWATCH_NEVER_KILL": '["llama-server"]',
            "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
        }
    )
    out = engines("--json", "--window", "2", env=env)
    assert out.returncode == 0, out.stderr
    order = json.loads(out.stdout)["kill_order"]
    assert [o["root_pid"] for o in order] == [root(new), root(old), root(kept)]
    assert [o["order"] for o in order] == [1, 2, None]
    assert order[0]["growing"] and order[0]["why"][0].startswith("grew ")
    assert order[1]["why"][0].startswith("steady")
    assert order[2]["never_kill"] == "llama-server"
    text = engines("--window", "0", env=env)
    assert text.returncode == 0, text.stderr
    assert "kill order" in text.stdout and "never_kill matches 'llama-server'" in text.stdout


def test_policy_config_mistakes_name_the_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path / "xdg")
    cases = {
        "SPARKWATCH_KILL_ORDER": ('["growth", "oldest"]', "kill_order: 'oldest' is not one of"),
        "SPARKWATCH_KILL_PRIORITY": ('["high=vllm"]', "kill_priority: 'high=vllm' should be written as priority=regex"),
        "SPARKWATCH_NEVER_KILL": ('["("]', "never_kill: '(' is not a valid regex"),
        "SPARKWATCH_KILL_SETTLE_S": ("0", "kill_settle_s: "),
    }
    for name, (value, message) in cases.items():
        out = subprocess.run(
            [sys.executable, "-m", "sparkwatch", "check-config"],
            check=False,
            capture_output=True,
            text=True,
            env={**env, name: value},
            timeout=60,
        )
        assert out.returncode == 2, (name, out.stdout, out.stderr)
        assert message in out.stderr, out.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "check-config"],
        check=False,
        capture_output=True,
        text=True,
        env={**env, "SPARKWATCH_KILL_PRIORITY": '["-10=--served-model-name prod"]'},
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "-10=--served-model-name prod" in ok.stdout
