"""core.kill.budget and core.kill.footprint: the budget decision and the footprint counted once, for any sequence of
samples."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkwatch.core.kill.budget import BudgetParams, BudgetState, budget_step, limit_bytes, memory_high_bytes
from sparkwatch.core.kill.footprint import FootprintInputs, FootprintSource, footprint
from sparkwatch.core.kill.policy import GPU_STALE_S, parse_engine_budgets, parse_kill_priority
from sparkwatch.core.units import GiB, MiB

P = BudgetParams()


def run(samples: list[int], budget: int, dt: float = 0.1) -> list[bool]:
    state = BudgetState()
    out = []
    for i, value in enumerate(samples):
        state, d = budget_step(state, P, i * dt, value, budget)
        out.append(d.kill)
    return out


def test_the_margin_is_two_percent_or_256_mib() -> None:
    assert limit_bytes(1 * GiB, P) == 1 * GiB + 256 * MiB
    assert limit_bytes(100 * GiB, P) == 102 * GiB


def test_launchs_memory_high_sits_one_margin_above_the_kill_limit() -> None:
    """The scope's throttle must never hold a runaway under the guard's kill limit (then it is slowed, never killed)."""
    assert memory_high_bytes(1 * GiB) == 1 * GiB + 512 * MiB
    assert memory_high_bytes(100 * GiB) == 104 * GiB
    for budget in (1, 7 * MiB, 3 * GiB, 60 * GiB):
        assert memory_high_bytes(budget) > limit_bytes(budget, BudgetParams()) > budget


def test_over_the_limit_for_the_debounce_kills_once_a_single_spike_does_not() -> None:
    budget = 10 * GiB
    over = limit_bytes(budget, P) + 1
    assert run([5 * GiB, over, 5 * GiB, over, 5 * GiB], budget) == [False] * 5  # one noisy sample never kills
    assert run([5 * GiB, over, over], budget) == [False, False, True]


def test_warns_once_near_the_budget_and_again_only_after_falling_back() -> None:
    budget = 10 * GiB
    state = BudgetState()
    warns = []
    for i, value in enumerate([8 * GiB, 9 * GiB, 9.5 * GiB, 9.2 * GiB, 7 * GiB, 9.1 * GiB]):
        state, d = budget_step(state, P, float(i), int(value), budget)
        warns.append(d.warn)
    assert warns == [False, True, False, False, False, True]


def test_the_interval_follows_the_distance_to_the_budget() -> None:
    far = budget_step(BudgetState(), P, 0.0, 1 * GiB, 100 * GiB)[1].next_interval_s
    near = budget_step(BudgetState(), P, 0.0, 99 * GiB, 100 * GiB)[1].next_interval_s
    assert far == P.poll_max_s and near < far
    # a fast-growing tree is looked at sooner than a steady one at the same distance
    state = budget_step(BudgetState(), P, 0.0, 90 * GiB, 100 * GiB)[0]
    _state, grown = budget_step(state, P, 0.1, 95 * GiB, 100 * GiB)  # 50 GiB/s
    assert grown.next_interval_s < budget_step(BudgetState(), P, 0.0, 95 * GiB, 100 * GiB)[1].next_interval_s


@settings(max_examples=300, deadline=None)
@given(
    budget=st.integers(1 * MiB, 200 * GiB),
    samples=st.lists(st.integers(0, 400 * GiB), min_size=1, max_size=30),
    dts=st.lists(st.floats(0.001, 2.0), min_size=30, max_size=30),
)
def test_never_kills_under_the_limit_and_always_kills_a_sustained_overrun(
    budget: int, samples: list[int], dts: list[float]
) -> None:
    state = BudgetState()
    t = 0.0
    limit = limit_bytes(budget, P)
    streak = 0
    for value, dt in zip(samples, dts, strict=False):
        t += dt
        state, d = budget_step(state, P, t, value, budget)
        streak = streak + 1 if value > limit else 0
        if value <= limit:
            assert not d.kill
        assert d.kill == (streak >= P.debounce_samples)
        if d.kill:
            streak = 0
        assert P.poll_min_s <= d.next_interval_s <= P.poll_max_s
        assert state.peak_bytes >= value


def test_footprint_counts_each_byte_once() -> None:
    # the cgroup's memory.current covers RSS (and page cache): the larger of the two, never their sum
    fp = footprint(FootprintInputs(rss_bytes=2 * GiB, cgroup_bytes=3 * GiB, gpu_bytes=40 * GiB, gpu_age_s=1.0))
    assert (fp.bytes, fp.source) == (43 * GiB, FootprintSource.CGROUP_GPU)
    fp = footprint(FootprintInputs(rss_bytes=2 * GiB, cgroup_bytes=1 * GiB))
    assert (fp.bytes, fp.source) == (2 * GiB, FootprintSource.RSS)
    # a stale GPU hint counts as none
    fp = footprint(FootprintInputs(rss_bytes=2 * GiB, gpu_bytes=40 * GiB, gpu_age_s=GPU_STALE_S + 1))
    assert (fp.bytes, fp.gpu_bytes) == (2 * GiB, None)
    # the pool's drop since launch holds everything else on the box: never the footprint, only a warning's figure
    fp = footprint(FootprintInputs(rss_bytes=2 * GiB, pool_drop_bytes=60 * GiB))
    assert (fp.bytes, fp.source) == (2 * GiB, FootprintSource.RSS)
    assert (fp.warn_bytes, fp.warn_source) == (60 * GiB, FootprintSource.POOL_DROP)
    fp = footprint(FootprintInputs(rss_bytes=2 * GiB, gpu_bytes=70 * GiB, gpu_age_s=0.5, pool_drop_bytes=60 * GiB))
    assert fp.source == FootprintSource.RSS_GPU and fp.bytes == 72 * GiB
    assert (fp.pool_drop_bytes, fp.warn_bytes, fp.warn_source) == (None, 72 * GiB, FootprintSource.RSS_GPU)


def test_the_pools_drop_warns_and_never_kills() -> None:
    state = BudgetState()
    for i in range(10):  # a tree holding 200 MiB while the pool fell by 1.3 GiB against a 1 GiB budget
        state, d = budget_step(state, P, float(i), 200 * MiB, 1 * GiB, warn_bytes=1300 * MiB)
        assert not d.kill
        assert d.warn == (i == 0)
    assert state.peak_bytes == 200 * MiB


def test_budget_patterns_share_kill_prioritys_syntax() -> None:
    ((size, pattern),) = parse_engine_budgets(["40GiB=--served-model-name chat"])
    assert size == 40 * GiB and pattern.pattern == "--served-model-name chat"
    for bad in ("40GiB", "lots=x", "0=x", "1GiB=("):
        try:
            parse_engine_budgets([bad])
        except ValueError as exc:
            assert repr(bad) in str(exc)
        else:
            raise AssertionError(bad)
    assert parse_kill_priority(["-10=prod"])[0][0] == -10


def test_only_launchs_own_scope_with_the_root_in_it_counts() -> None:
    from sparkwatch.core.kill.footprint import owned_scope

    scope = "/user.slice/user-1000.slice/user@1000.service/app.slice/sparkwatch-launch-4242.scope"
    assert owned_scope(scope, scope) == scope
    assert owned_scope("/user.slice", "/user.slice") is None  # a declaration cannot name a larger group
    assert owned_scope("/other.scope", scope) is None  # the root is not in the declared scope
    assert owned_scope(scope, None) is None
