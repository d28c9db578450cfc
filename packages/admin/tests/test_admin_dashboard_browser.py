"""The dashboard in a real browser: Selenium drives Debian's chromium through chromium-driver.

Every action is clicked as a person would (the button, then the page's confirmation), and
its effect is read back from the database; every page is screenshotted into ``tmp_path``
and the screenshot checked for content (colours the page must show) beside its text.
Without chromium and chromium-driver the tests skip, except under CI (``CI=true``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import attrs
import pytest
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from steeple.admin import create_admin_app
from steeple.admin.queue_admin import PostgresTaskAdmin
from steeple.core import RecurringConfig, SystemClock
from steeple.keyring import Keyring, StorageKey
from steeple.postgres import PostgresRecurringStore

pytestmark = pytest.mark.postgres

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}
CSRF = "csrf-token-for-the-browser-0123"
WIDTH, HEIGHT = 1100, 760
# Colours of admin.css the screenshots must show.
HEADER = (0x1D, 0x23, 0x30)
PENDING = (0x6B, 0x72, 0x80)
FAILED = (0xB4, 0x23, 0x18)
CANCELLED = (0x9A, 0x67, 0x00)
SUCCEEDED = (0x15, 0x80, 0x3D)
T = TypeVar("T")


def _binaries() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser and driver:
        return browser, driver
    if IN_CI:
        pytest.fail("chromium and chromium-driver are not installed; under CI=true that fails")
    pytest.skip("chromium and chromium-driver are not installed (apt-get install them)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module (starting one costs about two seconds)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _binaries()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--window-size={WIDTH},{HEIGHT}",
    ):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


class _Lifespan:
    """Open the store and the task pool in the server's own event loop; close them there."""

    def __init__(self, seeded: Any, **app_options: Any) -> None:
        self.seeded = seeded
        self.options = app_options
        self.store: Any = None
        self.pool: Any = None
        self.app: ASGIApp | None = None

    async def open(self) -> None:
        key_id, _, material = self.seeded.keys.partition(":")
        self.pool = await asyncpg.create_pool(self.seeded.dsn, min_size=1, max_size=2)
        admin = PostgresTaskAdmin(self.pool, self.seeded.schema)

        async def tasks(namespace: str) -> Any:
            if namespace != "ops":
                raise LookupError(namespace)
            return admin

        stores = None
        if self.options.pop("recurring", True):
            self.store = await PostgresRecurringStore.connect(
                self.seeded.dsn,
                RecurringConfig("ops", 1000, 100_000),
                Keyring(StorageKey.from_base64(key_id, material)),
                SystemClock(),
                schema=self.seeded.schema,
            )

            async def stores(namespace: str) -> Any:
                if namespace != "ops":
                    raise LookupError(namespace)
                return self.store

        async def authorize(request: Request, action: str, namespace: str) -> bool:
            # The host's decision: this test host refuses one namespace outright.
            return namespace != "secret"

        self.app = create_admin_app(
            authorize=authorize,
            stores=stores,
            tasks=tasks,
            csrf_token=CSRF,
            namespaces=("ops",),
            **self.options,
        )

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
        if self.pool is not None:
            await self.pool.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await self.open()
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert self.app is not None
        await self.app(scope, receive, send)


@attrs.frozen
class Site:
    """The dashboard served on a local port, over the seeded namespace."""

    url: str
    seeded: Any

    def page(self, path: str = "") -> str:
        return f"{self.url}/ui/ops{path}"

    def query(self, sql: str, *args: Any) -> list[Any]:
        """Run one statement on the test database (``{s}`` is the schema)."""

        async def run() -> list[Any]:
            conn = await asyncpg.connect(self.seeded.dsn)
            try:
                return list(await conn.fetch(sql.replace("{s}", f'"{self.seeded.schema}"'), *args))
            finally:
                await conn.close()

        return asyncio.run(run())

    def value(self, sql: str, *args: Any) -> Any:
        rows = self.query(sql, *args)
        return rows[0][0] if rows else None


@contextlib.contextmanager
def serve(seeded: Any, **options: Any) -> Iterator[Site]:
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = _Lifespan(seeded, **options)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, "the server to start")
        yield Site(f"http://127.0.0.1:{port}", seeded)
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@pytest.fixture
def site(seeded: Any) -> Iterator[Site]:
    with serve(seeded, reveal_args=("bulk-a",), refresh_seconds=600) as served:
        yield served


def until(check: Callable[[], T], what: str, timeout: float = 15) -> T:
    """Poll ``check`` until it answers truthy (state, not time: the deadline is a backstop).

    An element a live refresh replaced while ``check`` read it counts as not yet.
    """
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        threading.Event().wait(0.05)


# --- data the pages show ---------------------------------------------------------------------


