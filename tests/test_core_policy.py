"""The kill policy's pure decisions: the victim ranking, the escalation state machine, the kill-loop alert."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sparkwatch.core.kill import policy
from sparkwatch.core.kill import trigger as g
from sparkwatch.core.kill.killloop import LOOP_KILLS, LOOP_WINDOW_S, LoopState, note_kill
from sparkwatch.core.kill.triggers import Trigger
from sparkwatch.core.model import EngineTree, Proc
from sparkwatch.core.units import GiB, MiB
from tests.helpers.configs import guard_config_with, trigger_keys


def proc(pid: int, title: str, rss_mib: int, start: int, argv: tuple[str, ...] = ()) -> Proc:
    return Proc(
        pid=pid,
        ppid=1,
        uid=1000,
        comm=title[:15],
        state="S",
        start_ticks=start,
        rss_bytes=rss_mib * MiB,
        argv=(title, *argv),
    )


def tree(pid: int, title: str, rss_mib: int, start: int, *, kind: str = "vllm") -> EngineTree:
    root = proc(pid, title, rss_mib, start)
    return EngineTree(kind=kind, root=root, members=(root,))


def history_of(
    *series: tuple[int, str, list[int], int], step_s: float = 1.0
) -> tuple[list[EngineTree], policy.GrowthHistory]:
    """(pid, title, RSS MiB per scan, start ticks) -> the trees of the last scan and the history of all scans."""
    history = policy.GrowthHistory()
    trees: list[EngineTree] = []
    n = max(len(s[2]) for s in series)
    for i in range(n):
        trees = [tree(pid, title, rss[min(i, len(rss) - 1)], start) for pid, title, rss, start in series]
        history = policy.observe(history, i * step_s, trees, None)
    return trees, history


P = policy.PolicyParams()


def test_the_growing_young_engine_dies_first_the_steady_old_one_last() -> None:
    trees, history = history_of(
        (100, "VLLM::EngineCore", [40_000] * 5, 1_000),  # serving for an hour, steady
        (200, "VLLM::EngineCore", [1_000, 3_000, 5_000, 7_000, 9_000], 900_000),  # a new one, spiking
    )
    ranking = policy.rank(trees, history, 4.0, None, P)
    assert [c.tree.root.pid for c in ranking] == [200, 100]
    assert ranking[0].growing and not ranking[1].growing
    assert "grew 7.8 GiB in 4.0 s" in ranking[0].reasons
    assert any(r.startswith("steady") for r in ranking[1].reasons)
    # During a teardown only a growing tree may die; the steady one is never chosen alongside it.
    assert policy.choose(ranking, growing_only=True, exclude={ranking[0].key}) is None


def test_gpu_bytes_count_where_given_and_stale_ones_are_ignored() -> None:
    # Two trees with flat RSS; one grows on the GPU only (a GB10 engine: RSS misses its GPU share).
    a = tree(100, "VLLM::EngineCore", 1_800, 1_000)
    b = tree(200, "VLLM::EngineCore", 1_800, 2_000)
    history = policy.GrowthHistory()
    for i in range(4):
        gpu = (float(i), {100: i * 10 * GiB, 200: 5 * GiB})
        history = policy.observe(history, float(i), [a, b], gpu)
    ranking = policy.rank([a, b], history, 3.0, (3.0, {100: 30 * GiB, 200: 5 * GiB}), P)
    assert ranking[0].tree.root.pid == 100 and ranking[0].growing
    assert ranking[0].gpu_bytes == 30 * GiB
    # Without GPU figures (telemetry down) the ranking still answers at once: youngest first.
    plain = policy.observe(policy.observe(policy.GrowthHistory(), 0.0, [a, b], None), 3.0, [a, b], None)
    stale = (3.0 - policy.GPU_STALE_S - 1, {100: 30 * GiB})
    ranking = policy.rank([a, b], plain, 3.0, stale, P)
    assert [c.tree.root.pid for c in ranking] == [200, 100]
    assert all(c.gpu_bytes is None for c in ranking)


def test_idle_ray_workers_come_after_everything_and_never_kill_is_never_chosen() -> None:
    trees, history = history_of(
        (100, "ray::IDLE", [300] * 3, 9_000_000),
        (200, "ray::RayWorkerWrapper.execute_method", [2_000] * 3, 500),
        (300, "llama-server", [4_000] * 3, 100),
    )
    params = policy.PolicyParams.build(never_kill=["llama-server"])
    ranking = policy.rank(trees, history, 2.0, None, params)
    assert [c.tree.root.pid for c in ranking] == [200, 100, 300]
    assert ranking[-1].never_kill == "llama-server"
    chosen = [policy.choose(ranking, exclude=excl) for excl in ((), {ranking[0].key}, {ranking[0].key, ranking[1].key})]
    assert [c.tree.root.pid if c else None for c in chosen] == [200, 100, None]


def test_kill_priority_and_kill_order_are_the_owners() -> None:
    trees, history = history_of(
        (
            100,
            "VLLM::EngineCore",
            [1_000, 2_000, 3_000],
            1_000,
        ),
        (200, "llama-server", [500] * 3, 5_000),
    )
    ranking = policy.rank(trees, history, 2.0, None, P)
    assert [c.tree.root.pid for c in ranking] == [100, 200]  # growth before youth
    params = policy.PolicyParams.build(kill_priority=["5=llama-server"])
    ranking = policy.rank(trees, history, 2.0, None, params)
    assert [c.tree.root.pid for c in ranking] == [200, 100]
    assert "kill_priority +5" in ranking[0].reasons
    params = policy.PolicyParams.build(kill_order=["youngest"])
    assert [c.tree.root.pid for c in policy.rank(trees, history, 2.0, None, params)] == [200, 100]


@pytest.mark.parametrize(
    ("call", "bad"),
    [
        (lambda: policy.parse_kill_order(["growth", "oldest"]), "'oldest' is not one of"),
        (lambda: policy.parse_kill_order([]), "at least one"),
        (lambda: policy.parse_kill_order(["growth", "growth"]), "twice"),
        (lambda: policy.parse_kill_priority(["high=vllm"]), "priority=regex"),
        (lambda: policy.parse_kill_priority(["3=("]), "not a valid regex"),
        (lambda: policy.compile_never_kill(["("]), "not a valid regex"),
    ],
)
def test_bad_policy_settings_say_what_is_wrong(call: object, bad: str) -> None:
    with pytest.raises(ValueError, match=bad):
        call()  # type: ignore[operator]


@given(
    st.lists(
        st.tuples(
            st.integers(1, 5000), st.lists(st.integers(0, 20_000), min_size=1, max_size=8), st.integers(0, 10**7)
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda x: x[0],
    )
)
def test_ranking_is_a_permutation_and_history_stays_bounded(spec: list[tuple[int, list[int], int]]) -> None:
    series = [(pid, "VLLM::EngineCore", rss, start) for pid, rss, start in spec]
    trees, history = history_of(*series, step_s=0.5)
    ranking = policy.rank(trees, history, 10.0, None, P)
    assert sorted(c.tree.root.pid for c in ranking) == sorted(t.root.pid for t in trees)
    assert all(len(s) <= policy.HISTORY_SAMPLES for s in history.trees.values())
    growing = [c for c in ranking if c.growing]
    assert ranking[: len(growing)] == tuple(growing)  # every growing tree before every steady one


def test_kill_loop_alerts_once_per_loop() -> None:
    state = LoopState()
    alerts = []
    for i in range(10):
        state, count = note_kill(state, i * 20.0, "vllm|VLLM::EngineCore|x")
        alerts.append(count)
    assert alerts.count(None) == 9 and alerts[LOOP_KILLS - 1] == LOOP_KILLS
    state, count = note_kill(state, 200.0, "llama.cpp|llama-server|y")  # another engine: its own count
    assert count is None
    later = 180.0 + LOOP_WINDOW_S + 1  # quiet for a whole window: a new loop may alert again
    for i in range(LOOP_KILLS):
        state, count = note_kill(state, later + i, "vllm|VLLM::EngineCore|x")
    assert count == LOOP_KILLS


PARAMS = guard_config_with(floor="8GiB")
K = trigger_keys(PARAMS)
DT = st.sampled_from([0.05, 0.1, 0.25, 0.5])
# Under the floor continuously, the guard looks for a victim at least this often (after its first firing): a settle
# time, a look interval, and the debounce samples at the slowest poll.
MAX_GAP_S = PARAMS.kill_settle_s + g.LOOK_EVERY_S + (PARAMS.debounce_samples + 1) * 0.5


class GuardMachine(RuleBasedStateMachine):
    """Random samples, random firing outcomes and reaps: every firing is justified, and the guard never goes blind."""

    def __init__(self) -> None:
        super().__init__()
        self.state = g.GuardState()
        self.t = 0.0
        self.recent: list[int] = []
        self.last_look: float | None = None
        self.under_since: float | None = None

    @rule(dt=DT, available=st.integers(0, 40 * GiB), outcome=st.sampled_from(list(g.Outcome)))
    def sample(self, dt: float, available: int, outcome: g.Outcome) -> None:
        self.t += dt
        before = self.state
        self.state, d = g.step(self.state, self.t, available, **K)
        self.recent = [*self.recent, available][-PARAMS.debounce_samples :]
        under = available <= PARAMS.floor
        self.under_since = (self.under_since if self.under_since is not None else self.t) if under else None
        if d.trigger is None:
            if under and self.last_look is not None and self.under_since is not None:
                assert self.t - max(self.last_look, self.under_since) <= MAX_GAP_S, "blind under the floor"
            return
        self.last_look = self.t
        if d.trigger in ("escalate", "hunt"):
            assert under, "a kill after the first one is only made at or under the floor"
        if d.trigger == "floor":
            assert all(a <= PARAMS.floor for a in self.recent)
        if d.growing_only:
            assert before.phase == g.Phase.TEARDOWN
        if outcome == g.Outcome.CANCELLED and under:
            outcome = g.Outcome.KILLED  # should_cancel never cancels under the floor
        self.state = g.fired(self.state, self.t, outcome, g.teardown_deadline_s(10 * GiB))

    @precondition(lambda self: self.state.phase == g.Phase.TEARDOWN)
    @rule()
    def reap(self) -> None:
        self.state = g.reaped(self.state, self.t, kill_settle_s=PARAMS.kill_settle_s)
        assert self.state.phase == g.Phase.SETTLE

    @invariant()
    def phase_deadlines_are_bounded(self) -> None:
        if self.state.phase in (g.Phase.TEARDOWN, g.Phase.SETTLE):
            assert self.state.phase_until is not None
            assert self.state.phase_until - self.t <= g.TEARDOWN_MAX_S + PARAMS.kill_settle_s
        assert self.state.armed == (not self.state.in_episode)


GuardMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=80, deadline=None)
TestGuardMachine = GuardMachine.TestCase


def test_should_cancel_rereads_like_earlyoom() -> None:
    cancel: dict[str, Any] = {"floor": 8 * GiB, "kill_budget_s": 0.25}
    rate = 400.0 * MiB  # the smoothed fill rate the decision used
    assert not g.should_cancel(Trigger.FLOOR, 7 * GiB, 7 * GiB, rate, **cancel)
    assert g.should_cancel(Trigger.FLOOR, 7 * GiB, 9 * GiB, rate, **cancel)
    assert not g.should_cancel(Trigger.DRIVER_ALLOC_FAILED, 20 * GiB, 30 * GiB, rate, **cancel)
    # a budget is the engine's own limit, not the pool's
    assert not g.should_cancel(Trigger.BUDGET, 20 * GiB, 30 * GiB, rate, **cancel)
    decided = 8 * GiB + 80 * MiB  # 0.2 s from the floor at 400 MiB/s: a prediction
    assert not g.should_cancel(Trigger.PREDICTED, decided, decided - 50 * MiB, rate, **cancel)  # still falling
    assert not g.should_cancel(Trigger.PREDICTED, decided, decided, rate, **cancel)  # a pause in a bursty fill
    # 0.45 s away: not back yet
    assert not g.should_cancel(Trigger.PREDICTED, decided, decided + 100 * MiB, rate, **cancel)
    assert g.should_cancel(Trigger.PREDICTED, decided, decided + 150 * MiB, rate, **cancel)  # 0.575 s away: came back


@given(
    decided_over_floor=st.integers(1, 4 * 1024),
    rise=st.integers(-1024, 8 * 1024),
    more=st.integers(1, 8 * 1024),
    rate_mib_s=st.floats(1.0, 20_000.0),
)
def test_a_prediction_is_cancelled_only_by_memory_coming_back(
    decided_over_floor: int, rise: int, more: int, rate_mib_s: float
) -> None:
    params = PARAMS  # kill budget 0.25 s
    assume(decided_over_floor <= rate_mib_s * params.kill_budget_s)  # a prediction: the floor within one budget
    decided = params.floor + decided_over_floor * MiB
    now = decided + rise * MiB

    def cancel(available_now: int) -> bool:
        return g.should_cancel(
            Trigger.PREDICTED,
            decided,
            available_now,
            rate_mib_s * MiB,
            floor=params.floor,
            kill_budget_s=params.kill_budget_s,
        )

    if rise <= 0:
        assert not cancel(now)  # still falling, or paused: the kill goes ahead
    if cancel(now):
        assert cancel(now + more * MiB)  # more memory back never un-cancels it
    if now - params.floor > rate_mib_s * MiB:  # a whole second of fill away from the floor: clearly back
        assert cancel(now)


def test_teardown_deadline_follows_the_measured_release_rate() -> None:
    assert g.teardown_deadline_s(0) == g.TEARDOWN_BASE_S
    # 77 GiB on a GB10 at 7.8 GiB/s is ~10 s; the deadline leaves twice that, within the cap.
    assert 19 < g.teardown_deadline_s(77 * GiB) <= g.TEARDOWN_MAX_S
    assert g.teardown_deadline_s(10_000 * GiB) == g.TEARDOWN_MAX_S


def test_a_firing_with_no_victim_keeps_looking_while_under_the_floor() -> None:
    state = g.GuardState()
    t = 0.0
    looks = []
    for _ in range(40):  # 2 s under the floor, no engine
        t += 0.05
        state, d = g.step(state, t, 4 * GiB, **K)
        if d.trigger:
            looks.append((t, d.trigger))
            state = g.fired(state, t, g.Outcome.NONE)
    assert looks[0][1] == "floor" and {k for _, k in looks[1:]} == {"hunt"}
    assert len(looks) >= 6  # every LOOK_EVERY_S: an engine that starts now is found within a quarter second
    assert state.in_episode


def test_a_tree_of_zombies_is_no_candidate() -> None:
    live = tree(100, "VLLM::EngineCore", 500, 1_000)
    dead_root = Proc(
        pid=200, ppid=1, uid=1000, comm="VLLM::EngineCor", state="Z", start_ticks=9_000, rss_bytes=0, argv=()
    )
    dead = EngineTree(kind="vllm", root=dead_root, members=(dead_root,))
    ranking = policy.rank([dead, live], policy.GrowthHistory(), 0.0, None, P)
    assert [c.tree.root.pid for c in ranking] == [100]
