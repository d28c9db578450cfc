"""Hostile requests to every admin route: always a 4xx with a one-line reason, never a 5xx,
never a change in the database (issue 10 items 3 and 5, the admin routes).

Values: lone surrogates, NUL and other control characters, 10 KB strings, ints beyond
int64, NaN/inf, deep JSON (depth 10,000), wrong JSON types, naive datetimes, non-ASCII
digits, overflowing cursors. They go into every slot a route reads (the namespace in the
path, query parameters, the task id in the path, each body field, the whole body) against
a real PostgreSQL store and task queue, so a value that slipped through would reach the
driver. After each request the rows of the namespace's tables are compared with before.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import asyncpg
import attrs
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from steeple.admin import CSRF_HEADER, create_admin_app
from steeple.admin.app import MAX_BODY_BYTES
from steeple.admin.queue_admin import PostgresTaskAdmin
from steeple.core import RecurringConfig, SystemClock
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

CSRF = "csrf-token-0123456789abcdef"
NAMESPACE = "ops"


@attrs.frozen
class Raw:
    """A JSON fragment sent as is (json.dumps cannot write depth 10,000 or 5,000 digits)."""

    text: str


DEEP = Raw("[" * 10_000 + "]" * 10_000)
"""Nested 10,000 deep: 20,000 bytes, over the 16 KiB body limit inside any body."""
DEEP_FITTING = Raw("[" * 7_000 + "]" * 7_000)
"""Nested 7,000 deep: fits in the body limit, so the JSON parser meets it."""

# Each value is invalid in every slot it is sent to (a name it happens to spell is unknown).
HOSTILE: list[object] = [
    "\ud800",
    "a\udfffb",
    "\x00",
    "a\x00b",
    "minutely\x00",
    "\x1b[31m",
    "\u2028",
    "\ufeff",
    "\u202e",
    "x" * 10_240,
    "",
    " ",
    " minutely",
    "2024-01-01T00:00:00",
    "2024-01-01 00:00",
    "１２",
    "٣",
    "²",
    "-1",
    "1e3",
    "0x10",
    " 5",
    "99999999999999999999999",
    "9223372036854775808",
    "999999999999999." + "a" * 32,
    "410244480000000." + "a" * 32,
    "000000000000000." + "A" * 32,
    "000000000000001." + "a" * 31,
    "../../etc/passwd",
    "%00",
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    -1,
    Raw("1" + "0" * 5_000),
    float("nan"),
    float("inf"),
    float("-inf"),
    1.5,
    -0.0,
    True,
    False,
    None,
    [],
    {},
    ["minutely"],
    {"name": "minutely"},
    DEEP,
    DEEP_FITTING,
]

GET_ROUTES = ("schedules", "occurrences", "tasks")
QUERY_SLOTS: list[tuple[str, str, list[object]]] = [
    ("schedules", "after", []),
    ("schedules", "limit", [0, 101]),
    ("occurrences", "after", []),
    ("occurrences", "limit", [0, 101]),
    ("tasks", "after", []),
    ("tasks", "limit", [0, 101]),
    ("tasks", "state", ["PENDING", "pending\x00"]),
]
BODY_SLOTS: list[tuple[str, str, list[object]]] = [
    ("schedules/cancel", "name", []),
    ("occurrences/retry", "occurrence_id", []),
    ("occurrences/purge", "older_than_seconds", [100 * 366 * 86400]),
    ("occurrences/purge", "limit", [0, 101]),
    ("tasks/cancel", "task_id", [0]),
    ("tasks/purge", "older_than_seconds", [100 * 366 * 86400]),
    ("tasks/purge", "limit", [0, 101]),
    ("tasks/purge", "older_than_days", [36_501, "7"]),
    ("tasks/retry", "task_id", [0]),
    ("tasks/bulk-cancel", "task_ids", [[0], [2**63], list(range(1, 102))]),
    ("tasks/bulk-retry", "task_ids", [[-1]]),
    ("tasks/bulk-cancel", "state", ["PENDING"]),
    ("jobs/pause", "name", []),
    ("jobs/resume", "name", []),
    ("jobs/delete", "name", []),
    ("jobs/reschedule", "name", []),
]
POST_ROUTES = tuple(sorted({route for route, _, _ in BODY_SLOTS}))
RAW_BODIES: list[bytes] = [
    b"",
    b"[]",
    b"1",
    b"null",
    b'"minutely"',
    b"\xff\xfe",
    b'{"name": "\xed\xa0\x80"}',
    b"{nope",
    b'{"name": NaN}',
    b'{"limit": Infinity}',
    b'{"name": "minutely", "name": "five-minutely"}',
    b'{"name": "minutely", "extra": 1}',
    ("[" * 10_000).encode(),
    ("{" + '"a":' * 3_000 + "1").encode(),
    b"\x00" * 100,
]


def as_text(value: object) -> str:
    """How a value travels in a path or query: strings as they are, others as JSON text."""
    if isinstance(value, str):
        return value
    return as_json(value)


def as_json(value: object) -> str:
    if isinstance(value, Raw):
        return value.text
    return json.dumps(value)  # NaN / Infinity come out as bare words, as hostile clients do


def escape(text: str) -> str:
    # surrogatepass: the client sends exactly the bytes a lone surrogate would have.
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


@attrs.frozen
class Case:
    """One request; ``may_read`` marks a slot where a well-formed value is a valid read."""

    method: str
    target: str
    body: bytes | None = None
    may_read: bool = False


def namespace_case(route: str, value: object) -> Case:
    path = "/ui/{ns}" if route == "ui" else f"/api/{{ns}}/{route}"
    return Case("GET", path.format(ns=escape(as_text(value))))


def query_case(route: str, name: str, value: object) -> Case:
    # Any definition name is a well-formed schedules cursor (a surrogate arrives as U+FFFD),
    # and an empty cursor or state filter means none (as an HTML form sends it).
    may_read = (route, name) == ("schedules", "after") or (
        value == "" and name in ("after", "state")
    )
    return Case("GET", f"/api/{NAMESPACE}/{route}?{name}={escape(as_text(value))}", None, may_read)


def task_path_case(value: object) -> Case:
    return Case("GET", f"/api/{NAMESPACE}/tasks/{escape(as_text(value))}")


def workflow_path_case(value: object) -> Case:
    return Case("GET", f"/ui/{NAMESPACE}/workflows/{escape(as_text(value))}")


def body_case(route: str, field: str, value: object) -> Case:
    text = "{" + json.dumps(field) + ": " + as_json(value) + "}"
    return Case("POST", f"/api/{NAMESPACE}/{route}", text.encode("utf-8", "surrogatepass"))


def raw_case(route: str, body: bytes) -> Case:
    return Case("POST", f"/api/{NAMESPACE}/{route}", body)


def every_curated_case() -> list[Case]:
    cases: list[Case] = []
    for value in HOSTILE:
        cases.extend(namespace_case(r, value) for r in (*GET_ROUTES, "ui"))
        cases.append(task_path_case(value))
        cases.append(workflow_path_case(value))
        cases.extend(query_case(r, n, value) for r, n, _ in QUERY_SLOTS)
        cases.extend(body_case(r, f, value) for r, f, _ in BODY_SLOTS)
        cases.extend(body_case(r, "unknown", value) for r in POST_ROUTES)
    for route, name, extra in QUERY_SLOTS:
        cases.extend(query_case(route, name, value) for value in extra)
    for route, field, extra in BODY_SLOTS:
        cases.extend(body_case(route, field, value) for value in extra)
    cases.extend(raw_case(r, b) for r in POST_ROUTES for b in RAW_BODIES)
    return cases


# Generated values: text with at least one character no name, id or cursor may hold
# (a lone surrogate, NUL, a control or format character); ints and floats of every kind
# outside what any field accepts.
BAD_CHAR = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "\x00", "\x07", "\x7f"])
hostile_text = st.tuples(st.text(max_size=30), BAD_CHAR, st.text(max_size=30)).map("".join)
long_text = st.integers(201, 12_000).map(lambda n: "n" * n)
hostile_ints = st.integers(max_value=-1) | st.integers(min_value=2**63)
hostile_values = st.one_of(
    st.sampled_from(HOSTILE),
    hostile_text,
    long_text,
    hostile_ints,
    st.floats(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    kind = draw(st.sampled_from(["namespace", "query", "task_path", "body", "unknown", "raw"]))
    if kind == "raw":
        return raw_case(draw(st.sampled_from(POST_ROUTES)), draw(st.sampled_from(RAW_BODIES)))
    value = draw(hostile_values)
    if kind == "namespace":
        return namespace_case(draw(st.sampled_from((*GET_ROUTES, "ui"))), value)
    if kind == "query":
        route, name, _ = draw(st.sampled_from(QUERY_SLOTS))
        return query_case(route, name, value)
    if kind == "task_path":
        return task_path_case(value)
    if kind == "unknown":
        return body_case(draw(st.sampled_from(POST_ROUTES)), "unknown", value)
    route, field, _ = draw(st.sampled_from(BODY_SLOTS))
    return body_case(route, field, value)


class Harness:
    """The admin app over a seeded namespace on real PostgreSQL, driven from one loop."""

    def __init__(self, seeded: Any) -> None:
        self.seeded = seeded
        self.schema = seeded.schema

    async def open(self) -> None:
        key_id, _, material = self.seeded.keys.partition(":")
        self.store = await PostgresRecurringStore.connect(
            self.seeded.dsn,
            RecurringConfig(NAMESPACE, 1000, 100_000),
            Keyring(StorageKey.from_base64(key_id, material)),
            SystemClock(),
            schema=self.schema,
        )
        self.pool = await asyncpg.create_pool(self.seeded.dsn, min_size=1, max_size=2)
        admin = PostgresTaskAdmin(self.pool, self.schema)

        async def stores(namespace: str) -> Any:
            if namespace != NAMESPACE:
                raise LookupError(namespace)
            return self.store

        async def tasks(namespace: str) -> Any:
            if namespace != NAMESPACE:
                raise LookupError(namespace)
            return admin

        async def allow(request: Request, action: str, namespace: str) -> bool:
            return True

        app = create_admin_app(authorize=allow, stores=stores, tasks=tasks, csrf_token=CSRF)
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://admin"
        )

    async def close(self) -> None:
        await self.http.aclose()
        await self.store.close()
        await self.pool.close()

    async def snapshot(self) -> tuple[Any, ...]:
        """Every row a route could change (the namespace's recorded time aside)."""
        s = self.schema
        row = await self.pool.fetchrow(
            f"""SELECT
              (SELECT count(*) FROM "{s}".recurring_definitions),
              (SELECT string_agg(name || '/' || state, ',' ORDER BY name)
                 FROM "{s}".recurring_definitions),
              (SELECT count(*) FROM "{s}".recurring_occurrences),
              (SELECT string_agg(id || '/' || state || '/' || attempts, ',' ORDER BY id)
                 FROM "{s}".recurring_occurrences),
              (SELECT count(*) FROM "{s}".tasks),
              (SELECT string_agg(id || '/' || state, ',' ORDER BY id) FROM "{s}".tasks),
              (SELECT string_agg(name || '/' || paused || '/' || cron, ',' ORDER BY name)
                 FROM "{s}".jobs),
              (SELECT string_agg(scope || '/' || name || '/' || paused, ',' ORDER BY name)
                 FROM "{s}".settings)"""
        )
        assert row is not None
        return tuple(row)

    async def check(self, case: Case) -> None:
        before = await self.snapshot()
        headers = {"content-type": "application/json", CSRF_HEADER: CSRF}
        # ASCII-only URL: the percent-escapes are the request's exact bytes.
        response = await self.http.request(
            case.method, case.target, content=case.body, headers=headers
        )
        after = await self.snapshot()
        status = response.status_code
        assert status < 500, (case, status, response.text[:300])
        if not (case.may_read and status == 200):
            assert 400 <= status < 500, (case, status, response.text[:300])
            if response.headers["content-type"].startswith("text/html"):
                # a page for a browser: the friendly error page, with the reason
                assert '<p class="detail">' in response.text, (case, response.text[:300])
                assert "<script" not in response.text
                return
            reason = response.json()
            assert isinstance(reason.get("detail"), str), (case, reason)
            assert "\n" not in reason["detail"]
            assert len(reason["detail"]) <= 300
        assert after == before, case
        assert response.headers.get("x-frame-options") == "DENY", case
        assert "default-src 'self'" in response.headers.get("content-security-policy", "")


def run_cases(seeded: Any, drive: Callable[[Harness, asyncio.Runner], None]) -> None:
    harness = Harness(seeded)
    with asyncio.Runner() as runner:
        runner.run(harness.open())
        try:
            drive(harness, runner)
        finally:
            runner.run(harness.close())


@pytest.mark.postgres
def test_every_curated_hostile_value_in_every_slot_is_refused(seeded: Any) -> None:
    curated = every_curated_case()
    assert len(curated) > 1_000

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def sweep() -> None:
            for case in curated:
                await harness.check(case)

        runner.run(sweep())

    run_cases(seeded, drive)


@pytest.mark.postgres
def test_generated_hostile_requests_are_refused(seeded: Any) -> None:
    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        @settings(
            max_examples=300,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=cases())
        def check(case: Case) -> None:
            runner.run(harness.check(case))

        check()

    run_cases(seeded, drive)


# --- the regressions issue 10 names, each pinned on its own ------------------------------


@pytest.mark.postgres
def test_the_reported_faults_are_client_errors(seeded: Any) -> None:
    """Nested JSON and overflowing cursors answered 500; NUL answered 503 "unavailable"."""
    expected = [
        (raw_case("schedules/cancel", ("[" * 10_000).encode()), 400),
        (body_case("schedules/cancel", "name", DEEP_FITTING), 400),
        (query_case("occurrences", "after", "999999999999999." + "a" * 32), 422),
        (query_case("tasks", "after", "9" * 25), 422),
        (task_path_case("9" * 25), 422),
        (body_case("tasks/cancel", "task_id", 2**64), 422),
        (body_case("schedules/cancel", "name", "a\x00b"), 422),
        (query_case("schedules", "after", "a\x00b"), 422),
        (query_case("occurrences", "after", "000000000000001.a\x00"), 422),
        (body_case("occurrences/retry", "occurrence_id", "\x00"), 422),
        (body_case("schedules/cancel", "name", "\ud800"), 422),
        (body_case("schedules/cancel", "name", "x" * 10_240), 422),
        (body_case("occurrences/purge", "older_than_seconds", float("nan")), 400),
        (body_case("schedules/cancel", "name", 5), 400),
        (body_case("schedules/cancel", "name", "no-such-schedule"), 404),
    ]

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            for case, status in expected:
                response = await harness.http.request(
                    case.method,
                    case.target,
                    content=case.body,
                    headers={"content-type": "application/json", CSRF_HEADER: CSRF},
                )
                assert response.status_code == status, (case, response.text[:300])
                await harness.check(case)

        runner.run(go())

    run_cases(seeded, drive)


# --- the body limit is enforced while the body streams in --------------------------------


class Untouchable:
    """A store/task provider that fails the test if a refused request ever reached it."""

    calls = 0

    async def __call__(self, namespace: str) -> Any:
        self.calls += 1
        raise AssertionError("a refused request reached the store")


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": f"/api/{NAMESPACE}/schedules/cancel",
        "raw_path": f"/api/{NAMESPACE}/schedules/cancel".encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"admin"),
            (b"content-type", b"application/json"),
            (CSRF_HEADER.lower().encode(), CSRF.encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("admin", 80),
    }