def enqueue(
    site: Site, name: str, count: int, args: object = None, queue_name: str | None = None
) -> list[int]:
    from steeple.postgres import queue

    named = queue_name

    async def run() -> list[int]:
        conn = await asyncpg.connect(site.seeded.dsn)
        try:
            task: queue.Task[Any] = queue.Task(name)
            ids = []
            for n in range(count):
                enqueued = await queue.enqueue(
                    conn,
                    task,
                    {"n": n} if args is None else args,
                    queue.EnqueueOptions.immediate(),
                    schema=site.seeded.schema,
                    queue=named,
                )
                ids.append(enqueued.id)
            return ids
        finally:
            await conn.close()

    return asyncio.run(run())


def fail(site: Site, name: str, error: str) -> int:
    """Enqueue a task and fail it for good, as a worker whose handler raised would."""
    from steeple.postgres.queue._sql import queue_sql

    (task_id,) = enqueue(site, name, 1)
    sql = queue_sql(site.seeded.schema)

    async def run() -> None:
        conn = await asyncpg.connect(site.seeded.dsn)
        try:
            give_up = await conn.fetchval(
                "SELECT extract(epoch FROM clock_timestamp())::double precision + 60"
            )
            (row,) = await conn.fetch(sql.claim, [name], 1, "worker-7", give_up)
            assert row["id"] == task_id
            assert await conn.fetch(
                sql.fail, task_id, row["lease_token"], error, "worker-7", None, None, None
            )
        finally:
            await conn.close()

    asyncio.run(run())
    return task_id


def run_worker(site: Site, handlers: dict[str, Any], ids: list[int]) -> None:
    """Run a real worker with ``handlers`` until the tasks ``ids`` are finished."""
    from steeple.postgres import queue

    async def run() -> None:
        worker = queue.Scheduler(
            site.seeded.dsn,
            worker_id="dash-worker",
            schema=site.seeded.schema,
            poll_interval=0.05,
            maintenance_interval=0.05,
        )
        for name, handler in handlers.items():
            task: queue.Task[Any] = queue.Task(name)
            worker.register(task, handler)
        stop = asyncio.Event()
        running = asyncio.create_task(worker.run_until_shutdown(stop, drain_timeout=10))
        conn = await asyncpg.connect(site.seeded.dsn)
        try:
            for _ in range(600):
                states = await conn.fetch(
                    f'SELECT state FROM "{site.seeded.schema}".tasks WHERE id = ANY($1::bigint[])',
                    ids,
                )
                if all(r["state"] in ("succeeded", "failed") for r in states) or running.done():
                    break
                await asyncio.sleep(0.05)  # polling the rows' state (bounded: 30 s)
        finally:
            await conn.close()
            stop.set()
            await asyncio.wait_for(running, 30)

    asyncio.run(run())


def task_state(site: Site, task_id: int) -> str:
    return str(site.value("SELECT state FROM {s}.tasks WHERE id = $1", task_id))


# --- the browser, as a person uses it --------------------------------------------------------


def by_css(driver: Any, selector: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, selector)


def all_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def texts(driver: Any, selector: str) -> list[str]:
    """The text of every element ``selector`` matches, read at once (a refresh may follow)."""
    script = "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent)"
    return [str(t) for t in driver.execute_script(script, selector)]


def open_page(driver: Any, url: str) -> None:
    driver.get(url)
    until(lambda: driver.execute_script("return document.readyState") == "complete", url)


def click(driver: Any, selector: str) -> None:
    """Click what ``selector`` finds; found again if a live refresh replaced it meanwhile."""

    def attempt() -> bool:
        by_css(driver, selector).click()
        return True

    until(attempt, f"a click on {selector}")


def click_action(driver: Any, selector: str, fields: dict[str, str] | None = None) -> str:
    """Click an action button, fill the confirmation's fields, confirm; return its question."""
    click(driver, selector)
    until(lambda: by_css(driver, "#confirm").get_attribute("open") is not None, "the dialog")
    question = str(by_css(driver, "#confirm-text").text)
    for name, value in (fields or {}).items():
        box = by_css(driver, f"#confirm-field-{name}")
        box.clear()
        box.send_keys(value)
    by_css(driver, "#confirm-ok").click()
    return question


def flash(driver: Any) -> str:
    return str(until(lambda: by_css(driver, "#flash").text, "the outcome message"))


def screenshot(
    driver: Any, path: Path, *colours: tuple[int, int, int], part: str | None = None
) -> None:
    """Save a screenshot (of the page, or of the element ``part`` selects); check it is not
    blank and shows each of ``colours`` somewhere."""
    from PIL import Image

    if part is None:
        driver.execute_script("window.scrollTo(0, 0)")  # a click may have scrolled the page
        driver.save_screenshot(str(path))
    else:
        element = by_css(driver, part)
        driver.execute_script("arguments[0].scrollIntoView()", element)
        path.write_bytes(element.screenshot_as_png)
    image = Image.open(io.BytesIO(path.read_bytes())).convert("RGB")
    found = {
        tuple(rgb) for _, rgb in image.getcolors(maxcolors=1 << 20) or [] if isinstance(rgb, tuple)
    }
    assert len(found) > 20, f"{path.name} looks blank ({len(found)} colours)"
    if part is None:
        assert image.getpixel((5, 5)) == HEADER, f"{path.name}: no header band (stylesheet?)"
    for colour in colours:
        assert colour in found, f"{path.name} shows no {colour}"


