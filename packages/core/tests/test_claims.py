"""Properties of the claim rule: pauses, running limits, start rates, per-key limits and
claim order."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta

import attrs
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.claims import (
    ClaimPlan,
    ClaimPosition,
    ClaimWalk,
    KeyState,
    ScopeLimits,
    ScopeState,
    frees_at,
    plan_claim,
    record_starts,
    room,
    starts_in_window,
)

NOW = datetime(2030, 1, 1, tzinfo=UTC)
S = timedelta(seconds=1)
QUEUES = ["q1", "q2", "q3"]
NAMES = ["a", "b", "c"]


@attrs.frozen
class Cand:
    id: int
    queue: str
    task_name: str
    limit_key: str | None = None


Case = tuple[list[tuple[str, int]], list[Cand], dict[str, ScopeState], dict[str, ScopeState]]

limits_st = st.builds(
    ScopeLimits,
    paused=st.booleans(),
    max_running=st.none() | st.integers(0, 4),
    rate_limit=st.none() | st.integers(0, 4),
    rate_period=st.just(timedelta(seconds=60)),
).map(lambda lim: attrs.evolve(lim, rate_period=None) if lim.rate_limit is None else lim)
starts_st = st.lists(st.integers(0, 120).map(lambda s: NOW - timedelta(seconds=s)), max_size=6)
scope_st = st.builds(
    ScopeState, limits=limits_st, running=st.integers(0, 5), starts=starts_st.map(tuple)
)


@st.composite
def claims(draw: st.DrawFn) -> Case:
    queues = draw(st.lists(st.sampled_from(QUEUES), unique=True, min_size=1))
    wants = [(q, draw(st.integers(1, 6))) for q in queues]
    pairs = draw(st.lists(st.tuples(st.sampled_from(QUEUES), st.sampled_from(NAMES))))
    candidates = [Cand(i, q, n) for i, (q, n) in enumerate(pairs)]
    queue_scopes = draw(st.dictionaries(st.sampled_from(QUEUES), scope_st))
    name_scopes = draw(st.dictionaries(st.sampled_from(NAMES), scope_st))
    return wants, candidates, queue_scopes, name_scopes


def _plan(case: Case) -> ClaimPlan[Cand]:
    wants, candidates, queues, names = case
    return plan_claim(wants, candidates, queues=queues, names=names, now=NOW)


def _cap(scope: ScopeState) -> int | None:
    left = room(scope, NOW)
    return None if left is None else max(0, left)


@given(claims())
def test_a_claim_starts_only_candidates_of_the_queues_asked_each_once(case: Case) -> None:
    wants, candidates, _, _ = case
    plan = _plan(case)
    assert len(set(plan.started)) == len(plan.started)
    assert set(plan.started) <= set(candidates)
    asked = dict(wants)
    for queue, count in Counter(c.queue for c in plan.started).items():
        assert count <= asked[queue]


@given(claims())
def test_no_limit_is_passed_and_nothing_comes_from_a_paused_queue(case: Case) -> None:
    _, _, queues, names = case
    plan = _plan(case)
    by_queue = Counter(c.queue for c in plan.started)
    by_name = Counter(c.task_name for c in plan.started)
    for queue, scope in queues.items():
        if scope.limits.paused:
            assert by_queue[queue] == 0
        cap = _cap(scope)
        if cap is not None:
            assert by_queue[queue] <= cap
    for name, scope in names.items():
        cap = _cap(scope)
        if cap is not None:
            assert by_name[name] <= cap


@given(claims())
def test_each_name_in_a_queue_starts_its_first_candidates_in_order(case: Case) -> None:
    _, candidates, _, _ = case
    plan = _plan(case)
    for queue in QUEUES:
        for name in NAMES:
            group = [c for c in candidates if c.queue == queue and c.task_name == name]
            chosen = [c for c in plan.started if c.queue == queue and c.task_name == name]
            assert chosen == group[: len(chosen)]


@given(claims())
def test_without_holding_back_a_queue_gives_all_it_can(case: Case) -> None:
    wants, candidates, queues, _ = case
    plan = _plan(case)
    if plan.held:
        return
    by_queue = Counter(c.queue for c in plan.started)
    for queue, want in wants:
        if queue in queues and queues[queue].limits.paused:
            continue
        assert by_queue[queue] == min(want, sum(c.queue == queue for c in candidates))


@given(claims())
def test_a_held_claim_had_a_limit_that_bound(case: Case) -> None:
    _, _, queues, names = case
    plan = _plan(case)
    if plan.held:
        assert any(s.limits.limited for s in [*queues.values(), *names.values()])
    if plan.frees_at is not None:
        assert plan.frees_at > NOW


@given(claims())
def test_without_settings_a_claim_takes_each_queues_first_candidates(case: Case) -> None:
    wants, candidates, _, _ = case
    plan = plan_claim(wants, candidates, queues={}, names={}, now=NOW)
    expected = [c for q, want in wants for c in [c for c in candidates if c.queue == q][:want]]
    assert plan == ClaimPlan(tuple(expected), held=False, frees_at=None)


@given(claims(), st.integers(1, 10))
def test_a_total_caps_the_claim_and_keeps_its_prefix(case: Case, total: int) -> None:
    wants, candidates, queues, names = case
    capped = plan_claim(wants, candidates, queues=queues, names=names, now=NOW, total=total)
    assert len(capped.started) <= total


def test_a_start_a_period_old_has_left_the_window() -> None:
    period = timedelta(seconds=60)
    starts = [NOW - period, NOW - period + timedelta(microseconds=1)]
    assert starts_in_window(starts, period, NOW) == (starts[1],)
    scope = ScopeState(ScopeLimits(rate_limit=1, rate_period=period), 0, tuple(starts))
    assert room(scope, NOW) == 0
    assert frees_at(scope, NOW) == starts[1] + period
    assert record_starts(starts, period, NOW, 2) == (starts[1], NOW, NOW)


def test_the_tighter_limit_and_this_claims_starts_count() -> None:
    period = timedelta(seconds=60)
    scope = ScopeState(ScopeLimits(max_running=5, rate_limit=3, rate_period=period), 1, (NOW,))
    assert room(scope, NOW) == 2
    assert room(scope, NOW, taken=2) == 0
    assert frees_at(ScopeState(ScopeLimits(max_running=5)), NOW) is None
    assert frees_at(ScopeState(ScopeLimits(rate_limit=1, rate_period=period)), NOW) == NOW + period


def test_limited_names_go_first_by_name_then_the_others_in_order() -> None:
    candidates = [Cand(1, "q", "z"), Cand(2, "q", "b"), Cand(3, "q", "a"), Cand(4, "q", "b")]
    names = {"b": ScopeState(ScopeLimits(max_running=1)), "a": ScopeState(ScopeLimits())}
    plan = plan_claim([("q", 3)], candidates, queues={}, names=names, now=NOW)
    assert [c.id for c in plan.started] == [2, 1, 3]
    assert plan.held is True


KEYS = ["k1", "k2", "k3"]

key_case_st = st.tuples(
    st.lists(
        st.builds(
            Cand,
            id=st.integers(),
            queue=st.just("q1"),
            task_name=st.sampled_from(NAMES),
            limit_key=st.none() | st.sampled_from(KEYS),
        ),
        max_size=15,
    ),
    st.integers(1, 2),  # max_running_per_key of q1
    st.dictionaries(st.sampled_from(KEYS), st.integers(0, 2)),  # what of each key runs
    st.integers(1, 15),  # want
)


@given(key_case_st)
def test_no_key_passes_its_limit_and_a_full_key_blocks_nothing_behind_it(
    case: tuple[list[Cand], int, dict[str, int], int],
) -> None:
    candidates, per_key, running, want = case
    queues = {"q1": ScopeState(ScopeLimits(max_running_per_key=per_key))}
    keys = {("queue", "q1", k): KeyState(running=n) for k, n in running.items()}
    plan = plan_claim([("q1", want)], candidates, queues=queues, names={}, now=NOW, keys=keys)
    started = Counter(c.limit_key for c in plan.started if c.limit_key is not None)
    for key, n in started.items():
        assert n + running.get(key, 0) <= per_key
    # Each candidate not started was skipped for its full key, or came after the claim
    # had taken all it wanted: nothing else is held behind a full key.
    taken = {id(c) for c in plan.started}
    if len(plan.started) < want:
        for c in candidates:
            if id(c) in taken:
                continue
            assert c.limit_key is not None
            assert started[c.limit_key] + running.get(c.limit_key, 0) >= per_key
            assert plan.held


def test_a_full_key_is_skipped_for_the_keys_behind_it() -> None:
    a1, a2, b1, free = (Cand(1, "q1", "a", "A"), Cand(2, "q1", "a", "A"),
                        Cand(3, "q1", "a", "B"), Cand(4, "q1", "a", None))  # fmt: skip
    queues = {"q1": ScopeState(ScopeLimits(max_running_per_key=1))}
    plan = plan_claim([("q1", 3)], [a1, a2, b1, free], queues=queues, names={}, now=NOW)
    assert plan.started == (a1, b1, free)
    assert plan.held
    # A running task of key A fills it: its first task waits too.
    plan = plan_claim(
        [("q1", 3)],
        [a1, a2, b1, free],
        queues=queues,
        names={},
        now=NOW,
        keys={("queue", "q1", "A"): KeyState(running=1)},
    )
    assert plan.started == (b1, free)


def test_a_task_names_key_rate_counts_its_window_and_says_when_it_frees() -> None:
    per = timedelta(minutes=1)
    names = {"a": ScopeState(ScopeLimits(rate_limit_per_key=2, rate_period_per_key=per))}
    cands = [Cand(i, "q1", "a", "A") for i in range(3)]
    old = NOW - timedelta(seconds=30)
    keys = {("task", "a", "A"): KeyState(starts=(old,))}
    plan = plan_claim([("q1", 3)], cands, queues={}, names=names, now=NOW, keys=keys)
    assert plan.started == (cands[0],)
    assert plan.held
    assert plan.frees_at == old + per


# --- where a claim walks from ---------------------------------------------------------------

_AT = datetime(2026, 1, 1, tzinfo=UTC)


def _place(priority: int, seconds: int, id_: int) -> ClaimPosition:
    return ClaimPosition(priority, _AT + timedelta(seconds=seconds), id_)


def test_a_walk_starts_at_the_front_without_a_position_and_every_interval() -> None:
    assert ClaimWalk().start(0.0, 1.0) is None
    walk = ClaimWalk().after(None, [_place(0, 1, 5), _place(0, 2, 3)], at=10.0)
    assert walk.position == _place(0, 2, 3)
    assert walk.start(10.5, 1.0) == _place(0, 2, 3)
    # A poll interval after the last walk from the front: from the front again, though
    # the walks from the position kept taking tasks.
    walk = walk.after(walk.start(10.5, 1.0), [_place(0, 3, 9)], at=10.5)
    assert walk.start(10.9, 1.0) == _place(0, 3, 9)
    assert walk.start(11.0, 1.0) is None
    assert walk.after(None, [], at=11.0).front_at == 11.0


def test_a_walk_from_the_position_that_found_nothing_is_followed_by_one_from_the_front() -> None:
    walk = ClaimWalk().after(None, [_place(0, 1, 1)], at=0.0)
    after = walk.after(walk.start(0.1, 1.0), [], at=0.1)
    assert after.owed
    assert after.start(0.2, 1.0) is None
    # The walk from the front clears the debt.
    assert not after.after(None, [], at=0.2).owed
    # Nothing taken because a limit held the claim back: no debt, the position stays.
    held = walk.after(walk.start(0.1, 1.0), [], at=0.1, held=True)
    assert not held.owed
    assert held.start(0.2, 1.0) == _place(0, 1, 1)


def test_the_position_is_the_last_task_taken_in_claim_order() -> None:
    taken = [_place(0, 5, 1), _place(2, 9, 7), _place(0, 5, 4), _place(0, 3, 9)]
    walk = ClaimWalk().after(None, taken, at=0.0)
    assert walk.position == _place(0, 5, 4)
    assert _place(2, 9, 7).precedes(_place(0, 0, 0))
    assert _place(0, 5, 1).precedes(_place(0, 5, 4))
    assert not _place(0, 5, 4).precedes(_place(0, 5, 4))


def test_a_claims_own_starts_and_the_running_tasks_both_use_up_room() -> None:
    now = datetime(2031, 1, 1, tzinfo=UTC)
    scope = ScopeState(ScopeLimits(max_running=5), running=2)
    assert room(scope, now, taken=1) == 2


def test_the_tighter_of_the_running_limit_and_the_rate_decides() -> None:
    now = datetime(2031, 1, 1, tzinfo=UTC)
    limits = ScopeLimits(max_running=1, rate_limit=10, rate_period=timedelta(minutes=1))
    assert room(ScopeState(limits), now) == 1
    limits = ScopeLimits(max_running=10, rate_limit=2, rate_period=timedelta(minutes=1))
    assert room(ScopeState(limits, starts=(now,)), now) == 1


def test_a_rate_limit_without_its_period_limits_nothing() -> None:
    now = datetime(2031, 1, 1, tzinfo=UTC)
    scope = ScopeState(ScopeLimits(rate_limit=3), starts=(now,))
    assert room(scope, now) is None
    assert frees_at(scope, now) is None


def test_once_the_total_is_reached_later_queues_are_not_asked() -> None:
    first, second = Cand(1, "q1", "a"), Cand(2, "q2", "a")
    # q2 is over its running limit and rate-limited: asking it would hold work back.
    crowded = ScopeState(
        ScopeLimits(max_running=1, rate_limit=1, rate_period=timedelta(minutes=1)), running=2
    )
    wants = [("q1", 1), ("q2", 1)]
    both = plan_claim(wants, [first, second], queues={}, names={}, now=NOW, total=2)
    assert both.started == (first, second)
    one = plan_claim(wants, [first, second], queues={"q2": crowded}, names={}, now=NOW, total=1)
    assert one == ClaimPlan((first,), held=False, frees_at=None)


def test_a_claim_held_by_queue_rates_frees_up_at_the_earliest_window_exit() -> None:
    minute = timedelta(minutes=1)
    soon = ScopeState(ScopeLimits(rate_limit=1, rate_period=minute), starts=(NOW - 50 * S,))
    later = ScopeState(ScopeLimits(rate_limit=1, rate_period=minute), starts=(NOW - 10 * S,))
    candidates = [Cand(1, "q1", "a"), Cand(2, "q2", "a")]
    plan = plan_claim(
        [("q1", 1), ("q2", 1)], candidates, queues={"q1": soon, "q2": later}, names={}, now=NOW
    )
    assert plan == ClaimPlan((), held=True, frees_at=NOW + 10 * S)


def test_task_names_are_asked_only_while_the_claim_wants_more() -> None:
    first, second = Cand(1, "q1", "a"), Cand(2, "q1", "b")
    roomy = ScopeState(ScopeLimits(max_running=5))
    full = ScopeState(
        ScopeLimits(rate_limit=1, rate_period=timedelta(minutes=1)), starts=(NOW - 10 * S,)
    )
    one = plan_claim(
        [("q1", 1)], [first, second], queues={}, names={"a": roomy, "b": full}, now=NOW
    )
    assert one == ClaimPlan((first,), held=False, frees_at=None)
    both = plan_claim(
        [("q1", 2)], [first, second], queues={}, names={"a": roomy, "b": roomy}, now=NOW
    )
    assert both.started == (first, second)


def test_a_task_names_limit_counts_what_the_claim_took_in_earlier_queues() -> None:
    first, second = Cand(1, "q1", "a"), Cand(2, "q2", "a")
    one_at_a_time = ScopeState(ScopeLimits(max_running=1))
    plan = plan_claim(
        [("q1", 1), ("q2", 1)], [first, second], queues={}, names={"a": one_at_a_time}, now=NOW
    )
    assert plan == ClaimPlan((first,), held=True, frees_at=None)


def test_each_task_name_gets_only_what_the_claim_still_wants() -> None:
    a, b1, b2, c1, c2 = (Cand(i, "q1", n) for i, n in enumerate("abbcc"))
    roomy = ScopeState(ScopeLimits(max_running=5))
    no_period = ScopeState(ScopeLimits(rate_limit=3))  # a rate without its period: no limit
    plan = plan_claim([("q1", 2)], [a, b1, b2], queues={}, names={"a": roomy, "b": roomy}, now=NOW)
    assert plan.started == (a, b1)
    plan = plan_claim(
        [("q1", 2)], [a, c1, c2], queues={}, names={"a": roomy, "c": no_period}, now=NOW
    )
    assert plan.started == (a, c1)


def test_a_claim_held_by_a_task_names_rate_frees_up_when_its_start_leaves_the_window() -> None:
    full = ScopeState(
        ScopeLimits(rate_limit=1, rate_period=timedelta(minutes=1)), starts=(NOW - 10 * S,)
    )
    plan = plan_claim([("q1", 1)], [Cand(1, "q1", "a")], queues={}, names={"a": full}, now=NOW)
    assert plan == ClaimPlan((), held=True, frees_at=NOW + 50 * S)


def test_limited_names_share_the_claim_with_unlimited_ones_without_holding_it() -> None:
    a, b, z = Cand(1, "q1", "a"), Cand(2, "q1", "b"), Cand(3, "q1", "z")
    roomy = ScopeState(ScopeLimits(max_running=5))
    plan = plan_claim([("q1", 2)], [a, b, z], queues={}, names={"a": roomy, "b": roomy}, now=NOW)
    assert plan == ClaimPlan((a, b), held=False, frees_at=None)


def test_a_full_task_name_does_not_stop_the_names_after_it() -> None:
    a, b = Cand(1, "q1", "a"), Cand(2, "q1", "b")
    full = ScopeState(ScopeLimits(max_running=1), running=1)
    roomy = ScopeState(ScopeLimits(max_running=5))
    plan = plan_claim([("q1", 2)], [a, b], queues={}, names={"a": full, "b": roomy}, now=NOW)
    assert plan.started == (b,)
    assert plan.held


def test_a_task_names_limit_adds_up_over_every_queue_of_the_claim() -> None:
    firsts = [Cand(i, q, "a") for i, q in enumerate(("q1", "q2", "q3"))]
    two = ScopeState(ScopeLimits(max_running=2))
    plan = plan_claim(
        [("q1", 1), ("q2", 1), ("q3", 1)], firsts, queues={}, names={"a": two}, now=NOW
    )
    assert plan.started == tuple(firsts[:2])


def test_a_claim_held_by_two_names_rates_frees_up_at_the_earlier_exit() -> None:
    minute = timedelta(minutes=1)
    soon = ScopeState(ScopeLimits(rate_limit=1, rate_period=minute), starts=(NOW - 50 * S,))
    later = ScopeState(ScopeLimits(rate_limit=1, rate_period=minute), starts=(NOW - 10 * S,))
    candidates = [Cand(1, "q1", "a"), Cand(2, "q1", "b")]
    plan = plan_claim([("q1", 2)], candidates, queues={}, names={"a": soon, "b": later}, now=NOW)
    assert plan == ClaimPlan((), held=True, frees_at=NOW + 10 * S)


def test_the_other_names_get_only_what_the_limited_names_left_of_the_want() -> None:
    a, z1, z2, z3 = (Cand(1, "q1", "a"), Cand(2, "q1", "z"),
                     Cand(3, "q1", "z"), Cand(4, "q1", "z"))  # fmt: skip
    roomy = ScopeState(ScopeLimits(max_running=5))
    plan = plan_claim([("q1", 2)], [a, z1, z2, z3], queues={}, names={"a": roomy}, now=NOW)
    assert plan == ClaimPlan((a, z1), held=False, frees_at=None)


def test_a_claim_held_by_several_keys_rates_frees_up_at_the_earliest_exit() -> None:
    minute = timedelta(minutes=1)
    queues = {"q1": ScopeState(ScopeLimits(rate_limit_per_key=1, rate_period_per_key=minute))}
    keys = {
        ("queue", "q1", "A"): KeyState(starts=(NOW - 50 * S,)),
        ("queue", "q1", "B"): KeyState(starts=(NOW - 10 * S,)),
    }
    candidates = [Cand(1, "q1", "a", "A"), Cand(2, "q1", "a", "B")]
    for order in (candidates, candidates[::-1]):
        plan = plan_claim([("q1", 2)], order, queues=queues, names={}, now=NOW, keys=keys)
        assert plan == ClaimPlan((), held=True, frees_at=NOW + 10 * S)


def test_an_owed_walk_starts_at_the_front_whatever_position_it_keeps() -> None:
    # The debt alone decides: a walk built with a position and the debt still walks from
    # the front, inside the interval and with a recent walk from the front.
    walk = ClaimWalk(_place(0, 1, 1), front_at=10.0, owed=True)
    assert walk.start(10.1, 1.0) is None
    assert ClaimWalk(_place(0, 1, 1), front_at=10.0).start(10.1, 1.0) == _place(0, 1, 1)


def test_a_keys_limit_counts_every_task_this_claim_took_of_the_key() -> None:
    cands = [Cand(i, "q1", "a", "A") for i in range(4)] + [Cand(9, "q1", "a", "B")]
    queues = {"q1": ScopeState(ScopeLimits(max_running_per_key=2))}
    plan = plan_claim([("q1", 5)], cands, queues=queues, names={}, now=NOW)
    assert plan.started == (cands[0], cands[1], cands[4])
    assert plan.held
