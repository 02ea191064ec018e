"""What a running engine reserves in the next launch's plan (core.launch.plan.reserve, issue 37): only a tree still
booting, at most its own plan's estimate less what it holds; never the raw budget, never an idle process's.

The cases with real processes and another user's declarations are in tests/test_declaration_trust.py."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from sparkwatch.core.engines.enginecli import recognise
from sparkwatch.core.launch.plan import BOOT_MAX_S, FixAction, MemoryView, Reservation, decide, estimate, reserve
from sparkwatch.core.units import GiB, MiB, TiB
from tests.test_launch_plan import QWEN3_8B, view

NOBODY = 65534


def booting(**kw: object) -> Reservation:
    """Another user's engine tree, 60 s into loading its weights: estimate 30 GiB, 12 GiB held, budget 100 TiB."""
    base = Reservation("vllm", 4242, "vllm big", footprint_bytes=12 * GiB, budget_bytes=100 * TiB, booting=True,
                       estimate_bytes=30 * GiB, phase="loading_weights", age_s=60.0, engine=True,
                       other_uid=NOBODY)  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]  # the test's own field values


def plan_with(*running: Reservation, available: int = 40 * GiB) -> tuple[MemoryView, int]:
    v = view(available=available)
    plan = decide(estimate(recognise(["llama-server", "-m", "x.gguf", "-c", "4096"]), QWEN3_8B, v), v, running)
    return v, plan.available_bytes


def test_a_booting_engine_reserves_its_plans_estimate_less_what_it_holds_never_its_budget() -> None:
    """Old main reserved budget − the declared peak: 100 TiB − 0 for this one."""
    r = booting()
    assert reserve(r)[0] == 18 * GiB
    why = reserve(r)[1]
    assert why.startswith("booting (loading_weights, 60 s of at most 1800 s): its plan's estimate 30.0 GiB")
    assert why.endswith("less the 12.0 GiB its tree holds"), why
    v, room = plan_with(r)
    assert room == v.available_bytes - v.floor_bytes - v.margin_bytes - 18 * GiB


def test_a_budget_under_the_estimate_bounds_it_and_a_tree_past_its_estimate_reserves_nothing() -> None:
    assert reserve(booting(budget_bytes=20 * GiB)) == (
        8 * GiB,
        "booting (loading_weights, 60 s of at most 1800 s): its budget (under its plan's estimate) 20.0 GiB less "
        "the 12.0 GiB its tree holds",
    )
    assert reserve(booting(footprint_bytes=31 * GiB))[0] == 0
    assert reserve(booting(budget_bytes=None))[0] == 18 * GiB


def test_an_idle_declared_process_reserves_nothing() -> None:
    """Another user's `sleep` declared with 100 TiB (budget and estimate): old main's plans all refused."""
    idle = booting(footprint_bytes=2 * MiB, estimate_bytes=100 * TiB, engine=False)
    assert reserve(idle) == (0, "its tree is no engine")
    _v, room = plan_with(idle)
    _v, free = plan_with()
    assert room == free
    seven = [replace(idle, root_pid=5000 + i, budget_bytes=GiB, estimate_bytes=GiB) for i in range(7)]
    assert plan_with(*seven)[1] == free  # old main: 7 GiB less


def test_a_ready_or_overdue_engine_reserves_nothing() -> None:
    assert reserve(booting(booting=False, phase="ready")) == (0, "ready: what it holds is already out of MemAvailable")
    assert reserve(booting(age_s=BOOT_MAX_S - 1))[0] == 18 * GiB
    late = reserve(booting(age_s=BOOT_MAX_S))
    assert late == (0, "said to boot, but 1800 s old: past the 1800 s a boot may take")
    assert reserve(booting(age_s=None)) == (0, "said to boot, but of unknown age: past the 1800 s a boot may take")


def test_without_an_estimate_the_budget_reserves_nothing() -> None:
    """A declaration without the plan's estimate (a hand-made one, or an old launch's) has no plan to hold to."""
    assert reserve(booting(estimate_bytes=None)) == (0, "no plan's estimate declared")
    undeclared = Reservation("vllm", 77, "vllm other", footprint_bytes=50 * GiB)
    assert reserve(undeclared) == (0, "not declared")


def test_the_planning_users_own_launch_needs_no_engine_rule() -> None:
    """An engine the rules do not name (`launch --budget 20GiB -- python serve.py`) is its owner's to plan around
    while its launch runs it; an idle process declared by hand is not, even the planner's own."""
    own = booting(engine=False, other_uid=None, estimate_bytes=20 * GiB, budget_bytes=20 * GiB, footprint_bytes=GiB,
                  launched=True)  # fmt: skip
    assert reserve(own)[0] == 19 * GiB
    assert reserve(replace(own, other_uid=NOBODY))[0] == 0
    assert reserve(replace(own, launched=False)) == (0, "its tree is no engine")


def test_the_fix_still_names_a_booting_engine_to_wait_for() -> None:
    r = booting(footprint_bytes=10 * GiB, estimate_bytes=40 * GiB)
    v = view(available=40 * GiB)
    plan = decide(estimate(recognise(["llama-server", "-m", "x.gguf", "-c", "4096"]), QWEN3_8B, v), v, [r])
    assert not plan.fits
    assert any(f.action == FixAction.WAIT and "pid 4242" in f.text and "finish booting" in f.text for f in plan.fixes)


@settings(max_examples=500, deadline=None)
@given(
    footprint=st.integers(0, 200 * GiB),
    estimate_bytes=st.none() | st.integers(0, 2 * TiB),
    budget=st.none() | st.integers(0, 200 * TiB),
    is_booting=st.booleans(),
    age_s=st.none() | st.floats(0, 10 * BOOT_MAX_S),
    engine=st.booleans(),
    other_uid=st.none() | st.just(NOBODY),
    launched=st.booleans(),
)
def test_a_reservation_never_exceeds_the_estimate_less_what_is_held(
    *,
    footprint: int,
    estimate_bytes: int | None,
    budget: int | None,
    is_booting: bool,
    age_s: float | None,
    engine: bool,
    other_uid: int | None,
    launched: bool,
) -> None:
    r = Reservation(
        "vllm", 1, "x", footprint, budget, is_booting, estimate_bytes, "profiling", age_s, engine, other_uid, launched
    )
    got = reserve(r)[0]
    assert got >= 0
    if got:
        assert estimate_bytes is not None and got <= estimate_bytes - footprint
        assert budget is None or got <= budget - footprint
        assert is_booting and age_s is not None and age_s < BOOT_MAX_S
        assert engine or (other_uid is None and launched)
