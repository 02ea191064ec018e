"""The boot-phase anchors searched in one pass, for `sparkwatch launch`'s pass-through (cli/launch/runner.py).

core.launch.bootphase searches a chunk anchor by anchor (one bytes.find each: 17 for vLLM, 3.3 ms per MB on a 2-core x86
VM, 4.4 % of a core at 10 MB/s of logs). Here the live anchors are compiled into one leftmost-first Aho-Corasick
automaton (ahocorasick-rs: Rust's aho-corasick crate, whose SIMD prefilter skips bytes that start no anchor; 0.1 ms
per MB on the same VM) that screens each chunk; bootphase searches only a chunk it says holds one, so the phases and
where they are found do not change (tests/test_bootphase.py). Built here, not in core, so that the guard, which
imports core.launch.bootphase for its names, never loads it. The crate's SIMD screen (Teddy) has an aarch64 (NEON) form
too; the figures above are x86_64's, not measured on a GB10.
"""

from __future__ import annotations

import ahocorasick_rs

from sparkwatch.core.launch.bootphase import AnyOf


def any_anchor(texts: tuple[bytes, ...]) -> AnyOf:
    """Whether some bytes hold one of `texts` (core.launch.bootphase.AnyOfFactory)."""
    matcher = ahocorasick_rs.BytesAhoCorasick(texts, matchkind=ahocorasick_rs.MatchKind.LeftmostFirst)

    def any_of(data: bytes) -> bool:
        return bool(matcher.find_matches_as_indexes(data))

    return any_of
