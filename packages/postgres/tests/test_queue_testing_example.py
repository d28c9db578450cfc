"""Testing your tasks: the examples of docs/testing.md, which includes them from this file.

Each test is what an application's own test suite would hold; none needs a database.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

# --8<-- [start:app]
from steeple.core.tasks import TaskState
from steeple.postgres import queue
from steeple.postgres.queue.testing import InMemoryQueue

app = queue.App()


@app.task(name="send-receipt", queue="emails")
async def send_receipt(ctx: queue.JobContext, args: dict[str, Any]) -> dict[str, Any]:
    return {"sent_to": args["email"]}


@app.task(name="charge", retry=queue.RetryPolicy(max_attempts=3, base_delay=timedelta(seconds=10)))
def charge(ctx: queue.JobContext, args: dict[str, Any]) -> str:  # a plain def runs in a thread
    if ctx.attempt < 3:
        raise ConnectionError("the payment provider timed out")
    return f"charged {args['cents']} cents"


async def place_order(conn: Any, order_id: int, email: str) -> None:
    """Application code: enqueues on whatever connection it is given."""
    await send_receipt.enqueue(conn, {"order": order_id, "email": email}, dedup_key=str(order_id))
    await charge.enqueue(conn, {"order": order_id, "cents": 1250})


# --8<-- [end:app]


# --8<-- [start:enqueued]
async def test_placing_an_order_enqueues_a_receipt_and_a_charge() -> None:
    memory = InMemoryQueue(app)
    await place_order(memory, 42, "ada@example.com")
    await place_order(memory, 42, "ada@example.com")  # the dedup key keeps one receipt

    receipts = memory.enqueued(send_receipt)
    assert [t.args for t in receipts] == [{"order": 42, "email": "ada@example.com"}]
    assert receipts[0].queue == "emails"
    assert len(memory.enqueued(charge)) == 2  # no dedup key: two charges


# --8<-- [end:enqueued]


# --8<-- [start:run]
async def test_the_receipt_is_sent_and_its_result_kept() -> None:
    memory = InMemoryQueue(app)
    receipt = await send_receipt.enqueue(memory, {"order": 7, "email": "bob@example.com"})

    assert await memory.run_until_idle() == 1  # attempts run
    run = memory.run_state(receipt.id)
    assert run.state is TaskState.SUCCEEDED
    assert run.result == {"sent_to": "bob@example.com"}
    assert memory.enqueued() == []


# --8<-- [end:run]


# --8<-- [start:retries]
async def test_a_failing_charge_retries_after_its_backoff() -> None:
    memory = InMemoryQueue(app)
    task = await charge.enqueue(memory, {"order": 9, "cents": 500})

    await memory.run_until_idle()  # attempt 1 fails; the retry waits 10 s
    (waiting,) = memory.enqueued(charge)
    assert waiting.attempts == 1
    assert waiting.run_at == memory.clock.now() + timedelta(seconds=10)

    memory.clock.advance(timedelta(seconds=10))
    await memory.run_until_idle()  # attempt 2 fails; this retry waits 20 s
    await memory.run_until_idle(advance_time=True)  # jump to each due time: attempt 3

    run = memory.run_state(task.id)
    assert run.state is TaskState.SUCCEEDED
    assert run.result == "charged 500 cents"
    assert [a.outcome for a in run.history] == ["retried", "retried", "succeeded"]
    assert run.history[0].error == "ConnectionError: the payment provider timed out"


# --8<-- [end:retries]


# --8<-- [start:json]
async def test_args_follow_the_database_json_rules() -> None:
    memory = InMemoryQueue(app)
    with pytest.raises(queue.ArgsEncodingError):  # NaN is not JSON
        await charge.enqueue(memory, {"order": 1, "cents": float("nan")})
    with pytest.raises(queue.ArgsEncodingError):  # a non-str key would come back a str
        await charge.enqueue(memory, {1: "one"})
    assert memory.enqueued() == []


# --8<-- [end:json]


# --8<-- [start:limits]
async def test_a_paused_queue_runs_nothing_until_resumed() -> None:
    memory = InMemoryQueue(app)
    await send_receipt.enqueue(memory, {"order": 1, "email": "eve@example.com"})
    memory.pause_queue("emails")
    assert await memory.run_until_idle() == 0
    memory.resume_queue("emails")
    assert await memory.run_until_idle() == 1


# --8<-- [end:limits]


# --8<-- [start:rates]
async def test_a_rate_limit_spaces_starts_on_the_virtual_clock() -> None:
    memory = InMemoryQueue(app)
    start = memory.clock.now()
    memory.limit_queue("emails", rate_limit=2, per=timedelta(seconds=10))
    for order in range(3):
        await send_receipt.enqueue(memory, {"order": order, "email": "eve@example.com"})
    assert await memory.run_until_idle() == 2  # the third waits for the window
    assert memory.rate_frees_at == start + timedelta(seconds=10)
    assert await memory.run_until_idle(advance_time=True) == 1
    assert memory.clock.now() == start + timedelta(seconds=10)


# --8<-- [end:rates]
