"""The one redaction function: every string that leaves sparkwatch goes through `redact` (events and so the journal
and webhook bodies, `engines` output, log lines on stderr).

What it hides, anywhere in a string (an argv element, a whole process title such as
`VLLM::EngineCore --api-key sk-…`, an `sh -c` script, a log line):
- the value after a secret-looking flag, `--api-key X`, `--api-key=X`, and `-k X`, `--pass X`, `--pwd X`,
  `--creds X`, `--cookie X`, `--hf-token X`, `--password X`, `--secret X`, `--auth X`, `--credential X`;
  a word that only ends in one (`one-token probes`) is prose, not a flag;
- `NAME=value` where NAME holds KEY, TOKEN, SECRET, PASSWORD, PASSWD, PWD, CREDENTIAL(S) or COOKIE;
- `Authorization: Bearer X`, `Bearer X`, `Basic X`;
- HTTP headers whose name looks secret (`X-Api-Key: X`, `X-Auth-Token: X`, `Private-Token: X`) and every cookie of
  `Cookie: a=1; b=2` / `Set-Cookie:`; a header name has a hyphen (or is Cookie/Authorization), so
  `webhook_secret: is empty` in sparkwatch's own messages stays readable;
- JSON members whose key looks secret: `{"token": "…"}`, `"api_key": …`;
- well-known token shapes on their own: `sk-…`, `hf_…`, `ghp_…`/`gho_…`/… and `github_pat_…` (GitHub), `nvapi-…`
  (NVIDIA NGC), `xox?-…` (Slack), `AKIA…` (AWS);
- a password glued to `-p` after mysql, mysqldump, mariadb… (`mysql -uroot -pSECRET`): only there, since `-pthread`
  and `-pipe` on every compiler line sparkwatch shows are flags, and `-p8000` a port;
- URL userinfo (`https://user:pw@host`), and scp's (`user:pw@host:/path`);
- sparkwatch's own webhook URL (path and query) and secret, registered at config load with `remember_secrets`.
Then it cuts control characters (escape sequences, CR/LF that would forge a log line) with `safe_text`.

Over-redaction is the safe side: `--max-num-batched-tokens` and `--tokenizer` are spared, most else that looks
like a secret goes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CMDLINE_MAX_CHARS = 240
REDACTED = "<redacted>"

# Words that make a flag, variable or JSON key secret. `token` but not `tokens`/`tokenizer` (vLLM's
# --max-num-batched-tokens and --tokenizer carry no secret and matter when reading a kill record).
_SECRET_WORD = r"(?:key|token(?!s|izer)|secret|password|passwd|pass|pwd|auth|credentials?|creds|cookie)"
_FLAG_VALUE = re.compile(
    rf"(?<![\w-])(--?[\w-]*{_SECRET_WORD}[\w-]*|-k)(=|\s+)(?!-)(\"[^\"]*\"|'[^']*'|\S+)", re.IGNORECASE
)
_ENV_ASSIGN = re.compile(
    r"\b([A-Za-z_]*(?:KEY|TOKEN(?!S)|SECRET|PASSWORD|PASSWD|PWD|CREDENTIALS?|COOKIE)[A-Za-z0-9_]*)=(\S+)",
    re.IGNORECASE,
)
# The scheme is a word of its own: `one-token probes` (the serving probe's own words) is a compound, not `Token X`.
_AUTH_SCHEME = re.compile(r"(?<![\w-])(Bearer|Basic|Token|Digest)(\s+)[A-Za-z0-9._~+/=:-]{6,}", re.IGNORECASE)
_JSON_MEMBER = re.compile(
    rf"((?:\"|\\\")[\w-]*{_SECRET_WORD}[\w-]*(?:\"|\\\")\s*:\s*)(\\?\"(?:[^\"\\]|\\.)*?\\?\"|[^,}}\s]+)",
    re.IGNORECASE,
)
# Real tokens are longer (ghp_ + 36, hf_ + 34, github_pat_ + 82, nvapi- + 64 characters); the thresholds are lower
# so that a token cut short (the scanner reads the first 8 KiB of a command line) still goes, and high enough that
# words do not: `hf_transfer` (8) stays.
_TOKEN_SHAPES = re.compile(
    r"(?<![A-Za-z0-9])(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{10,}|gh[pousr]_[A-Za-z0-9]{8,}|"
    r"github_pat_[A-Za-z0-9_]{8,}|nvapi-[A-Za-z0-9_-]{8,}|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})"
)
_HEADER_VALUE = (
    r"(?:(?:Bearer|Basic|Token|Digest)\s+)?"
    r"(?:[^=;\s\"']+=[^;\s\"']*(?:;[ \t]*[^=;\s\"']+=[^;\s\"']*)*;?|\"[^\"]*\"|'[^']*'|[^\s\"']+)"
)
# A header name is short: bounded here, and judged in _header, so a long run of letters costs one pass, not n^2.
_HEADER = re.compile(rf"(?<![\w-])([A-Za-z0-9][A-Za-z0-9-]{{0,63}})(:[ \t]*)(?![ \t]|<redacted>)({_HEADER_VALUE})")
_SECRET_NAME = re.compile(_SECRET_WORD, re.IGNORECASE)
_BARE_HEADERS = frozenset({"cookie", "authorization"})
_MYSQL_PROGRAM = r"(?:mysql[\w-]*|mariadb[\w-]*)"
_MYSQL_GLUED = re.compile(rf"(?<![\w/-])((?:\S*/)?{_MYSQL_PROGRAM}\b[^\n]*?\s-p)(?=[^\s-])(\S+)")
_MYSQL_ARGV0 = re.compile(rf"^(?:.*/)?{_MYSQL_PROGRAM}$")
_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")
# scp and rsync's `user:password@host:/path` (no scheme, so no `://`): the userinfo goes whole, as in a URL. A colon is
# what makes it a password: `git@github.com:org/repo` names a user only and stays.
_SCP_USERINFO = re.compile(r"(?<![\w.%+~:/@-])[\w.%+~-]+:[^\s@/:]+@(?=[\w\[])")

# sparkwatch's own secrets (webhook URL path/query, its HMAC secret): set once at config load, read everywhere.
_OWN_SECRETS: tuple[str, ...] = ()


def remember_secrets(values: Iterable[str | None]) -> None:
    """Register strings that must never leave the process (each at least 4 characters, to avoid eating text)."""
    global _OWN_SECRETS  # noqa: PLW0603 - one registry for the process, filled at config load
    known = set(_OWN_SECRETS)
    known.update(v for v in values if v and len(v) >= 4)
    _OWN_SECRETS = tuple(sorted(known, key=len, reverse=True))


def own_secrets() -> tuple[str, ...]:
    """The secrets `remember_secrets` registered (a cache of redacted text keys on them)."""
    return _OWN_SECRETS


def redact(text: str) -> str:
    """`text` with every secret form above replaced by <redacted>, and control characters cut."""
    for secret in _OWN_SECRETS:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _URL_USERINFO.sub(r"\1" + REDACTED + "@", text)
    text = _SCP_USERINFO.sub(REDACTED + "@", text)
    text = _HEADER.sub(_header, text)
    text = _AUTH_SCHEME.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _MYSQL_GLUED.sub(lambda m: f"{m.group(1)}{REDACTED}", text)
    text = _JSON_MEMBER.sub(lambda m: f'{m.group(1)}"{REDACTED}"', text)
    text = _FLAG_VALUE.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)
    text = _ENV_ASSIGN.sub(lambda m: f"{m.group(1)}={REDACTED}", text)
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    return safe_text(text)


def _header(match: re.Match[str]) -> str:
    name = match.group(1)
    if not _SECRET_NAME.search(name) or ("-" not in name and name.lower() not in _BARE_HEADERS):
        return match.group(0)  # not secret; or `key: …`: prose, not a header
    return f"{name}{match.group(2)}{REDACTED}"


def redact_value(value: Any) -> Any:
    """`redact` applied to every string inside a JSON-like value (dict keys are names, kept as they are but for their
    control characters: a peer's or Ray's name as a key is remote text too)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, Mapping):
        return {safe_text(k) if isinstance(k, str) else k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_value(v) for v in value]
    return value