class Stream:
    """An instrumented ASGI receive channel: a 100 MB body in 64 KiB chunks, counted."""

    CHUNK = 64 * 1024
    TOTAL = 100 * 1024 * 1024

    def __init__(self) -> None:
        self.sent = 0
        self.calls = 0

    async def receive(self) -> dict[str, Any]:
        self.calls += 1
        if self.sent >= self.TOTAL:
            return {"type": "http.disconnect"}
        self.sent += self.CHUNK
        return {
            "type": "http.request",
            "body": b" " * self.CHUNK,
            "more_body": self.sent < self.TOTAL,
        }


async def _call(
    headers: list[tuple[bytes, bytes]], stream: Stream
) -> tuple[int, dict[bytes, bytes], bytes]:
    provider = Untouchable()

    async def allow(request: Request, action: str, namespace: str) -> bool:
        return True

    app = create_admin_app(authorize=allow, stores=provider, csrf_token=CSRF)
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    await app(_scope(headers), stream.receive, send)
    assert provider.calls == 0
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


async def test_a_streamed_100_mb_body_is_refused_after_limit_plus_one_chunk() -> None:
    stream = Stream()
    status, headers, body = await _call([(b"transfer-encoding", b"chunked")], stream)
    assert status == 413
    assert json.loads(body)["error"] == "too_large"
    assert stream.sent <= MAX_BODY_BYTES + Stream.CHUNK
    assert stream.sent < Stream.TOTAL
    assert headers[b"x-frame-options"] == b"DENY"


