"""The cluster identity rule: which node a worker may write to after a failover."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from steeple.core.cluster import ClusterIdentity, ClusterWatch, judge_cluster
from steeple.core.errors import ClusterIdentityError, SteepleError

A = 7714409713151789174


def node(timeline: int, system_identifier: int = A) -> ClusterIdentity:
    return ClusterIdentity(system_identifier=system_identifier, timeline=timeline)


def test_first_node_is_remembered() -> None:
    assert judge_cluster(None, node(1)) == node(1)


def test_same_timeline_and_a_promotion_are_accepted() -> None:
    assert judge_cluster(node(1), node(1)) == node(1)
    assert judge_cluster(node(1), node(2)) == node(2)
    assert judge_cluster(node(2), node(5)) == node(5)


def test_a_stale_node_is_refused() -> None:
    with pytest.raises(ClusterIdentityError, match="stale node") as refused:
        judge_cluster(node(2), node(1))
    assert refused.value.known == (A, 2)
    assert refused.value.seen == (A, 1)
    assert "timeline 1, older than timeline 2" in str(refused.value)
    assert "pg_rewind" in str(refused.value)


def test_another_cluster_is_refused_whatever_its_timeline() -> None:
    for timeline in (1, 2, 9):
        with pytest.raises(ClusterIdentityError, match="another PostgreSQL cluster"):
            judge_cluster(node(2), node(timeline, system_identifier=A + 1))


def test_the_error_is_a_connection_error() -> None:
    # Worker loops treat it as a lost connection: back off, try again.
    assert issubclass(ClusterIdentityError, ConnectionError)
    assert issubclass(ClusterIdentityError, SteepleError)


def test_watch_adopts_newer_timelines_and_never_moves_back() -> None:
    assert ClusterWatch().known is None
    watch = ClusterWatch()
    watch.observe(node(1))
    watch.observe(node(2))
    with pytest.raises(ClusterIdentityError):
        watch.observe(node(1))
    assert watch.known == node(2)  # a refusal remembers nothing
    with pytest.raises(ClusterIdentityError):
        watch.observe(node(3, system_identifier=A + 1))
    assert watch.known == node(2)


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 6)), min_size=1, max_size=30))
def test_watch_accepts_exactly_the_first_cluster_at_its_newest_timeline(
    seen: list[tuple[int, int]],
) -> None:
    watch = ClusterWatch()
    first, newest = seen[0][0], 0
    for system_identifier, timeline in seen:
        accepted = system_identifier == first and timeline >= newest
        try:
            watch.observe(node(timeline, system_identifier))
        except ClusterIdentityError:
            assert not accepted
        else:
            assert accepted
            newest = timeline
        assert watch.known == node(newest, first)


def test_a_refusal_carries_both_identities_and_says_what_to_do() -> None:
    known = ClusterIdentity(7, 3)
    with pytest.raises(ClusterIdentityError) as other:
        judge_cluster(known, ClusterIdentity(8, 3))
    assert (other.value.known, other.value.seen) == ((7, 3), (8, 3))
    assert str(other.value).endswith(
        "check the DSN's hosts, or restart the process if the database really moved"
    )
    with pytest.raises(ClusterIdentityError) as stale:
        judge_cluster(known, ClusterIdentity(7, 2))
    assert (stale.value.known, stale.value.seen) == ((7, 3), (7, 2))
    assert str(stale.value).endswith(
        "nothing is done there: stop that node or rebuild it as a standby (pg_rewind), "
        "or remove it from the DSN"
    )