def redact_argv(argv: Sequence[str]) -> list[str]:
    """Each argument redacted, and the one after a bare secret flag (`--api-key`, `-k`) as a whole."""
    out: list[str] = []
    hide_next = False
    mysql = bool(argv) and _MYSQL_ARGV0.match(argv[0]) is not None
    for arg in argv:
        if hide_next and not arg.startswith("-"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = _FLAG_VALUE.fullmatch(arg + " x") is not None
        if mysql and len(arg) > 2 and arg.startswith("-p") and arg[2] != "-":
            out.append("-p" + REDACTED)  # mysql -pSECRET: the password glued to the flag
            continue
        out.append(redact(arg))
    return out


def safe_cmdline(argv: Sequence[str], limit: int = CMDLINE_MAX_CHARS) -> str:
    text = " ".join(redact_argv(argv)).strip()  # setproctitle pads the title with spaces
    return text if len(text) <= limit else text[: limit - 1] + "…"


# C0 and C1 controls (ESC starts terminal escape sequences, 0x9b is CSI on its own; BEL, backspace and CR redraw
# a line; CR/LF forge log lines), DEL, and the Unicode line and paragraph separators, the bidi embeddings, overrides
# and isolates that reorder what a terminal shows (U+202A-202E, U+2066-2069: "Trojan Source") and the bidi marks
# (U+061C, U+200E, U+200F).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def safe_text(text: str) -> str:
    """`text` with line breaks and tabs as spaces and every other control character as '?': one line, safe to print
    on a terminal, in a log or on a pipe.

    The one owner of "remote text is inert": every string from Ray's state API, a peer or an engine (a process title,
    an actor's class name, a node id) passes through it where it enters (telemetry.sources.raystate's parse) or where
    it leaves (`redact`, and so events, log lines and webhooks; the terminal views through tui.console)."""
    return _CONTROL.sub(_replace_control, text)


def _replace_control(match: re.Match[str]) -> str:
    return " " if match.group(0) in "\t\n\r\x0b\x0c\x85\u2028\u2029" else "?"
