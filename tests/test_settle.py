"""core.launch.settle: when a torn-down engine has let go of the pool."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sparkwatch.core.launch.settle import (
    SettleParams,
    SettleState,
    SettleVerdict,
    describe,
    max_rise,
    settle_step,
    steady_suffix,
)
from sparkwatch.core.units import GiB, MiB

PARAMS = SettleParams(quiet_for_s=5.0, tolerance_bytes=256 * MiB)


def feed(samples: list[tuple[float, int, int]], params: SettleParams = PARAMS) -> list[SettleVerdict]:
    state = SettleState()
    out = []
    for t, engines, avail in samples:
        state, verdict = settle_step(state, params, t, engines, avail)
        out.append(verdict)
    return out


def test_never_settled_while_an_engine_process_is_left() -> None:
    verdicts = feed([(t * 0.5, 1, 20 * GiB) for t in range(40)])
    assert not any(v.settled for v in verdicts)
    assert all(v.engine_processes == 1 and v.steady_for_s == 0 for v in verdicts)


def test_settles_after_quiet_period_once_engines_are_gone() -> None:
    # Engines go at t=2; memory is flat (noise of 100 MiB, as measured on a Spark) from then on.
    samples = [(t * 0.5, 3 if t * 0.5 < 2 else 0, 20 * GiB + (t % 2) * 100 * MiB) for t in range(30)]
    verdicts = feed(samples)
    first = next(i for i, v in enumerate(verdicts) if v.settled)
    assert samples[first][0] == 7.0  # 2 s (engines gone) + 5 s quiet
    assert all(v.settled for v in verdicts[first:])


def test_rising_memory_restarts_the_quiet_period() -> None:
    # The teardown returns 1 GiB a second from t=0 to t=4 (memory coming back after the kill), flat after.
    samples = [(t * 0.5, 0, 10 * GiB + int(min(t * 0.5, 4.0) * GiB)) for t in range(30)]
    verdicts = feed(samples)
    first = next(i for i, v in enumerate(verdicts) if v.settled)
    assert samples[first][0] == 9.0  # flat from t=4, settled 5 s later
    assert verdicts[first - 1].steady_for_s < 5.0


def test_falling_memory_does_not_hold_the_wait() -> None:
    # Someone else allocating: waiting would not help, and vLLM's check is about memory *rising*.
    samples = [(t * 0.5, 0, 30 * GiB - t * GiB) for t in range(12)]
    verdicts = feed(samples)
    assert verdicts[10].settled and samples[10][0] == 5.0


def test_a_single_excursion_over_tolerance_only_delays() -> None:
    samples = [(t * 0.5, 0, 20 * GiB + (GiB if t == 6 else 0)) for t in range(30)]
    verdicts = feed(samples)
    first = next(i for i, v in enumerate(verdicts) if v.settled)
    # The 1 GiB jump at t=3 is a rise; the quiet period counts from there: 3 + 5 = 8 s.
    assert samples[first][0] == 8.0


def test_engine_reappearing_resets() -> None:
    samples = [(0.0, 0, GiB), (4.0, 0, GiB), (4.5, 1, GiB), (5.0, 0, GiB), (9.0, 0, GiB), (10.0, 0, GiB)]
    verdicts = feed(samples)
    assert [v.settled for v in verdicts] == [False, False, False, False, False, True]


def test_zero_quiet_period_settles_at_once() -> None:
    verdicts = feed([(0.0, 0, GiB)], SettleParams(quiet_for_s=0.0, tolerance_bytes=0))
    assert verdicts[0].settled


def test_state_stays_small() -> None:
    state = SettleState()
    for i in range(10_000):
        state, _ = settle_step(state, PARAMS, i * 0.1, 0, GiB)
    assert len(state.samples) <= 52  # the 5 s window at 0.1 s plus the anchor


@given(st.lists(st.integers(min_value=0, max_value=64 * GiB), min_size=1, max_size=40))
def test_steady_suffix_agrees_with_brute_force(values: list[int]) -> None:
    samples = tuple((float(i), v) for i, v in enumerate(values))
    tol = 256 * MiB
    start_t, rise = steady_suffix(samples, tol)
    start = int(start_t)
    assert max_rise(samples[start:]) == rise <= tol
    if start > 0:
        assert max_rise(samples[start - 1 :]) > tol


def test_describe_says_what_is_awaited() -> None:
    engines = describe(SettleVerdict(False, 3, 0.0, 0, 20 * GiB), PARAMS)
    assert engines == "3 engine processes left; MemAvailable 20.0 GiB"
    memory = describe(SettleVerdict(False, 0, 1.5, 2 * GiB, 20 * GiB), PARAMS)
    assert "rose 2.0 GiB" in memory and "steady 1.5/5 s" in memory
    assert describe(SettleVerdict(True, 0, 5.0, 0, GiB), PARAMS).startswith("settled")


def test_the_processes_left_are_named_safely_and_the_rest_counted() -> None:
    from sparkwatch.core.launch.settle import SettleParams, SettleVerdict, describe, name_processes
    from sparkwatch.core.model import Proc

    def proc(pid: int, title: str) -> Proc:
        return Proc(pid=pid, ppid=1, uid=0, comm=title[:15], state="S", start_ticks=1, rss_bytes=0, argv=(title,))

    procs = [proc(10, "VLLM::EngineCore"), proc(11, "VLLM::Worker\x1b[2J_TP0"), proc(12, "VLLM::Worker_TP1")]
    assert name_processes(procs) == "pid 10 VLLM::EngineCore, pid 11 VLLM::Worker?[2J_TP0, pid 12 VLLM::Worker_TP1"
    more = [*procs, proc(13, "VLLM::Worker_TP2"), proc(14, "VLLM::Worker_TP3")]
    assert name_processes(more).endswith("pid 12 VLLM::Worker_TP1 and 2 more")
    one = describe(SettleVerdict(False, 1, 0.0, 0, 1 << 30), SettleParams(), procs[:1])
    assert one == "1 engine process left; MemAvailable 1.0 GiB; pid 10 VLLM::EngineCore"
