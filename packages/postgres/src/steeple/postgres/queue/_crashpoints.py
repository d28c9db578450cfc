"""The work queue's crash points, registered with :mod:`steeple.runtime.crashpoints`.

Each statement of the queue commits on its own; a point before it is sent and one after it
committed. The queue's modules import :func:`crash_point` from here, so the names are
registered before any of them is reached.
"""

from __future__ import annotations

from typing import Final

from steeple.runtime.crashpoints import crash_point, register_crash_points

__all__ = ["QUEUE_CRASH_POINTS", "crash_point"]

QUEUE_CRASH_POINTS: Final[dict[str, str]] = {
    "queue.claim.before": "queue claim: before the claim statement is sent",
    "queue.claim.committed": "queue claim: tasks leased, before any handler starts",
    "queue.renew.before": "queue renewal: before the renewal statement is sent",
    "queue.renew.committed": "queue renewal: leases extended, before the worker knows",
    "queue.complete.before": "queue completion: handler done, before the completion is sent",
    "queue.complete.committed": "queue completion: committed (acknowledged), before counted",
    "queue.retry.before": "queue failure: before the retry is recorded",
    "queue.retry.committed": "queue failure: retry recorded, before the worker knows",
    "queue.recover.before": "lease recovery: before expired leases are taken back",
    "queue.recover.committed": "lease recovery: expired tasks made pending, before the wake-up",
    "queue.materialize.begin": "recurring jobs: before the materializing transaction",
    "queue.materialize.inserted": "recurring jobs: a task inserted, the job's cursor not advanced",
    "queue.materialize.committed": "recurring jobs: tasks and cursors committed",
}
"""The work queue's crash points and what has happened when each is reached."""

register_crash_points(QUEUE_CRASH_POINTS)
