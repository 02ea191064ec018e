"""Command lines go into events, logs and webhooks: cut them short and strip anything that looks like a secret."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence

CMDLINE_MAX_CHARS = 240
_SECRET_FLAG = re.compile(r"^--?[\w-]*(key|token|secret|password|passwd|auth|credential)[\w-]*$", re.IGNORECASE)
_SECRET_ASSIGN = re.compile(
    r"^(--?[\w-]*(key|token|secret|password|passwd|auth|credential)[\w-]*=|"
    r"[A-Z_]*(KEY|TOKEN|SECRET|PASSWORD)[A-Z_]*=)(.+)$",
    re.IGNORECASE,
)
# Token shapes that leak on their own: Hugging Face, OpenAI-style, GitHub, Slack, AWS, and URL userinfo.
_SECRET_VALUE = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|"
    r"xox[abpr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})$"
)
_URL_USERINFO = re.compile(r"(://)[^/@\s]+@")
REDACTED = "<redacted>"


def redact_argv(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if _SECRET_FLAG.match(arg):
            out.append(arg)
            hide_next = True
            continue
        assign = _SECRET_ASSIGN.match(arg)
        if assign:
            out.append(assign.group(1) + REDACTED)
            continue
        if _SECRET_VALUE.match(arg):
            out.append(REDACTED)
            continue
        out.append(_URL_USERINFO.sub(r"\1" + REDACTED + "@", arg))
    return out


def safe_cmdline(argv: Sequence[str], limit: int = CMDLINE_MAX_CHARS) -> str:
    text = " ".join(redact_argv(argv)).strip()  # setproctitle pads the title with spaces
    return text if len(text) <= limit else text[: limit - 1] + "…"


def redact_url(url: str) -> str:
    """scheme://host[:port] only: a Slack-style webhook URL carries its secret in the path (and userinfo may too)."""
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.hostname or '?'}" + (f":{parts.port}" if parts.port else "")


# C0 and C1 controls (ESC starts terminal escape sequences; CR/LF forge log lines), DEL, and the Unicode line and
# paragraph separators and bidi overrides that reorder what a terminal shows.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def safe_text(text: str) -> str:
    """`text` with every control character shown as '?': safe to print on a terminal, a log line or a pipe."""
    return _CONTROL.sub("?", text)