async def test_a_declared_oversized_body_is_refused_before_reading() -> None:
    stream = Stream()
    status, headers, _ = await _call([(b"content-length", str(Stream.TOTAL).encode())], stream)
    assert status == 413
    assert stream.calls == 0
    assert headers[b"cache-control"] == b"no-store"
    for bad in (b"-1", b"1e9", b"12abc", b"9" * 40):
        stream = Stream()
        status, _, _ = await _call([(b"content-length", bad)], stream)
        assert status in (400, 413), bad
        assert stream.calls == 0


async def test_a_body_at_the_limit_is_read() -> None:
    """Exactly MAX_BODY_BYTES of (padded) JSON is parsed: the limit is not off by one."""
    name = "no-such-schedule"
    text = json.dumps({"name": name})
    padded = text[:-1] + " " * (MAX_BODY_BYTES - len(text)) + "}"
    assert len(padded) == MAX_BODY_BYTES
    seen: list[str] = []

    class Store:
        async def cancel(self, value: str) -> Any:
            seen.append(value)
            from steeple.core import RecurringNotFoundError

            raise RecurringNotFoundError("no such definition")

    async def stores(namespace: str) -> Any:
        return Store()

    async def allow(request: Request, action: str, namespace: str) -> bool:
        return True

    app = create_admin_app(authorize=allow, stores=stores, csrf_token=CSRF)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://admin"
    ) as http:
        headers = {"content-type": "application/json", CSRF_HEADER: CSRF}
        fits = await http.post(
            f"/api/{NAMESPACE}/schedules/cancel", content=padded, headers=headers
        )
        over = await http.post(
            f"/api/{NAMESPACE}/schedules/cancel", content=padded + " ", headers=headers
        )
    assert fits.status_code == 404
    assert seen == [name]
    assert over.status_code == 413


