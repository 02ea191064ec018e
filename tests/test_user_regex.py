"""The owner's regexes are bounded: catastrophic patterns are refused naming the key and the entry, and every pattern
sees at most MATCH_TEXT_MAX characters of a string (core.userregex). `never_kill = ["(a+)+$"]` used to be accepted:
2^n steps, holding the guard's GIL, on a command line of n `a`s."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from sparkwatch.common.sources.procs import ProcScanner
from sparkwatch.config.settings import ConfigError, load_settings
from sparkwatch.core.engines.identity import EngineRules, classify, identity_strings, is_protected
from sparkwatch.core.kill import policy
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.core.userregex import MATCH_TEXT_MAX, compile_user_regex


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("SPARKWATCH_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


NESTED = "repeats a part that can itself match in more than one way"
REFUSED = [
    ("never_kill", "(a+)+$", "(a+)+$", NESTED),
    ("never_kill", "(a|ab)*x", "(a|ab)*x", NESTED),
    ("never_kill", r"(\w+\s?)*$", r"(\w+\s?)*$", NESTED),
    ("never_kill", "(a?){25}a{25}", "(a?){25}a{25}", NESTED),
    ("never_kill", r"(.)\1", r"(.)\1", "backreference"),
    ("never_kill", "a.*b.*c", "a.*b.*c", "2 unbounded repeats"),
    ("never_kill", ".*a?x", ".*a?x", "an unbounded repeat and 2 combinations"),
    ("never_kill", "a?" * 7, "a?" * 7, "128 combinations"),
    ("kill_priority", "5=(a+)+$", "5=(a+)+$", NESTED),
    ("kill_priority", "-10=.*prod.*", "-10=.*prod.*", "2 unbounded repeats"),
    ("engine_patterns", "mine=(x+x+)+y", "mine=(x+x+)+y", NESTED),
    ("engine_patterns", "mine=(?P<a>x)(?P=a)", "mine=(?P<a>x)(?P=a)", "backreference"),
    ("protect_patterns", "^(/opt/[a-z]+)*/bin/", "^(/opt/[a-z]+)*/bin/", NESTED),
    ("protect_patterns", ".*tool.*", ".*tool.*", "2 unbounded repeats"),
]


@pytest.mark.parametrize(("key", "pattern", "entry", "why"), REFUSED)
def test_catastrophic_patterns_are_refused_naming_the_key_and_entry(
    key: str, pattern: str, entry: str, why: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, {key: [pattern]})
    message = str(err.value)
    assert message.startswith(f"{key}: {entry!r} ") and why in message, message
    assert "\n" not in message


def test_check_config_refuses_a_catastrophic_never_kill(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("never_kill = ['(a+)+$']\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKWATCH_")}
    res = subprocess.run(
        [sys.executable, "-m", "sparkwatch", "check-config", "--config", str(cfg)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("sparkwatch: config error: never_kill: '(a+)+$' repeats a part"), res.stderr


@pytest.mark.parametrize(
    ("key", "pattern"),
    [
        ("kill_priority", "-10=--served-model-name prod"),  # README's example
        ("kill_priority", "10=--served-model-name draft"),
        ("never_kill", "--served-model-name (prod|staging)"),
        ("never_kill", "llama-server.*70b"),
        ("never_kill", "^VLLM::"),
        ("engine_patterns", "myengine=my-server$"),  # docs' example
        ("engine_patterns", r"mine=[^\s:/]+::Engine(_|$|\s)"),  # a shape like the built-in ones
        ("protect_patterns", "^/opt/tool/bin/"),
        ("protect_patterns", "^keepme$"),
    ],
)
def test_the_patterns_owners_write_are_kept(key: str, pattern: str) -> None:
    assert getattr(load_settings(None, {key: [pattern]}), key) == [pattern]


def proc_with(argv: tuple[str, ...], comm: str = "python3") -> Proc:
    return Proc(pid=4242, ppid=1, uid=0, comm=comm, state="S", start_ticks=1, rss_bytes=0, argv=argv)


def test_every_string_a_pattern_sees_is_cut() -> None:
    long_arg = "a" * (128 << 10)
    proc = proc_with(("/usr/bin/llama-server" + "x" * 10_000, "--model", long_arg))
    tree = EngineTree(kind="llama.cpp", root=proc, members=(proc,))
    assert all(len(s) <= MATCH_TEXT_MAX for s in policy.policy_strings(tree))
    assert all(len(s) <= MATCH_TEXT_MAX for s in identity_strings(proc))
    # A flag past the cut is not seen: the documented limit of never_kill and kill_priority.
    late = proc_with(("/venv/bin/vllm", "serve", "m", "--x", "y" * MATCH_TEXT_MAX, "--served-model-name", "prod"))
    params = policy.PolicyParams.build(never_kill=["--served-model-name prod"])
    ranked = policy.rank([EngineTree("vllm", late, (late,))], policy.GrowthHistory(), 0.0, None, params)
    assert ranked[0].never_kill is None
    early = proc_with(("/venv/bin/vllm", "serve", "m", "--served-model-name", "prod", "--x", "y" * MATCH_TEXT_MAX))
    ranked = policy.rank([EngineTree("vllm", early, (early,))], policy.GrowthHistory(), 0.0, None, params)
    assert ranked[0].never_kill == "--served-model-name prod"


def test_protect_and_engine_patterns_see_a_cut_path() -> None:
    rules = EngineRules.build(["mine=^my-server$"], [r"^/opt/tool/bin/.*x$"])
    path = "/opt/tool/bin/" + "a" * (64 << 10) + "x"
    deep = replace(proc_with((path,), comm="tool"), exe=path)
    assert not is_protected(deep, rules)  # the `x` lies past the cut: not protected by this pattern
    assert classify(proc_with(("my-server",), comm="my-server"), rules) is not None


def test_the_worst_accepted_pattern_on_a_real_128_kib_command_line_is_bounded() -> None:
    """A real process with a 128 KiB command line shaped against the pattern, read by the guard's own scanner, ranked
    by the guard's own policy. bench/RESULTS-regex.md has the figures (29 ms here); this is a sanity bound only."""
    pattern = r"(?:a\S)*x"
    compile_user_regex(pattern, searched=True)  # accepted
    arg = "ab" * (16 << 10)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", arg, arg, arg, arg])
    try:
        deadline = time.monotonic() + 10
        proc = None
        while time.monotonic() < deadline:
            proc = ProcScanner().read_proc(child.pid)
            if proc is not None and len(proc.argv) >= 4:
                break
            time.sleep(0.05)
        assert proc is not None and len(proc.argv) >= 4  # the scanner reads the first 8 KiB
        params = policy.PolicyParams.build(never_kill=[pattern], kill_priority=[f"5={pattern}"])
        started = time.process_time()
        policy.rank([EngineTree("vllm", proc, (proc,))], policy.GrowthHistory(), 0.0, None, params)
        assert time.process_time() - started < 2.0
    finally:
        child.kill()
        child.wait()
