"""The owner's regexes (never_kill, kill_priority, engine_patterns, protect_patterns): bounded before they run.

The guard matches them on its kill path, near the floor, against text other users control (a command line), with
the standard library's backtracking engine: a C call that holds the GIL from start to end, so one slow match stops
every thread of the guard. `never_kill = ["(a+)+$"]` was accepted, and took 2^n steps on a line of n `a`s.
The guard may import only the standard library (no re2), so the cost is bounded in two ways:

1. The text: a pattern sees at most MATCH_TEXT_MAX characters of any string (`bounded`): the command line, the
   title, an identity string. The scanner reads at most 8 KiB of /proc/PID/cmdline anyway.
2. The pattern: `compile_user_regex` walks the parsed pattern (the standard library's own parser, `re._parser`,
   which 3.11, 3.12 and 3.13 all have) and refuses
   - backreferences and conditional groups (their matching time has no polynomial bound);
   - a repeat around anything that can itself match in more than one way: a repeat, alternatives, an optional part
     (`(a+)+`, `(a|ab)*`, `(\\w+\\s?)*`, `(a?){20}`): exponential;
   - two unbounded repeats (`*`, `+`, `{n,}`, or a bound wider than WIDE_SPAN): n^2 ways on n characters
     (`a.*b.*c` took 15.6 s on 8 KiB of `ab`, measured);
   - more than CHOICES_MAX combinations of alternatives, optional parts and bounded repeats;
   - in a searched pattern (never_kill, kill_priority: `search`, tried at every position), an unbounded repeat with
     anything else that varies (`.*a?x`: 77 ms on 4 KiB); anchored ones (engine_patterns, protect_patterns:
     `match`, tried once) may have both.
   The worst accepted patterns, measured on a 128 KiB command line: bench/RESULTS-regex.md.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# The standard library's own regex parser (re._parser and re._constants on 3.11, 3.12 and 3.13; typeshed has no
# stubs for them, and the old sre_parse names warn on import since 3.11).
sre_p: Any = importlib.import_module("re._parser")
sre_c: Any = importlib.import_module("re._constants")

# What a pattern sees of any one string. vLLM's command lines here are 0.2-2 KiB with a JSON config; an owner's
# `--served-model-name prod` sits well inside. Beyond this a never_kill pattern does not look (docs/security.md).
MATCH_TEXT_MAX = 4096
WIDE_SPAN = 8  # a bounded repeat wider than this ({0,100}) counts like an unbounded one
# Combinations of alternatives, optional parts and bounded repeats a pattern may try at one position. Measured on
# 4 KiB of adversarial text, searched (bench/RESULTS-regex.md): 64 took 4 ms, 4,096 took 260 ms.
CHOICES_MAX = 64

_PLAIN = frozenset({sre_c.LITERAL, sre_c.NOT_LITERAL, sre_c.ANY, sre_c.IN, sre_c.AT, sre_c.CATEGORY})
_REPEATS = frozenset({sre_c.MAX_REPEAT, sre_c.MIN_REPEAT, sre_c.POSSESSIVE_REPEAT})
_BACKREFS = frozenset({sre_c.GROUPREF, sre_c.GROUPREF_EXISTS})
_NESTED = (
    "repeats a part that can itself match in more than one way (a repeat, an optional part or alternatives inside "
    "a repeat, as in (a+)+ or (a|ab)*): exponential time on a long command line"
)


class _Refused(Exception):
    pass


def bounded(text: str) -> str:
    """The part of `text` a user pattern sees."""
    return text if len(text) <= MATCH_TEXT_MAX else text[:MATCH_TEXT_MAX]


# A pattern's cost at one position: (unbounded repeats, combinations of everything else). An unbounded repeat tries
# up to n lengths on n characters, so two of them n^2 (a.*b.*c), and each further choice multiplies.
_Cost = tuple[int, int]


def _seq_cost(sub: Any) -> _Cost:
    wide, choices = 0, 1
    for op, av in sub:
        w, c = _item_cost(op, av)
        wide, choices = wide + w, choices * c
    return wide, choices


def _item_cost(op: Any, av: Any) -> _Cost:
    if op in _PLAIN:
        return 0, 1
    if op is sre_c.SUBPATTERN:  # (group, add_flags, del_flags, body)
        return _seq_cost(av[3])
    if op is sre_c.ATOMIC_GROUP:
        return _seq_cost(av)
    if op in (sre_c.ASSERT, sre_c.ASSERT_NOT):  # (direction, body): run wherever it is reached
        return _seq_cost(av[1])
    if op is sre_c.BRANCH:  # (None, [alternatives])
        costs = [_seq_cost(alt) for alt in av[1]]
        return max(w for w, _ in costs), sum(c for _, c in costs)
    if op in _REPEATS:
        low, high, body = av
        wide, choices = _seq_cost(body)
        width_low, width_high = body.getwidth()
        if high > 1 and (wide or choices > 1 or width_low != width_high):
            raise _Refused(_NESTED)
        if low == high:
            return wide, choices
        if high == sre_c.MAXREPEAT or high - low > WIDE_SPAN:
            return 1, 1
        return (wide, choices + 1) if high <= 1 else (0, int(high - low) + 1)
    if op in _BACKREFS:
        raise _Refused("uses a backreference or a conditional group: its matching time has no bound")
    raise _Refused(f"uses {str(op).lower()}, which sparkwatch does not run")


def compile_user_regex(text: str, *, searched: bool, entry: str | None = None) -> re.Pattern[str]:
    """Compile an owner's pattern, or raise ValueError naming the entry (`entry`, default the pattern) and saying why
    in one line. `searched`: tried at every position of the text (`search`); otherwise at its start (`match`)."""
    name = repr(text if entry is None else entry)
    try:
        compiled = re.compile(text)
        wide, choices = _seq_cost(sre_p.parse(text))
    except re.error as exc:
        raise ValueError(f"{name} is not a valid regex: {exc}") from None
    except _Refused as why:
        raise ValueError(f"{name} {why}") from None
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply") from None
    if wide > 1:
        raise ValueError(
            f"{name} has {wide} unbounded repeats (*, +, {{n,}}): together they try n^{wide} ways on an n-character "
            "command line (a.*b.*c took 15.6 s on 8 KiB); keep one"
        )
    if choices > CHOICES_MAX:
        raise ValueError(
            f"{name} tries {choices:,} combinations of alternatives, optional parts and bounded repeats at each "
            f"position (at most {CHOICES_MAX})"
        )
    if searched and wide and choices > 1:
        raise ValueError(
            f"{name} has an unbounded repeat and {choices} combinations of alternatives or optional parts besides: "
            "searched at every position of a long command line that multiplies; keep the repeat alone (the pattern "
            "is searched anywhere, so a leading .* is never needed, and a space does for \\s+)"
        )
    return compiled
