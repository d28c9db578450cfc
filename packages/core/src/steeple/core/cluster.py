"""Which PostgreSQL node may be written to after a failover: the cluster identity rule.

A promoted standby keeps its primary's system identifier (``pg_control_system()``) and
starts a new, higher timeline; the old primary, restarted after the promotion, is still
writable but stays on its old timeline, and whatever is committed there is lost to the
cluster. A multi-host DSN with ``target_session_attrs=read-write`` connects to the first
writable host it finds, which may be that stale node. So every adapter reads the identity
of each new connection (once, when the connection opens) and asks :class:`ClusterWatch`
whether work may be done there: the same system identifier as the first node seen, on a
timeline no older than the newest seen. The newest timeline is adopted as it appears.

The watch lives in memory, one per worker or store: a process that has only ever seen the
stale node cannot tell it is stale (fence the old primary; see the failover guide).
"""

from __future__ import annotations

import attrs

from steeple.core.errors import ClusterIdentityError

__all__ = ["ClusterIdentity", "ClusterWatch", "judge_cluster"]


@attrs.frozen
class ClusterIdentity:
    """What identifies a writable node: its cluster and the timeline it writes on."""

    system_identifier: int
    timeline: int

    def shown(self) -> str:
        """Return the identity as a log line shows it."""
        return f"system identifier {self.system_identifier}, timeline {self.timeline}"


def judge_cluster(known: ClusterIdentity | None, seen: ClusterIdentity) -> ClusterIdentity:
    """Decide whether work may be done on a node; return the identity to remember.

    Args:
        known: the identity remembered so far (``None`` before the first connection).
        seen: the identity of a newly opened connection's node.

    Returns:
        ``seen`` when it is the first, or the same cluster on the same or a newer timeline
        (a promotion); the remembered identity never moves back.

    Raises:
        ClusterIdentityError: another cluster, or an older timeline (a stale node).
    """
    if known is None:
        return seen
    if seen.system_identifier != known.system_identifier:
        raise ClusterIdentityError(
            f"refused a connection to another PostgreSQL cluster ({seen.shown()}); this "
            f"process works on {known.shown()}: check the DSN's hosts, or restart the "
            "process if the database really moved",
            known=(known.system_identifier, known.timeline),
            seen=(seen.system_identifier, seen.timeline),
        )
    if seen.timeline < known.timeline:
        raise ClusterIdentityError(
            f"refused a connection to a stale node left behind by a failover (timeline "
            f"{seen.timeline}, older than timeline {known.timeline} already seen on this "
            f"cluster, system identifier {known.system_identifier}); nothing is done "
            "there: stop that node or rebuild it as a standby (pg_rewind), or remove it "
            "from the DSN",
            known=(known.system_identifier, known.timeline),
            seen=(seen.system_identifier, seen.timeline),
        )
    return seen


@attrs.define
class ClusterWatch:
    """The identity one worker or store remembers (see :func:`judge_cluster`)."""

    _known: ClusterIdentity | None = None

    @property
    def known(self) -> ClusterIdentity | None:
        """The identity remembered (``None`` before the first connection)."""
        return self._known

    def observe(self, seen: ClusterIdentity) -> None:
        """Accept a new connection's node, adopting a newer timeline, or refuse it.

        Raises:
            ClusterIdentityError: see :func:`judge_cluster`; nothing is remembered then.
        """
        self._known = judge_cluster(self._known, seen)