# --- the dashboard's filters: any value is a page, never a 5xx -------------------------------


@pytest.mark.postgres
def test_hostile_filters_answer_a_page_or_a_refusal_and_change_nothing(seeded: Any) -> None:
    """A filter value may be a valid read (a task name can be "2024-01-01"): never a 5xx."""
    slots = [
        (path, name)
        for path in ("/ui/ops/tasks", "/api/ops/tasks")
        for name in ("state", "name", "since", "until", "after", "newest", "queue")
    ] + [("/ui/ops/tasks", "id")]
    strings = [v for v in HOSTILE if isinstance(v, str)] + [
        "2026-02-30",
        "9999-12-31T23:59:59",
        "0001-01-01T00:00:00+05:00",
        "9999-12-31T23:59:59-05:00",
    ]

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            before = await harness.snapshot()
            for path, name in slots:
                for value in strings:
                    target = f"{path}?{name}={escape(value)}"
                    response = await harness.http.get(target)
                    status = response.status_code
                    assert status < 500, (target, status, response.text[:300])
                    assert status in (200, 303, 400, 404, 422), (target, status)
                    page = path.startswith("/ui/")
                    kind = response.headers.get("content-type", "")
                    if page and status != 303:
                        assert kind.startswith("text/html"), (target, kind)
                    if page and status >= 400:
                        assert '<p class="detail">' in response.text
                    if not page:
                        assert kind.startswith("application/json"), (target, kind)
            assert await harness.snapshot() == before

        runner.run(go())

    run_cases(seeded, drive)