# --- the tests -------------------------------------------------------------------------------


def test_overview_counts_chart_and_modes(browser: Any, site: Site, tmp_path: Path) -> None:
    fail(site, "report", "boom")
    site.query("UPDATE {s}.tasks SET state = 'cancelled', finished_at = clock_timestamp() "
               "WHERE id = $1", site.seeded.task_ids[0])  # fmt: skip
    open_page(browser, site.page())
    counts = {
        card.find_element("css selector", ".label").text: int(
            card.find_element("css selector", ".n").text
        )
        for card in all_css(browser, "#counts .card")
    }
    assert counts == {
        "waiting": 0,
        "pending": 2,
        "running": 0,
        "succeeded": 0,
        "failed": 1,
        "cancelled": 1,
    }
    # The chart is drawn by the page's own script: one bar per state that finished.
    bars = until(lambda: all_css(browser, "#throughput svg rect"), "the chart")
    assert {b.get_attribute("class") for b in bars} == {"bar state-failed", "bar state-cancelled"}
    text = browser.find_element("css selector", "body").text
    assert "work queue + recurring publications" in text
    assert "all times UTC" in text
    assert len(all_css(browser, "#schedules tr.row.schedule")) == 2
    screenshot(browser, tmp_path / "overview.png", FAILED, CANCELLED, PENDING)


