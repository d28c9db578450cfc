"""The admin ASGI app over HTTP (httpx ASGITransport) against a real PostgreSQL store."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.requests import Request

from steeple.admin import ACTIONS, CSRF_HEADER, create_admin_app
from steeple.admin.queue_admin import PostgresTaskAdmin
from steeple.admin.serve import token_app
from steeple.core import RecurringConfig, SystemClock
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore
from steeple.testing import FakeClock, InMemoryRecurringStore

CSRF = "csrf-token-0123456789abcdef"
SECURITY = {
    "content-security-policy": "default-src 'self'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def assert_security_headers(response: httpx.Response) -> None:
    for name, value in SECURITY.items():
        assert value in response.headers.get(name, ""), (name, response.headers)


class Recorder:
    """An authorize callback that records its calls and allows what it is told to."""

    def __init__(self, allow: bool | str = True) -> None:
        self.allow = allow
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, request: Request, action: str, namespace: str) -> bool:
        self.calls.append((action, namespace))
        assert action in ACTIONS
        if isinstance(self.allow, str):
            return request.headers.get("x-user") == self.allow and namespace == "ops"
        return self.allow


@pytest.fixture
async def live(seeded: Any) -> AsyncIterator[dict[str, Any]]:
    key_id, _, material = seeded.keys.partition(":")
    keyring = Keyring(StorageKey.from_base64(key_id, material))
    store = await PostgresRecurringStore.connect(
        seeded.dsn,
        RecurringConfig("ops", 1000, 100_000),
        keyring,
        SystemClock(),
        schema=seeded.schema,
    )
    pool = await asyncpg.create_pool(seeded.dsn, min_size=1, max_size=2)
    admin = PostgresTaskAdmin(pool, seeded.schema)

    async def stores(namespace: str) -> Any:
        if namespace != "ops":
            raise LookupError(namespace)
        return store

    async def tasks(namespace: str) -> Any:
        if namespace != "ops":
            raise LookupError(namespace)
        return admin

    try:
        yield {"seeded": seeded, "stores": stores, "tasks": tasks}
    finally:
        await store.close()
        await pool.close()


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin")


def post_headers(token: str = CSRF) -> dict[str, str]:
    return {"content-type": "application/json", CSRF_HEADER: token}


@pytest.mark.postgres
async def test_without_authorize_everything_is_forbidden(live: dict[str, Any]) -> None:
    app = create_admin_app(
        authorize=None, stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    async with client(app) as http:
        for path in (
            "/api/ops/schedules",
            "/api/ops/occurrences",
            "/api/ops/tasks",
            "/ui/ops",
            "/static/admin.css",
        ):
            response = await http.get(path)
            assert response.status_code == 403, path
            assert_security_headers(response)
        response = await http.post(
            "/api/ops/schedules/cancel",
            headers=post_headers(),
            content=json.dumps({"name": "minutely"}),
        )
        assert response.status_code == 403
    # nothing was cancelled
    async with client(create_admin_app(authorize=Recorder(), stores=live["stores"])) as http:
        body = (await http.get("/api/ops/schedules")).json()
    assert {s["state"] for s in body["items"]} == {"active"}


@pytest.mark.postgres
async def test_a_refusing_authorize_is_asked_with_action_and_namespace(
    live: dict[str, Any],
) -> None:
    recorder = Recorder(allow="alice")
    app = create_admin_app(
        authorize=recorder, stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    async with client(app) as http:
        denied = await http.get("/api/ops/schedules", headers={"x-user": "mallory"})
        assert denied.status_code == 403
        assert denied.json()["error"] == "forbidden"
        allowed = await http.get("/api/ops/schedules", headers={"x-user": "alice"})
        assert allowed.status_code == 200
        # the namespace in the URL selects; it is never a grant by itself
        other = await http.get("/api/other/schedules", headers={"x-user": "alice"})
        assert other.status_code == 403
        malformed = await http.get("/api/..%2Fetc/schedules", headers={"x-user": "alice"})
        assert malformed.status_code == 404
    assert ("schedules.read", "ops") in recorder.calls
    assert ("schedules.read", "other") in recorder.calls


@pytest.mark.postgres
async def test_listings_are_metadata_only(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    app = create_admin_app(authorize=Recorder(), stores=live["stores"], tasks=live["tasks"])
    async with client(app) as http:
        schedules = await http.get("/api/ops/schedules")
        occurrences = await http.get("/api/ops/occurrences", params={"limit": 5})
        tasks = await http.get("/api/ops/tasks")
        one = await http.get(f"/api/ops/tasks/{seeded.task_ids[0]}")
        missing = await http.get("/api/ops/tasks/999999")
        bad_limit = await http.get("/api/ops/occurrences", params={"limit": 101})
    for response in (schedules, occurrences, tasks, one):
        assert response.status_code == 200
        assert_security_headers(response)
        assert "payload" not in response.text
        assert "secret" not in response.text
        assert "capability" not in response.text
        assert "lease_token" not in response.text
    names = [s["name"] for s in schedules.json()["items"]]
    assert sorted(names) == ["five-minutely", "minutely"]
    page = occurrences.json()
    assert len(page["items"]) == 5
    assert page["next_cursor"]
    assert {"occurrence_id", "definition_name", "due_at", "state", "attempts"} <= set(
        page["items"][0]
    )
    assert [t["task_id"] for t in tasks.json()["items"]] == list(seeded.task_ids)
    assert one.json()["state"] == "pending"
    assert missing.status_code == 404
    assert bad_limit.status_code == 422  # a value out of range (issue 10 item 3)


@pytest.mark.postgres
async def test_state_changes_need_json_and_the_csrf_header(live: dict[str, Any]) -> None:
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    body = json.dumps({"name": "minutely"})
    async with client(app) as http:
        no_token = await http.post(
            "/api/ops/schedules/cancel", headers={"content-type": "application/json"}, content=body
        )
        wrong = await http.post(
            "/api/ops/schedules/cancel", headers=post_headers("x" * 26), content=body
        )
        form = await http.post(
            "/api/ops/schedules/cancel", headers={CSRF_HEADER: CSRF}, data={"name": "minutely"}
        )
        text = await http.post(
            "/api/ops/schedules/cancel",
            headers={CSRF_HEADER: CSRF, "content-type": "text/plain"},
            content=body,
        )
        get = await http.get("/api/ops/schedules/cancel")
        not_json = await http.post(
            "/api/ops/schedules/cancel", headers=post_headers(), content="{nope"
        )
        still = await http.get("/api/ops/schedules")
    assert no_token.status_code == 403
    assert no_token.json()["error"] == "csrf"
    assert wrong.status_code == 403
    assert form.status_code == 415
    assert text.status_code == 415
    assert get.status_code in (404, 405)
    assert not_json.status_code == 400
    assert {s["state"] for s in still.json()["items"]} == {"active"}
    for response in (no_token, wrong, form, text, get, not_json):
        assert_security_headers(response)

    disabled = create_admin_app(authorize=Recorder(), stores=live["stores"])
    async with client(disabled) as http:
        refused = await http.post("/api/ops/schedules/cancel", headers=post_headers(), content=body)
    assert refused.status_code == 403


@pytest.mark.postgres
async def test_cancel_retry_purge_and_task_cancel(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    async with client(app) as http:
        cancelled = await http.post(
            "/api/ops/schedules/cancel",
            headers=post_headers(),
            content=json.dumps({"name": "five-minutely"}),
        )
        unknown = await http.post(
            "/api/ops/schedules/cancel",
            headers=post_headers(),
            content=json.dumps({"name": "no-such"}),
        )
        retried = await http.post(
            "/api/ops/occurrences/retry",
            headers=post_headers(),
            content=json.dumps({"occurrence_id": seeded.dead_id}),
        )
        again = await http.post(
            "/api/ops/occurrences/retry",
            headers=post_headers(),
            content=json.dumps({"occurrence_id": seeded.dead_id}),
        )
        purged = await http.post(
            "/api/ops/occurrences/purge",
            headers=post_headers(),
            content=json.dumps({"older_than_seconds": 0, "limit": 100}),
        )
        bad_purge = await http.post(
            "/api/ops/occurrences/purge", headers=post_headers(), content=json.dumps({"limit": 0})
        )
        task_cancel = await http.post(
            "/api/ops/tasks/cancel",
            headers=post_headers(),
            content=json.dumps({"task_id": seeded.task_ids[0]}),
        )
        task_again = await http.post(
            "/api/ops/tasks/cancel", headers=post_headers(), content=json.dumps({"task_id": 999999})
        )
        task_bad = await http.post(
            "/api/ops/tasks/cancel", headers=post_headers(), content=json.dumps({"task_id": "x"})
        )
        tasks_purged = await http.post(
            "/api/ops/tasks/purge",
            headers=post_headers(),
            content=json.dumps({"older_than_seconds": 0}),
        )
        occurrences = (await http.get("/api/ops/occurrences")).json()["items"]
        task = (await http.get(f"/api/ops/tasks/{seeded.task_ids[1]}")).json()
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    assert unknown.status_code == 404
    assert retried.status_code == 200
    assert retried.json()["state"] == "pending"
    assert again.status_code == 409
    assert purged.status_code == 200
    # every published occurrence was terminal and older than now: all of them went
    assert purged.json()["purged"] == seeded.published
    assert bad_purge.status_code == 422  # a value out of range (issue 10 item 3)
    assert len(occurrences) == len(seeded.occurrence_ids) - seeded.published
    assert task_cancel.status_code == 200
    assert task_cancel.json()["state"] == "cancelled"
    assert task_again.status_code == 404
    assert task_bad.status_code == 400
    assert tasks_purged.status_code == 200
    assert tasks_purged.json()["purged"] == 1
    assert task["state"] == "pending"


@pytest.mark.postgres
async def test_dashboard_renders_rows_without_inline_code(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    app = create_admin_app(authorize=Recorder(), stores=live["stores"], tasks=live["tasks"])
    async with client(app) as http:
        pages = {
            path: await http.get(path)
            for path in ("/ui/ops", "/ui/ops/tasks", "/ui/ops/schedules", "/ui/ops/jobs")
        }
        task_page = await http.get(f"/ui/ops/tasks/{seeded.task_ids[0]}")
        css = await http.get("/static/admin.css")
    for response in (*pages.values(), task_page):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/html")
        assert_security_headers(response)
        html = response.text
        # The only script is the app's own file; no inline code or style, nothing remote.
        assert html.count("<script") == 1
        assert '<script src="/static/admin.js" defer></script>' in html
        assert "style=" not in html
        assert "<style" not in html
        assert "http://" not in html
        assert "https://" not in html
        assert "all times UTC" in html
    assert pages["/ui/ops"].text.count('class="row schedule"') == 2
    assert 'id="throughput"' in pages["/ui/ops"].text
    assert pages["/ui/ops/schedules"].text.count('class="row occurrence"') == len(
        seeded.occurrence_ids
    )
    assert pages["/ui/ops/tasks"].text.count('class="row task"') == len(seeded.task_ids)
    assert "send-report" in task_page.text
    assert "args can hold secrets" in task_page.text  # hidden: not opted in
    assert '{"n":' not in task_page.text
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")


async def test_in_memory_store_and_html_escaping() -> None:
    from steeple.core import MissedRunPolicy, RecurringDefinition, ScheduledMessage

    clock = FakeClock(datetime(2026, 3, 1, tzinfo=UTC))
    store = InMemoryRecurringStore(RecurringConfig("mem", 10, 100), clock)
    await store.create(
        RecurringDefinition(
            "<script>alert(1)</script>",
            "* * * * *",
            clock.now() - timedelta(minutes=3),
            MissedRunPolicy.CATCH_UP,
            ScheduledMessage("t", "T", b"x"),
        )
    )
    await store.tick(100)

    async def stores(namespace: str) -> Any:
        return store

    async def allow(request: Request, action: str, namespace: str) -> bool:
        return True

    app = create_admin_app(authorize=allow, stores=stores, now=clock.now)
    async with client(app) as http:
        page = await http.get("/ui/mem/schedules")
        tasks = await http.get("/api/mem/tasks")
    assert "<script>alert" not in page.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text
    assert page.text.count('class="row occurrence"') == 3
    assert tasks.status_code == 404  # no task access configured


async def test_authorize_must_answer_true_exactly() -> None:
    async def sloppy(request: Request, action: str, namespace: str) -> Any:
        return "yes"  # truthy, but not True: still refused

    app = create_admin_app(authorize=sloppy)
    async with client(app) as http:
        response = await http.get("/api/ops/schedules")
    assert response.status_code == 403


def test_short_csrf_token_is_refused() -> None:
    from steeple.core import ConfigurationError

    with pytest.raises(ConfigurationError, match="16"):
        create_admin_app(authorize=None, csrf_token="short")


@pytest.mark.postgres
async def test_token_app_of_admin_serve(live: dict[str, Any]) -> None:
    token = "Zr8kQ2vNw5LxT9cHj3mPb7YgF4sDa6EuK1oRi0WnVq"
    app = token_app(
        token=token, namespace="ops", stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    basic = base64.b64encode(b"admin:" + token.encode()).decode()
    async with client(app) as http:
        anonymous = await http.get("/ui/ops")
        wrong = await http.get("/ui/ops", headers={"authorization": "Bearer nope"})
        browser = await http.get("/ui/ops", headers={"authorization": f"Basic {basic}"})
        api = await http.get("/api/ops/tasks", headers={"authorization": "Bearer " + token})
        other = await http.get("/api/zzz/tasks", headers={"authorization": "Bearer " + token})
        other_page = await http.get("/ui/zzz", headers={"authorization": f"Basic {basic}"})
    assert anonymous.status_code == 401
    assert "Basic" in anonymous.headers["www-authenticate"]
    assert_security_headers(anonymous)
    assert wrong.status_code == 401  # a wrong token is counted against its address
    assert "Basic" in wrong.headers["www-authenticate"]
    assert browser.status_code == 200
    assert 'class="row schedule"' in browser.text
    assert api.status_code == 200
    # The token grants; the namespace only selects, and this app serves "ops" alone.
    assert other.status_code == 404
    assert other_page.status_code == 404
    assert other_page.headers["content-type"].startswith("text/html")
    assert 'href="/ui/ops"' in other_page.text


async def test_failures_keep_the_security_headers() -> None:
    from steeple.core import RecurringStorageError, SteepleError

    class Broken:
        def __init__(self, error: Exception) -> None:
            self.error = error

        async def tasks(self, **_: Any) -> Any:
            raise self.error

        async def overview(self) -> Any:
            raise self.error

    async def allow(request: Request, action: str, namespace: str) -> bool:
        return True

    outcomes = {}
    for label, error in (
        ("steeple", SteepleError("queue schema is not installed")),
        ("storage", RecurringStorageError("database down")),
        ("bug", RuntimeError("boom: secret detail")),
    ):

        async def tasks(namespace: str, error: Exception = error) -> Any:
            return Broken(error)

        app = create_admin_app(authorize=allow, tasks=tasks)
        async with client(app) as http:
            outcomes[label] = (await http.get("/api/ops/tasks"), await http.get("/ui/ops"))
    api, page = outcomes["steeple"]
    assert api.status_code == 409
    assert page.status_code == 200
    assert "unavailable: queue schema is not installed" in page.text
    api, page = outcomes["storage"]
    assert api.status_code == 503
    api, page = outcomes["bug"]
    assert api.status_code == 500
    assert page.status_code == 500
    assert page.headers["content-type"].startswith("text/html")  # a page, for a browser
    assert "Something went wrong" in page.text
    assert "secret detail" not in api.text
    assert "secret detail" not in page.text
    for api, page in outcomes.values():
        assert_security_headers(api)
        assert_security_headers(page)


@pytest.mark.postgres
async def test_dashboard_before_the_queue_is_migrated(pg_schema: tuple[str, str]) -> None:
    dsn, schema = pg_schema
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=1)
    try:
        admin = PostgresTaskAdmin(pool, schema)  # nothing installed in this schema

        async def tasks(namespace: str) -> Any:
            return admin

        app = create_admin_app(authorize=Recorder(), tasks=tasks)
        async with client(app) as http:
            api = await http.get("/api/ops/tasks")
            page = await http.get("/ui/ops")
    finally:
        await pool.close()
    assert api.status_code == 409
    assert "steeple migrate" in api.json()["detail"]
    assert page.status_code == 200
    assert "unavailable" in page.text


@pytest.mark.postgres
async def test_dashboard_actions_post_what_the_buttons_carry(live: dict[str, Any]) -> None:
    import html as html_module
    import re

    seeded = live["seeded"]
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    pattern = r'<button type="button" class="act[^"]*" data-action="([^"]+)" data-body="([^"]+)"'
    async with client(app) as http:
        page = await http.get("/ui/ops/schedules")
        tasks_page = await http.get("/ui/ops/tasks")
        script = await http.get("/static/admin.js")
        buttons = re.findall(pattern, page.text)
        task_buttons = re.findall(pattern, tasks_page.text)
        # what admin.js does on a click: POST {data-api}/{action} with the page's token
        token = re.search(r'<meta name="steeple-csrf" content="([^"]+)">', page.text)
        api = re.search(r'data-api="([^"]+)"', page.text)
        assert token
        assert api
        retry = [(a, html_module.unescape(b)) for a, b in buttons if a == "occurrences/retry"]
        assert len(retry) == 1
        clicked = await http.post(
            f"{api.group(1)}/{retry[0][0]}",
            content=retry[0][1],
            headers={"content-type": "application/json", CSRF_HEADER: token.group(1)},
        )
        after = await http.get("/ui/ops/schedules")
    assert page.status_code == 200
    assert api.group(1) == "/api/ops"
    assert "<script>" not in page.text  # nothing inline
    actions = [a for a, _ in buttons]
    assert actions.count("schedules/cancel") == 2
    assert actions.count("occurrences/purge") == 1
    task_actions = [a for a, _ in task_buttons]
    assert task_actions.count("tasks/cancel") == len(seeded.task_ids)
    assert "tasks/bulk-cancel" in task_actions
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert "X-Steeple-CSRF" in script.text
    assert_security_headers(script)
    assert clicked.status_code == 200
    assert json.loads(retry[0][1]) == {"occurrence_id": seeded.dead_id}
    assert "occurrences/retry" not in after.text  # no dead occurrence is left to retry


async def _fail_one(seeded: Any, name: str, error: str) -> int:
    """Enqueue a task named ``name`` and fail it for good, as a worker would."""
    from steeple.postgres import queue
    from steeple.postgres.queue._sql import queue_sql

    conn = await asyncpg.connect(seeded.dsn)
    try:
        task: queue.Task[Any] = queue.Task(name)
        enqueued = await queue.enqueue(
            conn, task, {"card": "4111"}, queue.EnqueueOptions.immediate(), schema=seeded.schema
        )
        sql = queue_sql(seeded.schema)
        give_up = await conn.fetchval(
            "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
        )
        (row,) = await conn.fetch(sql.claim, [name], 1, "w1", give_up)
        assert await conn.fetch(
            sql.fail, enqueued.id, row["lease_token"], error, "w1", "CardDeclined", "Tb...", None
        )
        return enqueued.id
    finally:
        await conn.close()


@pytest.mark.postgres
async def test_task_detail_routes_attempts_args_and_overview(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    failed = await _fail_one(seeded, "charge", "CardDeclined: no")
    recorder = Recorder()
    app = create_admin_app(
        authorize=recorder,
        stores=live["stores"],
        tasks=live["tasks"],
        csrf_token=CSRF,
        reveal_args={"charge"},
    )
    async with client(app) as http:
        attempts = await http.get(f"/api/ops/tasks/{failed}/attempts")
        args = await http.get(f"/api/ops/tasks/{failed}/args")
        hidden = await http.get(f"/api/ops/tasks/{seeded.task_ids[0]}/args")
        missing = await http.get("/api/ops/tasks/999999/args")
        overview = await http.get("/api/ops/overview")
        listing = await http.get("/api/ops/tasks", params={"state": "failed", "newest": "1"})
        named = await http.get("/api/ops/tasks", params={"name": "charge"})
        future = await http.get("/api/ops/tasks", params={"since": "2999-01-01"})
        bad_since = await http.get("/api/ops/tasks", params={"since": "yesterday"})
        bad_newest = await http.get("/api/ops/tasks", params={"newest": "yes"})
        retried = await http.post(
            "/api/ops/tasks/retry", json={"task_id": failed}, headers=post_headers()
        )
        again = await http.post(
            "/api/ops/tasks/retry", json={"task_id": failed}, headers=post_headers()
        )
    assert attempts.status_code == 200
    ((attempt),) = attempts.json()["items"]
    assert (attempt["outcome"], attempt["error"], attempt["worker_id"]) == (
        "failed",
        "CardDeclined: no",
        "w1",
    )
    assert (attempt["error_type"], attempt["traceback"]) == ("CardDeclined", "Tb...")
    assert args.json() == {"task_id": failed, "args": {"card": "4111"}}
    assert ("tasks.args", "ops") in recorder.calls
    assert hidden.status_code == 403  # send-report is not opted in
    assert "4111" not in hidden.text
    assert missing.status_code == 404
    body = overview.json()
    assert body["counts"]["failed"] == 1
    assert body["counts"]["pending"] == len(seeded.task_ids)
    assert sum(body["throughput"]["finished"]["failed"]) == 1
    assert body["throughput"]["bucket_seconds"] == 60
    assert [t["task_id"] for t in listing.json()["items"]] == [failed]
    assert [t["task_id"] for t in named.json()["items"]] == [failed]
    assert future.json()["items"] == []
    assert bad_since.status_code == 422
    assert "2026-12-01 08:30" in bad_since.json()["detail"]
    assert bad_newest.status_code == 422
    assert retried.status_code == 200
    assert retried.json()["state"] == "pending"
    assert again.status_code == 409  # only failed tasks are retried
    assert "only failed tasks" in again.json()["detail"]


@pytest.mark.postgres
async def test_bulk_actions_preview_then_act_on_the_confirmed_ids(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    failed = [await _fail_one(seeded, "charge", f"no {n}") for n in range(2)]
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    async with client(app) as http:

        async def bulk(verb: str, body: dict[str, Any]) -> httpx.Response:
            return await http.post(f"/api/ops/tasks/bulk-{verb}", json=body, headers=post_headers())

        preview = await bulk("cancel", {"name": "send-report"})
        unchanged = (await http.get("/api/ops/tasks", params={"state": "pending"})).json()
        wrong_state = await bulk("cancel", {"state": "failed"})
        retry_preview = await bulk("retry", {})
        retried = await bulk("retry", {"task_ids": retry_preview.json()["task_ids"]})
        cancelled = await bulk("cancel", {"task_ids": [*seeded.task_ids, 999999]})
        mixed = await bulk("cancel", {"task_ids": [1], "name": "x"})
        too_many = await bulk("cancel", {"task_ids": list(range(1, 102))})
        empty_name = await bulk("cancel", {"name": " "})
        no_token = await http.post(
            "/api/ops/tasks/bulk-cancel",
            json={"task_ids": [seeded.task_ids[0]]},
            headers={"content-type": "application/json"},
        )
    assert preview.json() == {"task_ids": list(seeded.task_ids), "more": False}
    assert len(unchanged["items"]) == len(seeded.task_ids)  # a preview changes nothing
    assert wrong_state.json() == {"task_ids": [], "more": False}
    assert retry_preview.json()["task_ids"] == failed
    assert retried.json() == {"retried": failed, "skipped": {}}
    assert cancelled.status_code == 200
    assert cancelled.json()["cancelled"] == list(seeded.task_ids)
    assert cancelled.json()["skipped"] == {"999999": "no such task"}
    assert mixed.status_code == 400
    assert too_many.status_code == 422
    assert empty_name.status_code == 422
    assert no_token.status_code == 403


@pytest.mark.postgres
async def test_job_routes_create_change_and_refuse(live: dict[str, Any]) -> None:
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    job = {"name": "nightly", "task": "report", "cron": "0 3 * * *", "args": {"k": 1}}
    async with client(app) as http:

        async def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return await http.post(f"/api/ops/jobs/{path}", json=body, headers=post_headers())

        created = await post("create", job)
        duplicate = await post("create", job)
        bad_cron = await post("create", {**job, "name": "other", "cron": "every day"})
        bad_zone = await post("create", {**job, "name": "other", "timezone": "Mars/Base"})
        no_args = await post("create", {k: v for k, v in job.items() if k != "args"})
        paused = await post("pause", {"name": "nightly"})
        resumed = await post("resume", {"name": "nightly"})
        moved = await post("reschedule", {"name": "nightly", "cron": "@hourly", "timezone": "UTC"})
        unknown = await post("pause", {"name": "nope"})
        listing = await http.get("/api/ops/jobs")
        deleted = await post("delete", {"name": "nightly"})
        gone = await post("delete", {"name": "nightly"})
    assert created.status_code == 200
    assert created.json()["cron"] == "0 3 * * *"
    assert "args" not in created.json()
    assert duplicate.status_code == 409
    assert bad_cron.status_code == 422
    assert bad_zone.status_code == 422
    assert no_args.status_code == 400
    assert paused.json()["paused"] is True
    assert resumed.json()["paused"] is False
    assert moved.json()["cron"] == "@hourly"
    assert unknown.status_code == 404
    assert [j["name"] for j in listing.json()["items"]] == ["nightly"]
    assert deleted.json() == {"deleted": True}
    assert gone.status_code == 404


async def _succeed_one(seeded: Any, name: str, result: Any) -> int:
    """Enqueue a task named ``name`` and record that its handler returned ``result``."""
    from steeple.postgres import queue

    conn = await asyncpg.connect(seeded.dsn)
    try:
        task: queue.Task[Any] = queue.Task(name)
        enqueued = await queue.enqueue(
            conn, task, {}, queue.EnqueueOptions.immediate(), schema=seeded.schema
        )
        await conn.execute(
            f"UPDATE \"{seeded.schema}\".tasks SET state = 'succeeded', attempts = 1,"
            " started_at = clock_timestamp(), finished_at = clock_timestamp(),"
            " result = $2::text::jsonb WHERE id = $1",
            enqueued.id,
            json.dumps(result),
        )
        return enqueued.id
    finally:
        await conn.close()


class Grants:
    """An authorize callback that allows exactly the listed actions."""

    def __init__(self, *actions: str) -> None:
        self.actions = set(actions)
        self.calls: list[str] = []

    async def __call__(self, request: Request, action: str, namespace: str) -> bool:
        assert action in ACTIONS
        self.calls.append(action)
        return action in self.actions


@pytest.mark.postgres
async def test_pages_ask_what_the_api_routes_of_their_data_ask(live: dict[str, Any]) -> None:
    seeded = live["seeded"]
    failed = await _fail_one(seeded, "charge", "CardDeclined: secret-detail")
    done = await _succeed_one(seeded, "report", {"token": "result-secret"})

    def app(*actions: str) -> Any:
        return create_admin_app(
            authorize=Grants(*actions), stores=live["stores"], tasks=live["tasks"]
        )

    # dashboard.read alone: no task data, on the pages or their live JSON.
    async with client(app("dashboard.read", "static.read")) as http:
        for path in (f"/ui/ops/tasks/{done}", f"/ui/ops/tasks/{failed}", "/ui/ops/tasks"):
            page = await http.get(path)
            live_json = await http.get(path, params={"live": "1"})
            assert page.status_code == 403, path
            assert live_json.status_code == 403, path
            assert live_json.json()["detail"] == "not allowed: tasks.read"
            for body in (page.text, live_json.text):
                assert "result-secret" not in body
                assert "secret-detail" not in body
        assert (await http.get("/ui/ops/jobs")).status_code == 403
        assert (await http.get("/ui/ops/schedules")).status_code == 403
        overview = await http.get("/ui/ops", params={"live": "1"})
        assert overview.status_code == 200
        assert "secret-detail" not in overview.text
        assert "not allowed: tasks.read" in overview.text
        assert "not allowed: schedules.read" in overview.text

    # tasks.read: the task page as the API shows it, its result withheld without tasks.results.
    async with client(app("dashboard.read", "tasks.read")) as http:
        page = await http.get(f"/ui/ops/tasks/{done}")
        live_json = await http.get(f"/ui/ops/tasks/{done}", params={"live": "1"})
        api = await http.get(f"/api/ops/tasks/{done}")
        failure = await http.get(f"/ui/ops/tasks/{failed}")
    assert page.status_code == live_json.status_code == api.status_code == 200
    for body in (page.text, live_json.text, api.text):
        assert "result-secret" not in body
    assert "not allowed (tasks.results)" in page.text
    assert (api.json()["result"], api.json()["result_withheld"]) == (None, True)
    assert "secret-detail" in failure.text  # errors are task data, as the API shows them

    async with client(app("dashboard.read", "tasks.read", "tasks.results")) as http:
        page = await http.get(f"/ui/ops/tasks/{done}")
        api = await http.get(f"/api/ops/tasks/{done}")
    assert "result-secret" in page.text
    assert (api.json()["result"], api.json()["result_withheld"]) == (
        {"token": "result-secret"},
        False,
    )


@pytest.mark.postgres
async def test_jobs_carry_their_queue_through_the_api_and_the_dashboard(
    live: dict[str, Any],
) -> None:
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    job = {"name": "mailer", "task": "send-mail", "cron": "0 3 * * *", "args": {}}
    async with client(app) as http:

        async def post(path: str, body: dict[str, Any]) -> httpx.Response:
            return await http.post(f"/api/ops/jobs/{path}", json=body, headers=post_headers())

        created = await post("create", {**job, "queue": "emails"})
        plain = await post("create", {**job, "name": "plain"})
        not_text = await post("create", {**job, "name": "x", "queue": 5})
        bad_name = await post("create", {**job, "name": "y", "queue": "a\nb"})
        listing = await http.get("/api/ops/jobs")
        page = await http.get("/ui/ops/jobs")
    assert created.status_code == 200, created.text
    assert created.json()["queue"] == "emails"
    assert plain.json()["queue"] == "default"
    assert not_text.status_code == 400
    assert bad_name.status_code == 422
    assert {j["name"]: j["queue"] for j in listing.json()["items"]} == {
        "mailer": "emails",
        "plain": "default",
    }
    assert ">queue</th>" in page.text
    assert 'href="/ui/ops/tasks?queue=emails">emails</a>' in page.text
    assert '<input name="queue" value="default"' in page.text  # the form asks for it


@pytest.mark.postgres
async def test_the_overview_flags_a_queue_with_due_work_no_worker_claims(
    live: dict[str, Any], seeded: Any
) -> None:
    app = create_admin_app(
        authorize=Recorder(), stores=live["stores"], tasks=live["tasks"], csrf_token=CSRF
    )
    conn = await asyncpg.connect(seeded.dsn)
    try:
        # What a job left in a queue no worker serves: due ten minutes ago, never claimed.
        for queue in ("orphan", "held"):
            await conn.execute(
                f"""INSERT INTO "{seeded.schema}".tasks (task_name, args, max_attempts,
                    lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,
                    backoff_jitter, queue, run_at, created_at)
                VALUES ('send-mail', '{{}}', 3, interval '60 s', 1000000, 60000000, 2, 0.1,
                        $1, clock_timestamp() - interval '10 minutes',
                        clock_timestamp() - interval '10 minutes')""",
                queue,
            )
    finally:
        await conn.close()
    async with client(app) as http:
        paused = await http.post(
            "/api/ops/queues/pause", json={"queue": "held"}, headers=post_headers()
        )
        assert paused.status_code == 200, paused.text
        queues = {q["name"]: q for q in (await http.get("/api/ops/queues")).json()["items"]}
        page = await http.get("/ui/ops")
    assert queues["orphan"]["unserved"] is True
    assert queues["orphan"]["due_since"] is not None
    assert queues["held"]["unserved"] is False  # paused on purpose: not a missing worker
    assert all(not q["unserved"] for name, q in queues.items() if name != "orphan")
    assert 'id="unserved-queues"' in page.text
    assert "no worker seems to serve orphan" in page.text
    assert page.text.count(">unserved</span>") == 1


@pytest.mark.postgres
async def test_task_list_and_page_say_a_terminal_failure_is_not_retried(
    live: dict[str, Any],
) -> None:
    """A task failed at its first of five attempts reads "1, not retried", never "1/5"."""
    seeded = live["seeded"]
    failed = await _fail_one(seeded, "charge", "ValueError: no")
    app = create_admin_app(authorize=Recorder(), stores=live["stores"], tasks=live["tasks"])
    async with client(app) as http:
        listing = await http.get("/ui/ops/tasks")
        page = await http.get(f"/ui/ops/tasks/{failed}")
    assert listing.status_code == page.status_code == 200
    assert ">1, not retried</td>" in listing.text
    assert "1/5" not in listing.text
    assert ">0/5</td>" in listing.text  # pending tasks can still be retried
    assert "<dd>1, not retried (4 of its 5 attempts unused)</dd>" in page.text
    assert "1 of 5" not in page.text


def test_answered_live_polls_stay_out_of_the_access_log() -> None:
    import logging

    from steeple.admin.serve import LivePollFilter

    def record(path: str, status: int) -> logging.LogRecord:
        # uvicorn's access record: client, method, path with query, HTTP version, status.
        return logging.LogRecord(
            "uvicorn.access",
            logging.INFO,
            __file__,
            1,
            '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:5000", "GET", path, "1.1", status),
            None,
        )

    kept = LivePollFilter()
    assert not kept.filter(record("/ui/ops/tasks?live=1", 200))
    assert not kept.filter(record("/ui/ops?state=failed&live=1", 200))
    assert kept.filter(record("/ui/ops/tasks?live=1", 503))  # a failed poll is news
    assert kept.filter(record("/ui/ops/tasks", 200))
    assert kept.filter(record("/api/ops/tasks/retry", 200))
    assert kept.filter(record("/ui/ops/tasks?alive=1", 200))


@pytest.mark.postgres
async def test_task_page_shows_its_limit_key_escaped_and_links_its_workflow(
    live: dict[str, Any],
) -> None:
    from steeple.postgres.queue import EnqueueOptions, Task, enqueue

    seeded = live["seeded"]
    hostile = '<img src=x onerror="alert(1)">&'
    conn = await asyncpg.connect(seeded.dsn)
    try:
        parent = await enqueue(
            conn, Task("keyed"), {}, EnqueueOptions(limit_key=hostile), schema=seeded.schema
        )
        child = await enqueue(conn, Task("after"), {}, after=[parent], schema=seeded.schema)
    finally:
        await conn.close()
    app = create_admin_app(authorize=Recorder(), stores=live["stores"], tasks=live["tasks"])
    async with client(app) as http:
        keyed = await http.get(f"/ui/ops/tasks/{parent.id}")
        waiting = await http.get(f"/ui/ops/tasks/{child.id}")
        alone = await http.get(f"/ui/ops/tasks/{seeded.task_ids[0]}")
        shown = (await http.get(f"/api/ops/tasks/{child.id}")).json()
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;" in keyed.text
    assert "<img" not in keyed.text
    assert f'href="/ui/ops/workflows/{child.id}">{parent.id}</a>' in waiting.text
    assert "/workflows/" not in alone.text
    assert "<dt>limit key</dt><dd>-</dd>" in alone.text
    assert (shown["limit_key"], shown["workflow_id"]) == (None, parent.id)