@pytest.mark.postgres
def test_queue_pause_refuses_names_no_queue_can_have(seeded: Any) -> None:
    """Any name a queue may have can be paused ahead of its first task; others are refused."""
    refused: list[object] = ["", "\x00", "a\x00b", "\ud800", "x" * 10_240, 5, None, [], {}]

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            headers = {"content-type": "application/json", CSRF_HEADER: CSRF}
            for route in ("queues/pause", "queues/resume"):
                for value in refused:
                    await harness.check(body_case(route, "queue", value))
            paused = await harness.http.post(
                f"/api/{NAMESPACE}/queues/pause", json={"queue": "later"}, headers=headers
            )
            assert paused.status_code == 200
            assert paused.json()["paused"] is True
            resumed = await harness.http.post(
                f"/api/{NAMESPACE}/queues/resume", json={"queue": "later"}, headers=headers
            )
            assert resumed.json()["paused"] is False

        runner.run(go())

    run_cases(seeded, drive)


# --- what the dashboard and the API show of a failure quoting the worker's DSN --------------


@pytest.mark.postgres
def test_a_failure_quoting_the_worker_dsn_shows_no_password(seeded: Any) -> None:
    """The attempts API, the task API and the dashboard pages show what the worker stored:
    a handler's error quoting the worker's own DSN arrives there with its password masked."""
    from urllib.parse import urlsplit

    from steeple.postgres.queue import JobContext, Scheduler, Task, enqueue, run_state

    parts = urlsplit(seeded.dsn)
    password = "Pw-dashboard-55810"
    worker_dsn = (
        f"postgresql://{parts.username or 'postgres'}:{password}@{parts.hostname}:"
        f"{parts.port or 5432}{parts.path}"
    )
    task: Task[Any] = Task("leaky-dashboard")

    async def handle(ctx: JobContext, args: Any) -> None:
        raise ConnectionError(f"could not reach {worker_dsn} (password={password})")

    async def fail_once(harness: Harness) -> int:
        task_id = (await enqueue(harness.pool, task, None, schema=harness.schema)).id
        worker = Scheduler(
            worker_dsn, worker_id="dash-w", schema=harness.schema, poll_interval=0.05
        )
        worker.register(task, handle)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run_until_shutdown(stop))
        try:
            for _ in range(1500):  # until the failure is stored (or the worker ended)
                run = await run_state(harness.pool, task_id, schema=harness.schema)
                if run.state.value == "failed" or running.done():
                    break
                await asyncio.sleep(0.02)
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        assert run.state.value == "failed"
        return int(task_id)

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            task_id = await fail_once(harness)
            for target in (
                f"/api/{NAMESPACE}/tasks/{task_id}/attempts",
                f"/api/{NAMESPACE}/tasks/{task_id}",
                f"/api/{NAMESPACE}/tasks",
                f"/ui/{NAMESPACE}/tasks/{task_id}",
                f"/ui/{NAMESPACE}/tasks",
            ):
                response = await harness.http.get(target)
                assert response.status_code == 200, (target, response.text[:300])
                assert password not in response.text, target
                assert "could not reach" in response.text, target
            attempts = (await harness.http.get(f"/api/{NAMESPACE}/tasks/{task_id}/attempts")).json()
            (attempt,) = attempts["items"]
            assert "***" in attempt["error"]
            assert "in handle" in attempt["traceback"]

        runner.run(go())

    run_cases(seeded, drive)