def test_task_list_filters_search_pages_and_actions(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from selenium.webdriver.support.ui import Select

    bulk = enqueue(site, "bulk-a", 55)
    failed = fail(site, "report", "boom: the first failure")
    open_page(browser, site.page("/tasks"))
    rows = all_css(browser, "#tasks tr.row.task")
    assert len(rows) == 50  # newest first, one page
    assert rows[0].find_element("css selector", "a").text == str(failed)
    screenshot(browser, tmp_path / "tasks.png", FAILED, PENDING)
    by_css(browser, "#older").click()
    until(lambda: "after=" in browser.current_url, "the older page")
    older = texts(browser, "tr.row.task a")
    assert older == [str(i) for i in sorted([*site.seeded.task_ids, *bulk], reverse=True)[49:]]

    # Filter by state: only the failed task; retry it from its row.
    open_page(browser, site.page("/tasks"))
    Select(by_css(browser, "select[name=state]")).select_by_value("failed")
    by_css(browser, "#apply-filters").click()
    until(lambda: "state=failed" in browser.current_url, "the filtered list")
    assert len(all_css(browser, "tr.row.task")) == 1
    assert "Retry failed task" in click_action(browser, 'button[data-action="tasks/retry"]')
    until(lambda: task_state(site, failed) == "pending", "the retry")
    # What happened, in words (never the API path it took).
    assert f"task {failed} (report) is pending again" in flash(browser)
    # The list refreshes in place: the retried task is no longer failed.
    until(lambda: not all_css(browser, "tr.row.task"), "the refreshed list")

    # Filter by name and a time range; a range in the future selects nothing.
    open_page(browser, site.page("/tasks?name=bulk-a&since=2999-01-01"))
    assert by_css(browser, "td.empty").text == "none"
    open_page(browser, site.page("/tasks?name=bulk-a&since=2000-01-01+00:00"))
    assert len(all_css(browser, "tr.row.task")) == 50
    assert "older" in by_css(browser, "nav.pager").text

    # Bulk cancel the filtered set: listed first, confirmed, then done (bounded at 100).
    question = click_action(browser, 'button[data-action="tasks/bulk-cancel"]')
    assert question.startswith("Cancel 55 tasks")
    until(
        lambda: (
            site.value(
                "SELECT count(*) FROM {s}.tasks WHERE task_name = 'bulk-a' AND state = 'cancelled'"
            )
            == 55
        ),
        "the bulk cancel",
    )
    assert "cancelled 55 tasks" in flash(browser)
    until(lambda: len(all_css(browser, "span.state-cancelled")) == 50, "the refreshed rows")

    # Bulk retry of failed tasks.
    again = [fail(site, "flaky", f"boom {n}") for n in range(3)]
    open_page(browser, site.page("/tasks?state=failed"))
    question = click_action(browser, 'button[data-action="tasks/bulk-retry"]')
    assert question.startswith("Retry 3 tasks")
    until(lambda: all(task_state(site, t) == "pending" for t in again), "the bulk retry")
    assert "retried 3 tasks" in flash(browser)

    # Cancel one task from its row.
    (single,) = enqueue(site, "single", 1)
    open_page(browser, site.page("/tasks?name=single"))
    click_action(browser, 'button[data-action="tasks/cancel"]')
    until(lambda: task_state(site, single) == "cancelled", "the cancel")

    # Search by id opens the task's page; an unknown id is a friendly 404 page.
    open_page(browser, site.page("/tasks"))
    by_css(browser, "input[name=id]").send_keys(str(single))
    by_css(browser, "#search-id").click()
    until(lambda: browser.current_url.endswith(f"/tasks/{single}"), "the task page")
    open_page(browser, site.page("/tasks?id=999999"))
    assert "404 · Not found" in by_css(browser, "h2.title").text

    # Purge finished tasks older than 0 days (the confirmation asks how old).
    click_purge = 'button[data-action="tasks/purge"]'
    open_page(browser, site.page("/tasks"))
    assert "Delete finished tasks" in click_action(browser, click_purge, {"older_than_days": "0"})
    until(lambda: task_state(site, single) == "None", "the purge")


def test_queues_pause_resume_and_filter(browser: Any, site: Site, tmp_path: Path) -> None:
    def paused() -> Any:
        return site.value(
            "SELECT paused FROM {s}.settings WHERE scope = 'queue' AND name = 'emails'"
        )

    mails = enqueue(site, "send-mail", 2, queue_name="emails")
    open_page(browser, site.page())
    assert texts(browser, "#queues tr.row.queue a") == ["default", "emails"]
    counts = texts(browser, "#queues tr.row.queue td:nth-child(3)")
    assert counts == [str(len(site.seeded.task_ids)), "2"]  # pending per queue
    assert "Pause queue emails" in click_action(
        browser, 'button[data-action="queues/pause"][data-body=\'{"queue": "emails"}\']'
    )
    until(lambda: paused() is True, "the pause")
    until(lambda: all_css(browser, 'button[data-action="queues/resume"]'), "the resume button")
    screenshot(browser, tmp_path / "overview.png")
    screenshot(browser, tmp_path / "queues.png", CANCELLED, part="#queues")  # paused badge
    click_action(browser, 'button[data-action="queues/resume"]')
    until(lambda: paused() is None, "the resume (a queue without settings has no row)")
    # The queue's link opens the task list filtered by queue.
    click(browser, "#queues a[href*='queue=emails']")
    until(lambda: "queue=emails" in browser.current_url, "the filtered list")
    assert texts(browser, "tr.row.task a") == [str(i) for i in reversed(mails)]
    assert by_css(browser, "input[name=queue]").get_attribute("value") == "emails"


def test_the_queue_list_shows_per_key_limits(browser: Any, site: Site) -> None:
    from steeple.postgres import queue

    async def limit() -> None:
        conn = await asyncpg.connect(site.seeded.dsn)
        try:
            await queue.limit_queue(
                conn,
                "imports",
                max_running_per_key=1,
                rate_limit_per_key=10,
                per_key=1.0,
                schema=site.seeded.schema,
            )
        finally:
            await conn.close()

    asyncio.run(limit())
    open_page(browser, site.page())
    rows = {r.text.split()[0]: r.text for r in all_css(browser, "#queues tr.row.queue")}
    assert "at most 1 running per key" in rows["imports"]
    assert "10 starts per key per 1 s" in rows["imports"]


def test_task_page_attempts_args_and_timings(browser: Any, site: Site, tmp_path: Path) -> None:
    failed = fail(site, "report", "Traceback (most recent call last):\n  ValueError: bad row 7")
    open_page(browser, site.page(f"/tasks/{failed}"))
    detail = by_css(browser, "dl.detail").text
    assert "failed" in detail
    assert "1, not retried (4 of its 5 attempts unused)" in detail
    assert "worker-7" in detail
    assert "last run took" in detail
    attempts = all_css(browser, "tr.row.attempt")
    assert len(attempts) == 1
    assert "ValueError: bad row 7" in attempts[0].text
    # Args are hidden for a task name the host did not opt in.
    assert "args can hold secrets" in by_css(browser, "#args-hidden").text
    assert '"n"' not in browser.page_source
    screenshot(browser, tmp_path / "task.png", FAILED)
    # Retry from the task page.
    click_action(browser, 'button[data-action="tasks/retry"]')
    until(lambda: task_state(site, failed) == "pending", "the retry")
    until(lambda: "pending" in by_css(browser, "dl.detail").text, "the refreshed state")

    # An opted-in name: shown on request only.
    (shown,) = enqueue(site, "bulk-a", 1, {"invoice": 42})
    open_page(browser, site.page(f"/tasks/{shown}"))
    assert by_css(browser, "#args-text").get_attribute("hidden") is not None
    by_css(browser, "#reveal-args").click()
    until(lambda: by_css(browser, "#args-text").is_displayed(), "the args")
    assert '"invoice": 42' in by_css(browser, "#args-text").text
    screenshot(browser, tmp_path / "task-args.png", PENDING)


def enqueue_workflow(site: Site) -> list[int]:
    """A workflow of four tasks whose first succeeded and second failed for good."""
    from steeple.postgres import queue
    from steeple.postgres._arrays import array_literal
    from steeple.postgres.queue._sql import queue_sql

    async def run() -> list[int]:
        conn = await asyncpg.connect(site.seeded.dsn)
        schema = site.seeded.schema
        try:
            wf = queue.Workflow()
            first = wf.add(queue.Task("wf-fetch"), {})
            parse = wf.add(
                queue.Task("wf-parse"), {}, queue.EnqueueOptions(max_attempts=1), after=[first]
            )
            index = wf.add(queue.Task("wf-index"), {}, after=[first])
            wf.add(queue.Task("wf-report"), {}, after=[parse, index], on_parent_failure="run")
            handle = await queue.enqueue_workflow(conn, wf, schema=schema)
            sql = queue_sql(schema)
            for name, outcome in (("wf-fetch", "complete"), ("wf-parse", "fail")):
                give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
                (row,) = await conn.fetch(sql.claim, [name], 1, "w", give_up)
                token = row["lease_token"]
                if outcome == "complete":
                    await conn.fetch(
                        sql.complete,
                        array_literal([row["id"]]),
                        array_literal([token]),
                        "w",
                        [None],
                        [None],
                    )
                else:
                    await conn.fetch(sql.fail, row["id"], token, "boom", "w", None, None, None)
            return list(handle.ids)
        finally:
            await conn.close()

    return asyncio.run(run())


def test_workflow_page_draws_the_graph_with_each_tasks_state(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    ids = enqueue_workflow(site)
    open_page(browser, site.page(f"/workflows/{ids[3]}"))
    nodes = until(lambda: all_css(browser, "figure.graph g.node"), "the drawn graph")
    drawn = {int(n.get_attribute("data-task")): n.get_attribute("data-state") for n in nodes}
    assert drawn == {ids[0]: "succeeded", ids[1]: "failed", ids[2]: "pending", ids[3]: "waiting"}
    edges = {
        (int(e.get_attribute("data-from")), int(e.get_attribute("data-to")))
        for e in all_css(browser, "figure.graph path.edge")
    }
    assert edges == {(ids[0], ids[1]), (ids[0], ids[2]), (ids[1], ids[3]), (ids[2], ids[3])}
    # Columns by depth: the report is right of both tasks it waits for.
    x = {
        int(n.get_attribute("data-task")): float(
            n.find_element("css selector", "rect").get_attribute("x")
        )
        for n in nodes
    }
    assert x[ids[0]] < x[ids[1]] == x[ids[2]] < x[ids[3]]
    rows = all_css(browser, "tr.row.workflow-task")
    assert [r.text.split()[:3] for r in rows] == [
        [str(ids[0]), "wf-fetch", "succeeded"],
        [str(ids[1]), "wf-parse", "failed"],
        [str(ids[2]), "wf-index", "pending"],
        [str(ids[3]), "wf-report", "waiting"],
    ]
    screenshot(browser, tmp_path / "workflow.png", SUCCEEDED, FAILED, part="figure.graph")
    # No CDN: every script and stylesheet the page loads is the app's own.
    sources = browser.execute_script(
        "return [...document.querySelectorAll('script[src], link[href]')].map(e => e.src || e.href)"
    )
    assert all(src.startswith(site.url) for src in sources), sources


def _parse_row(n: int) -> None:
    raise ValueError(f"bad row {n}")


def test_progress_result_and_traceback_from_a_real_worker(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    from steeple.postgres.queue import JobContext

    async def crunch(ctx: JobContext, args: Any) -> Any:
        ctx.report_progress(0.5, "half the rows")
        ctx.report_progress(1, "all rows")
        return {"rows": 3, "ok": True}

    async def explode(ctx: JobContext, args: Any) -> None:
        _parse_row(7)

    (crunched,) = enqueue(site, "crunch", 1)
    (exploded,) = enqueue(site, "explode", 1)
    site.query("UPDATE {s}.tasks SET max_attempts = 1 WHERE id = $1", exploded)
    run_worker(site, {"crunch": crunch, "explode": explode}, [crunched, exploded])
    assert task_state(site, crunched) == "succeeded"
    assert task_state(site, exploded) == "failed"

    open_page(browser, site.page(f"/tasks/{crunched}"))
    assert "100% all rows" in by_css(browser, "#progress").text
    assert by_css(browser, "#progress progress").get_attribute("value") == "1"
    assert '"rows": 3' in by_css(browser, "#result-text").text
    screenshot(browser, tmp_path / "task-succeeded.png", SUCCEEDED)
    screenshot(browser, tmp_path / "task-result.png", part="#result")
    open_page(browser, site.page("/tasks?name=crunch"))
    assert "100% all rows" in by_css(browser, "tr.row.task").text

    open_page(browser, site.page(f"/tasks/{exploded}"))
    assert "ValueError: bad row 7" in by_css(browser, "tr.row.attempt").text
    trace = by_css(browser, "details.trace pre")
    assert not trace.is_displayed()  # folded until asked for
    summary = by_css(browser, "details.trace summary")
    assert "traceback (ValueError)" in summary.text
    summary.click()
    until(trace.is_displayed, "the traceback")
    assert "Traceback (most recent call last)" in trace.text
    assert "_parse_row" in trace.text
    screenshot(browser, tmp_path / "task-failed.png", FAILED)
    screenshot(browser, tmp_path / "task-traceback.png", FAILED, part="#attempts")


def test_recurring_jobs_create_pause_resume_reschedule_delete(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    def job(column: str) -> Any:
        return site.value(f"SELECT {column} FROM {{s}}.jobs WHERE name = 'nightly'")

    open_page(browser, site.page("/jobs"))
    assert by_css(browser, "#jobs td.empty").text == "none"
    form = by_css(browser, "#job-create")
    for name, value in (("name", "nightly"), ("task", "report"), ("cron", "0 3 * * *")):
        form.find_element("css selector", f"input[name={name}]").send_keys(value)
    args = form.find_element("css selector", "textarea[name=args]")
    args.clear()
    args.send_keys('{"kind": "daily"}')
    by_css(browser, "#job-create-submit").click()
    until(lambda: job("cron") == "0 3 * * *", "the job")
    assert "created job nightly" in flash(browser)
    until(lambda: all_css(browser, "#jobs tr.row.job"), "the job's row")
    screenshot(browser, tmp_path / "jobs.png", SUCCEEDED)
    assert "Pause job nightly" in click_action(browser, 'button[data-action="jobs/pause"]')
    until(lambda: job("paused") is True, "the pause")
    until(lambda: all_css(browser, 'button[data-action="jobs/resume"]'), "the resume button")
    click_action(browser, 'button[data-action="jobs/resume"]')
    until(lambda: job("paused") is False, "the resume")
    until(lambda: all_css(browser, 'button[data-action="jobs/pause"]'), "the pause button")
    click_action(
        browser,
        'button[data-action="jobs/reschedule"]',
        {"cron": "*/15 * * * *", "timezone": "Europe/Berlin"},
    )
    until(lambda: job("cron") == "*/15 * * * *", "the reschedule")
    assert job("timezone") == "Europe/Berlin"
    # A bad expression is refused with the library's words, and nothing changes.
    click_action(browser, 'button[data-action="jobs/reschedule"]', {"cron": "every day"})
    assert "failed" in flash(browser)
    assert job("cron") == "*/15 * * * *"
    click_action(browser, 'button[data-action="jobs/delete"]')
    until(lambda: job("name") is None, "the delete")


def test_publications_cancel_retry_and_purge(browser: Any, site: Site, tmp_path: Path) -> None:
    seeded = site.seeded

    def occurrence_state(occurrence_id: str) -> Any:
        return site.value(
            "SELECT state FROM {s}.recurring_occurrences WHERE id = $1", occurrence_id
        )

    open_page(browser, site.page("/schedules"))
    assert len(all_css(browser, "tr.row.occurrence")) == len(seeded.occurrence_ids)
    screenshot(browser, tmp_path / "publications.png", FAILED, SUCCEEDED)
    assert "Retry dead occurrence" in click_action(
        browser, 'button[data-action="occurrences/retry"]'
    )
    until(lambda: occurrence_state(seeded.dead_id) != "dead", "the retry")
    until(lambda: not all_css(browser, 'button[data-action="occurrences/retry"]'), "the refresh")
    first = by_css(browser, 'button[data-action="schedules/cancel"]')
    name = first.get_attribute("data-body").split('"')[3]
    click_action(browser, 'button[data-action="schedules/cancel"]')
    until(
        lambda: (
            site.value("SELECT state FROM {s}.recurring_definitions WHERE name = $1", name)
            == "cancelled"
        ),
        "the cancel",
    )
    published = "SELECT count(*) FROM {s}.recurring_occurrences WHERE state = 'published'"
    assert site.value(published) == seeded.published
    click_action(browser, 'button[data-action="occurrences/purge"]', {"older_than_days": "0"})
    until(lambda: site.value(published) == 0, "the purge")
    assert f"{seeded.published} finished occurrences removed" in flash(browser)


def test_live_refresh_without_reloading(browser: Any, seeded: Any) -> None:
    with serve(seeded, refresh_seconds=1) as site:
        open_page(browser, site.page("/tasks"))
        browser.execute_script("window.steepleMarker = 'still this page';")
        assert len(all_css(browser, "tr.row.task")) == len(seeded.task_ids)
        (new,) = enqueue(site, "arrived-later", 1)
        until(lambda: str(new) in texts(browser, "tr.row.task a"), "the new task in the list")
        assert browser.execute_script("return window.steepleMarker") == "still this page"
        assert "UTC" in by_css(browser, "#updated").text


def test_narrow_screen_keeps_the_action_column(browser: Any, site: Site, tmp_path: Path) -> None:
    browser.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": 420, "height": 800, "deviceScaleFactor": 1, "mobile": True},
    )
    try:
        open_page(browser, site.page("/tasks"))
        assert browser.execute_script("return window.innerWidth") == 420
        button = all_css(browser, 'button[data-action="tasks/cancel"]')[0]
        box = browser.execute_script(
            "const r = arguments[0].getBoundingClientRect(); return [r.left, r.right];", button
        )
        assert 0 <= box[0] < box[1] <= 420, box
        table_width = browser.execute_script(
            "return document.querySelector('#tasks table').scrollWidth"
        )
        assert table_width <= 420  # the columns a phone shows fit it: no sideways scrolling
        screenshot(browser, tmp_path / "narrow.png", PENDING)
        task_id = int(button.get_attribute("data-body").split(":")[1].strip(" }"))
        # Backing out of the confirmation changes nothing.
        button.click()
        until(lambda: by_css(browser, "#confirm").get_attribute("open") is not None, "dialog")
        by_css(browser, "#confirm-cancel").click()
        until(lambda: by_css(browser, "#confirm").get_attribute("open") is None, "closed")
        assert browser.execute_script("return document.activeElement.id") != "confirm-ok"
        assert task_state(site, task_id) == "pending"
        assert by_css(browser, "#flash").text == ""
        # (the rows may have been refreshed meanwhile: find the button again)
        again = f'button[data-action="tasks/cancel"][data-body=\'{{"task_id": {task_id}}}\']'
        click(browser, again)
        until(lambda: by_css(browser, "#confirm").get_attribute("open") is not None, "dialog")
        by_css(browser, "#confirm-ok").click()
        until(lambda: task_state(site, task_id) == "cancelled", "the cancel")
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})


def test_error_pages_and_queue_only_mode(browser: Any, seeded: Any, tmp_path: Path) -> None:
    with serve(seeded, recurring=False) as site:
        open_page(browser, site.page())
        assert "queue-only mode" in by_css(browser, "header").text
        assert not all_css(browser, "#schedules")
        open_page(browser, site.page("/schedules"))
        assert "queue-only mode" in by_css(browser, "#queue-only").text
        open_page(browser, site.page("/jobs"))
        assert all_css(browser, "#job-create")
        # An unknown namespace: an HTML page that links to the served one, not JSON.
        open_page(browser, f"{site.url}/ui/zzz")
        assert "404 · Not found" in by_css(browser, "h2.title").text
        assert "no such namespace" in by_css(browser, "p.detail").text
        assert by_css(browser, "main a").get_attribute("href") == site.page()
        screenshot(browser, tmp_path / "error.png")
        open_page(browser, f"{site.url}/ui/secret")
        assert "403 · Not allowed" in by_css(browser, "h2.title").text
        open_page(browser, site.page("/tasks?since=yesterday"))
        assert "422 · Invalid request" in by_css(browser, "h2.title").text
        assert "2026-12-01 08:30" in by_css(browser, "p.detail").text
        open_page(browser, site.page("/nowhere"))
        assert "404 · Not found" in by_css(browser, "h2.title").text


# --- what a person sees at a laptop's and a phone's width ------------------------------------

DOCS_SCREENSHOTS = os.environ.get("STEEPLE_DOCS_SCREENSHOTS")
"""A directory to also save the documentation's screenshots in (docs/images), if set."""


def view(driver: Any, width: int, height: int = 900) -> None:
    """Make the page ``width`` CSS pixels wide, as a laptop or a phone shows it."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600},
    )


def documented(driver: Any, tmp_path: Path, name: str, *colours: tuple[int, int, int]) -> None:
    """Screenshot the page (checked as :func:`screenshot` does), also into the docs if asked."""
    screenshot(driver, tmp_path / name, *colours)
    if DOCS_SCREENSHOTS:
        target = Path(DOCS_SCREENSHOTS)
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / name, target / name)


def boxes(driver: Any, selector: str) -> list[dict[str, float]]:
    """The bounding boxes of what ``selector`` finds, plus whether each one's text is cut."""
    script = """
        return [...document.querySelectorAll(arguments[0])].map(e => {
          const r = e.getBoundingClientRect();
          const shown = getComputedStyle(e).display !== 'none';
          return {left: r.left, right: r.right, top: r.top, bottom: r.bottom,
                  height: r.height, shown: shown ? 1 : 0,
                  cut: e.scrollWidth > e.clientWidth + 1 ? 1 : 0};
        });"""
    return list(driver.execute_script(script, selector))


def finish(site: Site, task_ids: list[int], state: str) -> None:
    """Mark tasks finished now (succeeded or cancelled), as their workers would."""
    site.query(
        "UPDATE {s}.tasks SET state = $2, finished_at = clock_timestamp(), attempts = 1 "
        "WHERE id = ANY($1::bigint[])",
        task_ids,
        state,
    )


def test_what_a_person_sees_at_1280_and_420_pixels(
    browser: Any, site: Site, tmp_path: Path
) -> None:
    long_error = "SMTPRecipientsRefused: " + "the mail server refused every recipient " * 5
    failed = [fail(site, "send-welcome-email", long_error) for _ in range(2)]
    finish(site, enqueue(site, "send-welcome-email", 7, queue_name="emails"), "succeeded")
    finish(site, enqueue(site, "resize-image", 4, queue_name="media"), "succeeded")
    finish(site, enqueue(site, "resize-image", 1, queue_name="media"), "cancelled")
    ada = enqueue(site, "bulk-a", 1, args={"to": "ada@example.com"})
    enqueue(site, "bulk-a", 1, args={"to": "bob@example.com"})
    try:
        view(browser, 1280)
        # The root of the app opens the dashboard (not a JSON refusal).
        open_page(browser, site.url + "/")
        assert browser.current_url == site.page()

        # The overview: a chart with a y-axis that fills its frame, throughput per queue.
        until(lambda: all_css(browser, "#throughput svg rect"), "the chart")
        ticks = texts(browser, "#throughput svg text.y-tick")
        assert ticks[0] == "0"
        assert len(ticks) >= 2, ticks
        (plot,) = boxes(browser, "#throughput .plot")
        (svg,) = boxes(browser, "#throughput svg")
        assert svg["right"] - svg["left"] >= plot["right"] - plot["left"] - 1, (svg, plot)
        assert svg["height"] == 150  # drawn at its frame's size: no letterbox bands
        per_queue = {
            row.find_element("css selector", "td.col-queue").text: row.find_element(
                "css selector", "td.col-total"
            ).text
            for row in all_css(browser, "tr.row.queue-throughput")
        }
        assert per_queue == {"default": "2", "emails": "7", "media": "5"}, per_queue
        documented(browser, tmp_path, "dashboard-overview.png", SUCCEEDED, FAILED)

        # The task list at 1280 px: every column in view, the action column covers nothing,
        # and each row is one line however long its error.
        open_page(browser, site.page("/tasks"))
        documented(browser, tmp_path, "dashboard-tasks.png", FAILED, PENDING)
        heads = boxes(browser, "#tasks table.tasks th")
        width = browser.execute_script("return window.innerWidth")
        assert width == 1280
        assert all(h["shown"] and 0 <= h["left"] < h["right"] <= width for h in heads), [
            (h["left"], h["right"]) for h in heads
        ]
        error_head, action_head = heads[-2], heads[-1]
        assert texts(browser, "#tasks table.tasks th")[-3:] == ["finished", "last error", "action"]
        assert error_head["right"] <= action_head["left"] + 1, (error_head, action_head)
        rows = boxes(browser, "#tasks tr.row.task")
        one_line = boxes(browser, "#tasks tr.row.task")[-1]["height"]  # a pending row
        assert all(r["height"] <= one_line + 1 for r in rows), [r["height"] for r in rows]
        assert one_line < 40
        assert all(b["cut"] == 0 for b in boxes(browser, "#tasks td .state")), "a badge is cut"

        # Search by args, for a task name the host opted in (bulk-a); refused for others.
        found = site.page('/tasks?name=bulk-a&args={"to":"ada@example.com"}')
        open_page(browser, found)
        assert texts(browser, "tr.row.task td.col-id a") == [str(ada[0])]
        open_page(browser, site.page('/tasks?name=send-welcome-email&args={"to":"x"}'))
        assert "403 · Not allowed" in by_css(browser, "h2.title").text
        assert "reveal_args" in by_css(browser, "p.detail").text

        # A retry says what happened, in words.
        open_page(browser, site.page("/tasks?state=failed"))
        click_action(
            browser, f'button[data-action="tasks/retry"][data-body=\'{{"task_id": {failed[0]}}}\']'
        )
        until(lambda: task_state(site, failed[0]) == "pending", "the retry")
        assert f"task {failed[0]} (send-welcome-email) is pending again" in flash(browser)

        # The publications page: one heading, a page of occurrences, a filter by state.
        open_page(browser, site.page("/schedules"))
        headings = texts(browser, "h2")
        assert sum("Recurring publications" in h for h in headings) == 1, headings
        assert all_css(browser, "#occurrence-filters form")
        documented(browser, tmp_path, "dashboard-publications.png", FAILED, SUCCEEDED)
        open_page(browser, site.page("/schedules?state=dead&from="))
        dead = texts(browser, "tr.row.occurrence td.col-id code")
        assert dead == [site.seeded.dead_id], dead

        # A phone, 420 px: which task, its state, its error and the action stay in view,
        # each row one line, no badge cut.
        view(browser, 420, 800)
        open_page(browser, site.page("/tasks"))
        assert browser.execute_script("return window.innerWidth") == 420
        wanted = {"id", "name", "state", "last error", "action"}
        names = texts(browser, "#tasks table.tasks th")
        for name, head in zip(names, boxes(browser, "#tasks table.tasks th"), strict=True):
            if name in wanted:
                assert head["shown"], name
                assert 0 <= head["left"] < head["right"] <= 420, (name, head)
        by_name = dict(zip(names, boxes(browser, "#tasks table.tasks th"), strict=True))
        assert by_name["last error"]["right"] <= by_name["action"]["left"] + 1, by_name
        rows = boxes(browser, "#tasks tr.row.task")
        assert all(r["height"] <= one_line + 1 for r in rows), [r["height"] for r in rows]
        assert all(b["cut"] == 0 for b in boxes(browser, "#tasks td .state")), "a badge is cut"
        for cell, badge in zip(
            boxes(browser, "#tasks td.col-state"), boxes(browser, "#tasks td .state"), strict=True
        ):
            assert cell["left"] <= badge["left"] < badge["right"] <= cell["right"], (cell, badge)
        documented(browser, tmp_path, "dashboard-tasks-420.png", FAILED, PENDING)
        open_page(browser, site.page())
        for card in boxes(browser, "#counts .card"):
            assert 0 <= card["left"] < card["right"] <= 420, card
        documented(browser, tmp_path, "dashboard-overview-420.png", FAILED)
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