# --- names: exact, by the library's one rule ------------------------------------------------

LOOKALIKE_NAMES = [
    "mail\u200b",
    "\u202eliame-dnes",
    " mail",
    "mail ",
    "   ",
    "mail\u2028",
    "\ufeffmail",
    "\u3164",
]
"""Names that look like "mail" (or like no name): each refused where a name is read."""


def name_cases(value: str) -> list[Case]:
    q = escape(value)
    cron = "* * * * *"
    bodies: list[tuple[str, dict[str, object]]] = [
        ("tasks/bulk-cancel", {"queue": value}),
        ("tasks/bulk-cancel", {"name": value}),
        ("tasks/bulk-retry", {"queue": value}),
        ("tasks/bulk-retry", {"name": value}),
        ("queues/pause", {"queue": value}),
        ("queues/resume", {"queue": value}),
        ("jobs/pause", {"name": value}),
        ("jobs/resume", {"name": value}),
        ("jobs/delete", {"name": value}),
        ("jobs/reschedule", {"name": value, "cron": cron}),
        ("jobs/create", {"name": value, "task": "mail", "cron": cron, "args": {}}),
        ("jobs/create", {"name": "mail-job", "task": value, "cron": cron, "args": {}}),
    ]
    return [
        Case("GET", f"/api/{NAMESPACE}/tasks?queue={q}"),
        Case("GET", f"/api/{NAMESPACE}/tasks?name={q}"),
        Case("GET", f"/ui/{NAMESPACE}/tasks?queue={q}"),
        Case("GET", f"/ui/{NAMESPACE}/tasks?name={q}"),
        *(
            Case("POST", f"/api/{NAMESPACE}/{route}", json.dumps(body).encode())
            for route, body in bodies
        ),
    ]


@pytest.mark.postgres
def test_lookalike_names_are_refused_in_every_name_slot(seeded: Any) -> None:
    """Filters, bulk actions, queue and job actions refuse a name the library would not
    store, with a 422 and one line; nothing changes (no trimming turns " mail" into
    "mail", and a blank queue does not select every task)."""
    from steeple.postgres.queue import EnqueueOptions, Task, enqueue

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            mail: Task[Any] = Task("mail")
            await enqueue(
                harness.pool, mail, {}, EnqueueOptions(queue="mail"), schema=harness.schema
            )
            for value in LOOKALIKE_NAMES:
                for case in name_cases(value):
                    await harness.check(case)
                    response = await harness.http.request(
                        case.method,
                        case.target,
                        content=case.body,
                        headers={"content-type": "application/json", CSRF_HEADER: CSRF},
                    )
                    assert response.status_code == 422, (case, response.text[:300])

        runner.run(go())

    run_cases(seeded, drive)


@pytest.mark.postgres
def test_a_filter_on_a_padded_name_does_not_act_on_the_name(seeded: Any) -> None:
    """A bulk cancel filtered on queue " mail" (or task " mail") neither previews nor
    cancels the tasks of "mail"; the exact name does."""
    from steeple.postgres.queue import EnqueueOptions, Task, enqueue, run_state

    def drive(harness: Harness, runner: asyncio.Runner) -> None:
        async def go() -> None:
            headers = {"content-type": "application/json", CSRF_HEADER: CSRF}
            mail: Task[Any] = Task("mail")
            task_id = (
                await enqueue(
                    harness.pool, mail, {}, EnqueueOptions(queue="mail"), schema=harness.schema
                )
            ).id

            async def preview(body: dict[str, str]) -> httpx.Response:
                return await harness.http.post(
                    f"/api/{NAMESPACE}/tasks/bulk-cancel", json=body, headers=headers
                )

            for body in ({"queue": " mail"}, {"name": " mail"}, {"queue": "   "}):
                refused = await preview(body)
                assert refused.status_code == 422, (body, refused.text)
                detail = refused.json()["detail"]
                assert any(w in detail for w in ("whitespace", "blank", "empty")), detail
            listed = await harness.http.get(f"/api/{NAMESPACE}/tasks?queue=%20mail")
            assert listed.status_code == 422
            exact = await preview({"queue": "mail"})
            assert exact.status_code == 200
            assert exact.json()["task_ids"] == [task_id]
            run = await run_state(harness.pool, task_id, schema=harness.schema)
            assert run.state.value == "pending"

        runner.run(go())

    run_cases(seeded, drive)
