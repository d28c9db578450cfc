"""Issue 14's commands on a real PostgreSQL: schedules create, tasks, enqueue, jobs, purges.

In-process (CliRunner) for the results, exit codes and messages; real processes where a
terminal, a port or a signal matters (see test_admin_cli_processes.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app
from steeple.admin.settings import ExitCode

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("clean_env")]


def invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, env=env, catch_exceptions=False)


async def ainvoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    """Run the command on a worker thread: it starts its own event loop."""
    return await asyncio.to_thread(invoke, args, env)


def one_error(result: Any) -> str:
    """The error line of a failed command (there is exactly one, then what to do)."""
    lines = result.stderr.strip().splitlines()
    assert lines, result.stderr
    assert lines[0].startswith("steeple: error: "), result.stderr
    assert len(lines) <= 2, result.stderr
    assert all(line.startswith("  what to do: ") for line in lines[1:]), result.stderr
    return str(lines[0])


async def fail_task(dsn: str, schema: str, name: str = "flaky") -> int:
    """Enqueue a task and fail it for good, as a worker whose handler failed would."""
    from steeple.postgres import queue
    from steeple.postgres.queue._sql import queue_sql

    conn = await asyncpg.connect(dsn)
    try:
        task: queue.Task[Any] = queue.Task(name)
        options = queue.EnqueueOptions(max_attempts=1)
        task_id = (await queue.enqueue(conn, task, {"x": 1}, options, schema=schema)).id
        sql = queue_sql(schema)
        give_up = await conn.fetchval("SELECT extract(epoch FROM clock_timestamp()) + 60")
        (row,) = await conn.fetch(sql.claim, [name], 1, "w", give_up)
        await conn.fetch(sql.fail, task_id, row["lease_token"], "boom", "w", None, None, None)
        return int(task_id)
    finally:
        await conn.close()


# --- schedules create ------------------------------------------------------------------------


async def test_schedules_create_from_options_is_a_no_op_when_repeated(seeded: Any) -> None:
    env = seeded.env()
    args = [
        "schedules",
        "create",
        "--name",
        "nightly-billing",
        "--cron",
        "0 2 * * *",
        "--topic",
        "billing",
        "--message-type",
        "billing.run",
        "--policy",
        "coalesce",
        "--first-after",
        "2031-01-01T00:00Z",
        "--payload",
        '{"kind": "nightly"}',
        "--header",
        "team=finance",
    ]
    first = await ainvoke(args, env)
    assert first.exit_code == 0, first.output
    assert "schedule 'nightly-billing': 0 2 * * * (coalesce), next due 2031-01-01 02:00:00" in (
        first.stdout
    )
    again = await ainvoke(args, env)  # identical: a replay, nothing changes
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout
    changed = await ainvoke([*args[:-2], "--header", "team=ops"], env)
    assert changed.exit_code == ExitCode.FAILED
    assert "nightly-billing" in one_error(changed)
    listed = json.loads((await ainvoke(["schedules", "--json"], env)).stdout)["items"]
    created = [s for s in listed if s["name"] == "nightly-billing"]
    assert created == [
        {
            **created[0],
            "cron": "0 2 * * *",
            "policy": "coalesce",
            "topic": "billing",
            "message_type": "billing.run",
            "state": "active",
        }
    ]
    # the same listing through the explicit subcommand
    explicit = await ainvoke(["schedules", "list", "--json"], env)
    assert json.loads(explicit.stdout)["items"] == listed


async def test_schedules_create_defaults_first_after_to_now_and_says_how_to_rerun(
    seeded: Any,
) -> None:
    env = seeded.env()
    args = ["schedules", "create", "--name", "now-ish", "--cron", "*/5 * * * *"]
    args += ["--topic", "t", "--message-type", "m"]
    before = datetime.now(UTC)
    first = await ainvoke(args, env)
    assert first.exit_code == 0, first.output
    listed = json.loads((await ainvoke(["schedules", "--json"], env)).stdout)["items"]
    (info,) = [s for s in listed if s["name"] == "now-ish"]
    assert before - timedelta(seconds=1) <= datetime.fromisoformat(info["first_after"])
    rerun = await ainvoke(args, env)  # first_after is "now" again: another definition
    assert rerun.exit_code == ExitCode.FAILED
    assert "--first-after defaults to now" in rerun.stderr


@pytest.mark.parametrize("suffix", [".json", ".toml"])
async def test_schedules_create_from_a_definitions_file(
    seeded: Any, tmp_path: Path, suffix: str
) -> None:
    env = seeded.env()
    path = tmp_path / f"definitions{suffix}"
    if suffix == ".json":
        path.write_text(
            json.dumps(
                [
                    {"name": "a-job", "cron": "0 * * * *", "first_after": "2031-01-01T00:00Z"},
                    {
                        "name": "b-job",
                        "cron": "30 1 * * *",
                        "policy": "coalesce",
                        "first_after": "2031-01-01T00:00Z",
                        "topic": "other",
                        "payload_base64": "AAEC",
                    },
                ]
            )
        )
    else:
        path.write_text(
            "[[definitions]]\n"
            'name = "a-job"\ncron = "0 * * * *"\nfirst_after = "2031-01-01T00:00Z"\n'
            "[[definitions]]\n"
            'name = "b-job"\ncron = "30 1 * * *"\npolicy = "coalesce"\n'
            'first_after = "2031-01-01T00:00Z"\ntopic = "other"\npayload_base64 = "AAEC"\n'
        )
    args = ["schedules", "create", "--file", str(path), "--topic", "ops", "--message-type", "T"]
    created = await ainvoke(args, env)
    assert created.exit_code == 0, created.output
    assert created.stdout.count("schedule '") == 2
    listed = json.loads((await ainvoke(["schedules", "--json"], env)).stdout)["items"]
    by_name = {s["name"]: s for s in listed}
    assert (by_name["a-job"]["topic"], by_name["a-job"]["message_type"]) == ("ops", "T")
    assert (by_name["b-job"]["topic"], by_name["b-job"]["policy"]) == ("other", "coalesce")
    again = await ainvoke(args, env)
    assert again.exit_code == 0, again.output  # a deployment may run it every time


EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "examples" / "nightly-jobs.toml"


async def test_the_example_definitions_file_applies_twice(seeded: Any) -> None:
    """docs/examples/nightly-jobs.toml as a deployment would run it, every time."""
    env = seeded.env()
    args = ["schedules", "create", "--file", str(EXAMPLE)]
    first = await ainvoke(args, env)
    assert first.exit_code == 0, first.output
    again = await ainvoke(args, env)
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout
    names = ["nightly-billing", "nightly-report", "invoice-reminders", "hourly-sync", "cache-warm"]
    assert [line.split("'")[1] for line in first.stdout.splitlines()] == names
    listed = json.loads((await ainvoke(["schedules", "--json"], env)).stdout)["items"]
    mine = [s for s in listed if s["name"] in names]
    assert sorted(s["name"] for s in mine) == sorted(names)  # each once
    assert {datetime.fromisoformat(s["first_after"]) for s in mine} == {
        datetime(2026, 1, 30, tzinfo=UTC)
    }


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[]", "no definitions"),
        ('[{"name": "x", "cron": "* * * * *", "colour": "red"}]', "unknown field"),
        ('[{"name": "x", "cron": "0 0 30 2 *"}]', "never"),
        ('[{"name": "x", "cron": "61 * * * *"}]', "minute"),
        ('[{"name": "x"}]', "'cron' is required"),
        ('[{"name": "x", "cron": "* * * * *", "first_after": "2031-01-01"}]', "time zone"),
        ("{not json", "not valid JSON"),
        ('[{"name": "a", "cron": "* * * * *"}, {"name": "a", "cron": "* * * * *"}]', "twice"),
        ('[{"name": "x", "cron": "* * * * *", "first_after": ' + "9" * 5000 + "}]", "digits"),
    ],
)
async def test_schedules_create_refuses_bad_files_before_storing(
    seeded: Any, tmp_path: Path, content: str, fragment: str
) -> None:
    env = seeded.env()
    path = tmp_path / "bad.json"
    path.write_text(content)
    result = await ainvoke(
        ["schedules", "create", "--file", str(path), "--topic", "t", "--message-type", "m"], env
    )
    assert result.exit_code == ExitCode.USAGE, result.output
    assert fragment in one_error(result)
    listed = json.loads((await ainvoke(["schedules", "--json"], env)).stdout)["items"]
    assert {s["name"] for s in listed} == {"minutely", "five-minutely"}


def test_schedules_create_usage_errors() -> None:
    base = ["schedules", "create", "--dsn", "postgresql://u@127.0.0.1:1/x"]
    missing = invoke([*base, "--name", "x"])
    assert missing.exit_code == ExitCode.USAGE
    assert "--cron, --topic, --message-type" in one_error(missing)
    both = invoke([*base, "--file", "f.json", "--name", "x"])
    assert both.exit_code == ExitCode.USAGE
    assert "drop --name" in one_error(both)
    definition = [*base, "--name", "x", "--cron", "* * * * *", "--topic", "t"]
    header = invoke([*definition, "--message-type", "m", "--header", "nokey"])
    assert header.exit_code == ExitCode.USAGE
    policy = invoke([*definition, "--message-type", "m", "--policy", "sometimes"])
    assert policy.exit_code == ExitCode.USAGE
    assert "catch_up, coalesce" in one_error(policy)


# --- tasks, enqueue ----------------------------------------------------------------------------


async def test_tasks_retry_show_cancel_and_filters(seeded: Any) -> None:
    env = seeded.env()
    failed = await fail_task(seeded.dsn, seeded.schema)
    listed = await ainvoke(["tasks", "--state", "failed", "--json"], env)
    assert [t["task_id"] for t in json.loads(listed.stdout)["items"]] == [failed]
    by_name = await ainvoke(["tasks", "list", "--name", "flaky", "--json"], env)
    assert [t["task_id"] for t in json.loads(by_name.stdout)["items"]] == [failed]
    shown = await ainvoke(["tasks", "show", str(failed), "--json"], env)
    detail = json.loads(shown.stdout)
    assert (detail["state"], detail["attempts"], detail["last_error"]) == ("failed", 1, "boom")
    assert "args" not in detail
    # A terminal failure reads as one, not as "1/1" or "1 of 5" awaiting retries.
    text_list = await ainvoke(["tasks", "--state", "failed"], env)
    assert "1, not retried" in text_list.stdout, text_list.output
    assert "1/1" not in text_list.stdout
    text_show = await ainvoke(["tasks", "show", str(failed)], env)
    assert re.search(r"^attempts\s+1, not retried$", text_show.stdout, re.M), text_show.output

    retried = await ainvoke(["tasks", "retry", str(failed)], env)
    assert retried.exit_code == 0, retried.output
    assert f"task {failed} (flaky) is pending again: attempt 2 of 2 runs next" in retried.stdout
    twice = await ainvoke(["tasks", "retry", str(failed)], env)
    assert twice.exit_code == ExitCode.FAILED
    assert f"task {failed} is still pending; only failed tasks can be retried" in one_error(twice)
    missing = await ainvoke(["tasks", "retry", "987654321"], env)
    assert missing.exit_code == ExitCode.FAILED
    assert "no task 987654321" in one_error(missing)

    unconfirmed = await ainvoke(["tasks", "cancel", str(failed)], env)
    assert unconfirmed.exit_code == ExitCode.USAGE
    assert "--yes" in unconfirmed.stderr
    assert (
        json.loads((await ainvoke(["tasks", "show", str(failed), "--json"], env)).stdout)["state"]
        == "pending"
    )  # nothing happened
    cancelled = await ainvoke(["tasks", "cancel", str(failed), "--yes"], env)
    assert cancelled.exit_code == 0, cancelled.output
    table = await ainvoke(["tasks", "--state", "cancelled"], {**env, "COLUMNS": "200"})
    assert "flaky" in table.stdout

    bogus = await ainvoke(["tasks", "--state", "bogus"], env)
    assert bogus.exit_code == ExitCode.USAGE  # usage is 2
    assert "pending, running, succeeded, failed, cancelled" in bogus.stderr


async def test_enqueue_now_later_and_deduplicated(seeded: Any) -> None:
    env = seeded.env()
    now = await ainvoke(["enqueue", "send-email", "--args", '{"to": "ada@example.com"}'], env)
    assert now.exit_code == 0, now.output
    first_id = int(now.stdout.split()[2])
    at = await ainvoke(
        ["enqueue", "send-email", "--at", "2031-05-01T09:00+02:00", "--priority", "5", "--json"],
        env,
    )
    at_id = json.loads(at.stdout)["task_id"]
    later = await ainvoke(["enqueue", "report", "--in", "10m", "--max-attempts", "2"], env)
    assert later.exit_code == 0, later.output
    dedup = ["enqueue", "report", "--dedup-key", "daily", "--json"]
    one = json.loads((await ainvoke(dedup, env)).stdout)
    two = json.loads((await ainvoke(dedup, env)).stdout)
    assert (one["deduplicated"], two) == (
        False,
        {"task_id": one["task_id"], "deduplicated": True, "queue": "default"},
    )

    conn = await asyncpg.connect(seeded.dsn)
    try:
        rows = {
            r["id"]: r
            for r in await conn.fetch(
                f"SELECT id, task_name, args::text, priority, run_at, created_at, max_attempts"
                f' FROM "{seeded.schema}".tasks'
            )
        }
    finally:
        await conn.close()
    assert json.loads(rows[first_id]["args"]) == {"to": "ada@example.com"}
    assert rows[at_id]["run_at"] == datetime(2031, 5, 1, 7, 0, tzinfo=UTC)
    assert rows[at_id]["priority"] == 5
    delayed = [r for r in rows.values() if r["task_name"] == "report" and r["max_attempts"] == 2]
    (row,) = delayed
    assert timedelta(minutes=9) < row["run_at"] - row["created_at"] <= timedelta(minutes=10)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--args", "{not json"], "--args is not JSON"),
        (["--args", "NaN"], "--args is not JSON"),
        (["--args", "[" * 100_000], "nested too deeply"),
        (["--args", '"\\u0000"'], "NUL"),
        (["--at", "2031-05-01T09:00"], "no time zone"),
        (["--at", "soon"], "ISO 8601"),
        (["--in", "-5m"], "not a duration"),
        (["--at", "2031-05-01T09:00Z", "--in", "5m"], "not both"),
        (["--priority", str(2**40)], "priority"),
        (["--max-attempts", "0"], "max_attempts"),
        (["--dedup-key", "a\x00b"], "dedup_key"),
        (["--queue", ""], "queue must not be empty or blank"),
        (["--queue", "a\x00b"], "queue must not contain a control or invisible character"),
        (["--queue", "q" * 10_240], "queue is 10240 characters; a name is 1..200"),
        (["--queue", " mail"], "queue must not start or end with whitespace"),
    ],
)
def test_enqueue_refuses_bad_arguments_before_connecting(args: list[str], fragment: str) -> None:
    result = invoke(["enqueue", "t", *args, "--dsn", "postgresql://u@127.0.0.1:1/x"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert fragment in one_error(result)


async def test_enqueue_and_tasks_on_an_unmigrated_queue_say_to_migrate(
    pg_schema: tuple[str, str],
) -> None:
    dsn, schema = pg_schema
    env = {"STEEPLE_DATABASE_URL": dsn, "STEEPLE_QUEUE_SCHEMA": schema}
    for args in (["enqueue", "t"], ["tasks"], ["jobs"], ["tasks", "retry", "1"], ["queues"]):
        result = await ainvoke(args, env)
        assert result.exit_code == ExitCode.CONFIG, (args, result.output)
        assert "steeple migrate" in result.stderr


# --- queues ------------------------------------------------------------------------------------


async def test_queues_enqueue_list_pause_limit_resume(seeded: Any) -> None:
    env = seeded.env()

    async def pending() -> dict[str, int]:
        listed = json.loads((await ainvoke(["queues", "--json"], env)).stdout)
        assert not any(q["paused"] for q in listed)
        return {q["name"]: q["pending"] for q in listed}

    before = await pending()
    put = await ainvoke(["enqueue", "send-report", "--queue", "reports", "--json"], env)
    assert put.exit_code == 0, put.output
    assert json.loads(put.stdout)["queue"] == "reports"
    said = await ainvoke(["enqueue", "send-report"], env)
    assert "in queue 'default'" in said.stdout
    assert await pending() == {"default": before.get("default", 0) + 1, "reports": 1}
    refused = await ainvoke(["queues", "pause", "reports"], env)  # no terminal, no --yes
    assert refused.exit_code == ExitCode.USAGE
    paused = await ainvoke(["queues", "pause", "reports", "--yes"], env)
    assert paused.exit_code == 0, paused.output
    assert "paused queue 'reports': paused" in paused.stdout
    limited = await ainvoke(
        ["queues", "limit", "reports", "--max-running", "5", "--rate", "10", "--per", "1m"], env
    )
    assert limited.exit_code == 0, limited.output
    assert "at most 5 running, at most 10 starts per 60 s" in limited.stdout
    table = await ainvoke(["queues", "list"], {**env, "COLUMNS": "200"})
    assert "paused" in table.stdout
    assert "at most 5 running" in table.stdout
    resumed = json.loads((await ainvoke(["queues", "resume", "reports", "--json"], env)).stdout)
    assert (resumed["paused"], resumed["max_running"], resumed["rate_period_seconds"]) == (
        False,
        5,
        60.0,
    )
    cleared = json.loads((await ainvoke(["queues", "limit", "reports", "--json"], env)).stdout)
    assert (cleared["max_running"], cleared["rate_limit"]) == (None, None)


async def test_queues_limit_sets_and_shows_per_key_limits(seeded: Any) -> None:
    env = seeded.env()
    args = ["queues", "limit", "imports", "--max-running-per-key", "1"]
    limited = await ainvoke([*args, "--rate-per-key", "10", "--per-key", "1s"], env)
    assert limited.exit_code == 0, limited.output
    assert "at most 1 running per key, at most 10 starts per key per 1 s" in limited.stdout
    table = await ainvoke(["queues", "list"], {**env, "COLUMNS": "200"})
    assert "at most 1 running per key" in table.stdout
    listed = json.loads((await ainvoke(["queues", "--json"], env)).stdout)
    (imports,) = [q for q in listed if q["name"] == "imports"]
    assert (
        imports["max_running_per_key"],
        imports["rate_limit_per_key"],
        imports["rate_period_per_key_seconds"],
    ) == (1, 10, 1.0)
    put = await ainvoke(
        ["enqueue", "send-report", "--queue", "imports", "--limit-key", "customer-7", "--json"],
        env,
    )
    assert put.exit_code == 0, put.output
    task_id = json.loads(put.stdout)["task_id"]
    conn = await asyncpg.connect(seeded.dsn)
    try:
        key = await conn.fetchval(
            f'SELECT limit_key FROM "{seeded.schema}".tasks WHERE id = $1', task_id
        )
    finally:
        await conn.close()
    assert key == "customer-7"
    cleared = json.loads((await ainvoke(["queues", "limit", "imports", "--json"], env)).stdout)
    assert (cleared["max_running_per_key"], cleared["rate_limit_per_key"]) == (None, None)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["queues", "pause", "", "--yes"], "queue must not be empty or blank"),
        (["queues", "resume", "a\x00b"], "control character"),
        (["queues", "limit", "q", "--max-running", "0"], "max_running"),
        (["queues", "limit", "q", "--rate", "5"], "together"),
        (["queues", "limit", "q", "--rate", "5", "--per", "soon"], "--per"),
        (["queues", "limit", "q", "--rate", "0", "--per", "1s"], "rate_limit"),
        (["queues", "limit", "q", "--max-running-per-key", "0"], "--max-running-per-key"),
        (["enqueue", "t", "--limit-key", "a\x00b"], "limit_key must not contain a control"),
        (["enqueue", "t", "--limit-key", "k" * 201], "limit_key must be a str of 1..200"),
        (["queues", "limit", "q", "--rate-per-key", "5"], "together"),
        (["queues", "limit", "q", "--rate-per-key", "5", "--per-key", "soon"], "--per-key"),
        (["queues", "limit", "q", "--rate-per-key", "0", "--per-key", "1s"], "--rate-per-key"),
    ],
)
def test_queue_commands_refuse_bad_arguments_before_connecting(
    args: list[str], fragment: str
) -> None:
    result = invoke([*args, "--dsn", "postgresql://u@127.0.0.1:1/x"])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert fragment in one_error(result)


# --- jobs --------------------------------------------------------------------------------------


async def test_jobs_lifecycle(seeded: Any) -> None:
    env = seeded.env()
    create = ["jobs", "create", "nightly-report", "--task", "send-report", "--cron", "0 3 * * *"]
    created = await ainvoke([*create, "--args", '{"format": "pdf"}', "--priority", "2"], env)
    assert created.exit_code == 0, created.output
    assert "created job 'nightly-report': send-report at '0 3 * * *', next run" in created.stdout
    exists = await ainvoke(create, env)
    assert exists.exit_code == ExitCode.FAILED
    assert "jobs ensure" in exists.stderr
    ensured = await ainvoke(
        ["jobs", "ensure", "nightly-report", "--task", "send-report", "--cron", "0 4 * * *"], env
    )
    assert ensured.exit_code == 0, ensured.output
    assert "'0 4 * * *'" in ensured.stdout
    paused = await ainvoke(["jobs", "pause", "nightly-report", "--json"], env)
    assert json.loads(paused.stdout)["paused"] is True
    listed = json.loads((await ainvoke(["jobs", "--json"], env)).stdout)
    assert [(j["name"], j["paused"], j["cron"]) for j in listed["items"]] == [
        ("nightly-report", True, "0 4 * * *")
    ]
    resumed = await ainvoke(["jobs", "resume", "nightly-report"], env)
    assert "resumed job 'nightly-report'" in resumed.stdout
    rescheduled = await ainvoke(["jobs", "reschedule", "nightly-report", "*/15 * * * *"], env)
    assert rescheduled.exit_code == 0, rescheduled.output
    table = await ainvoke(["jobs", "list"], {**env, "COLUMNS": "200"})
    assert "*/15 * * * *" in table.stdout
    assert "active" in table.stdout
    refused = await ainvoke(["jobs", "delete", "nightly-report"], env)
    assert refused.exit_code == ExitCode.USAGE
    deleted = await ainvoke(["jobs", "delete", "nightly-report", "--yes"], env)
    assert deleted.exit_code == 0, deleted.output
    gone = await ainvoke(["jobs", "pause", "nightly-report"], env)
    assert gone.exit_code == ExitCode.FAILED
    assert "no recurring job named 'nightly-report'" in one_error(gone)
    bad_cron = await ainvoke(["jobs", "reschedule", "x", "61 * * * *"], env)
    assert bad_cron.exit_code == ExitCode.USAGE
    assert json.loads((await ainvoke(["jobs", "--json"], env)).stdout)["items"] == []


# --- purges -----------------------------------------------------------------------------------


async def test_purge_dry_run_counts_what_a_purge_removes(seeded: Any) -> None:
    env = seeded.env()
    failed = await fail_task(seeded.dsn, seeded.schema)
    dry = await ainvoke(["purge", "--older-than", "0s", "--dry-run"], env)
    assert dry.exit_code == 0, dry.output
    expected = seeded.published + 1  # published occurrences and the dead one
    assert f"dry run: {expected} terminal occurrences" in dry.stdout
    assert "nothing was removed" in dry.stdout
    small = await ainvoke(["purge", "--older-than", "0s", "--dry-run", "--limit", "2"], env)
    assert "would remove 2 of them" in small.stdout
    tasks_dry = await ainvoke(["purge", "--tasks", "--older-than", "0s", "--dry-run"], env)
    assert "dry run: 1 terminal task finished" in tasks_dry.stdout
    assert (await ainvoke(["purge", "--dry-run"], env)).stdout.startswith("dry run: 0 ")
    removed = await ainvoke(["purge", "--older-than", "0s", "--yes"], env)
    assert f"purged {expected} terminal occurrences" in removed.stdout
    pruned = await ainvoke(["purge", "--tasks", "--older-than", "0s", "--yes", "--limit", "1"], env)
    assert "purged 1 terminal task " in pruned.stdout
    assert "run it again" in pruned.stdout  # the limit was reached
    shown = await ainvoke(["tasks", "show", str(failed)], env)
    assert shown.exit_code == ExitCode.FAILED  # it is gone


# --- keys ---------------------------------------------------------------------------------------


def test_keys_generate_out_writes_a_private_file_once(tmp_path: Path) -> None:
    path = tmp_path / "steeple.key"
    written = invoke(["keys", "generate", "--id", "k7", "--out", str(path)])
    assert written.exit_code == 0, written.output
    assert written.stdout == ""  # the secret is in the file only
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key_line = path.read_text()
    assert key_line.startswith("k7:")
    assert key_line.endswith("\n")
    again = invoke(["keys", "generate", "--out", str(path)])
    assert again.exit_code == ExitCode.FAILED
    assert "already exists" in one_error(again)
    assert path.read_text() == key_line
    forced = invoke(["keys", "generate", "--id", "k8", "--out", str(path), "--force"])
    assert forced.exit_code == 0, forced.output
    assert path.read_text().startswith("k8:")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["steeple.key"]  # no temporary left
    # the next command accepts the file as it is
    shown = invoke(["keys", "show", "--keys-file", str(path), "--json"])
    assert json.loads(shown.stdout)["primary"] == "k8"
    nowhere = invoke(["keys", "generate", "--out", str(tmp_path / "no" / "such" / "dir")])
    assert nowhere.exit_code == ExitCode.CONFIG


def test_version() -> None:
    from importlib.metadata import version

    result = invoke(["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"steeple {version('steeple-admin')}\n"


def test_usage_errors_are_one_line_with_a_pointer_to_help() -> None:
    for args in (["--frobnicate"], ["schedules", "--limit", "x"], ["tasks", "retry"],
                 ["jobs", "create", "j"], ["nope"]):  # fmt: skip
        result = invoke(args)
        assert result.exit_code == ExitCode.USAGE, (args, result.output)
        error = one_error(result)
        assert "Usage:" not in result.stderr, args
        assert result.stderr.strip().splitlines()[1].endswith("--help"), result.stderr
        assert error, args


def test_environment_key_file_mode_is_checked(tmp_path: Path) -> None:
    path = tmp_path / "k"
    invoke(["keys", "generate", "--out", str(path)])
    os.chmod(path, 0o644)
    result = invoke(["keys", "show", "--keys-file", str(path)])
    assert result.exit_code == ExitCode.CONFIG
    assert "chmod 600" in result.stderr


async def test_jobs_carry_their_queue(seeded: Any) -> None:
    env = seeded.env()
    create = ["jobs", "create", "mailer", "--task", "send-mail", "--cron", "0 3 * * *"]
    created = await ainvoke([*create, "--queue", "emails"], env)
    assert created.exit_code == 0, created.output
    assert "queue 'emails'" in created.stdout
    listed = json.loads((await ainvoke(["jobs", "--json"], env)).stdout)["items"]
    assert [(j["name"], j["queue"]) for j in listed] == [("mailer", "emails")]
    table = await ainvoke(["jobs", "list"], {**env, "COLUMNS": "200"})
    assert "emails" in table.stdout
    # ensure without --queue brings it to the default queue, as any other option
    ensure = ["jobs", "ensure", "mailer", "--task", "send-mail", "--cron", "0 3 * * *"]
    ensured = await ainvoke([*ensure, "--json"], env)
    assert json.loads(ensured.stdout)["queue"] == "default"
    bad = await ainvoke([*create[:2], "other", *create[3:], "--queue", "a\nb"], env)
    assert bad.exit_code == ExitCode.USAGE
    assert "control character" in one_error(bad)
    assert len(json.loads((await ainvoke(["jobs", "--json"], env)).stdout)["items"]) == 1
    # Its runs would wait in a queue no worker serves: `steeple queues` says so.
    conn = await asyncpg.connect(seeded.dsn)
    try:
        await conn.execute(
            f"""INSERT INTO "{seeded.schema}".tasks (task_name, args, max_attempts,
                lease_duration, backoff_initial_us, backoff_maximum_us, backoff_factor,
                backoff_jitter, queue, run_at, created_at)
            VALUES ('send-mail', '{{}}', 3, interval '60 s', 1000000, 60000000, 2, 0.1,
                    'emails', clock_timestamp() - interval '10 minutes',
                    clock_timestamp() - interval '10 minutes')"""
        )
    finally:
        await conn.close()
    queues = json.loads((await ainvoke(["queues", "--json"], env)).stdout)
    assert [(q["name"], q["unserved"]) for q in queues if q["name"] == "emails"] == [
        ("emails", True)
    ]
    table = await ainvoke(["queues"], {**env, "COLUMNS": "200"})
    assert "active, unserved" in table.stdout


async def test_jobs_with_time_zones_and_shorthands(seeded: Any) -> None:
    env = seeded.env()
    create = ["jobs", "create", "berlin-morning", "--task", "report", "--cron", "0 7 * * *"]
    created = await ainvoke([*create, "--timezone", "Europe/Berlin", "--json"], env)
    assert created.exit_code == 0, created.output
    job = json.loads(created.stdout)
    assert (job["timezone"], job["cron"]) == ("Europe/Berlin", "0 7 * * *")
    assert datetime.fromisoformat(job["next_run_at"]).astimezone(UTC).hour in {5, 6}
    daily = await ainvoke(
        ["jobs", "ensure", "nightly", "--task", "report", "--cron", "@daily"], env
    )
    assert daily.exit_code == 0, daily.output
    moved = await ainvoke(
        ["jobs", "reschedule", "berlin-morning", "0 8 * * *", "--timezone", "Asia/Tokyo"], env
    )
    assert moved.exit_code == 0, moved.output
    assert "(Asia/Tokyo)" in moved.stdout
    table = await ainvoke(["jobs"], {**env, "COLUMNS": "200"})
    assert "Asia/Tokyo" in table.stdout
    assert "@daily" in table.stdout
    for bad in (["--timezone", "Mars/Olympus"], ["--timezone", "localtime"], ["--cron", "@often"]):
        args = ["jobs", "create", "bad", "--task", "t", "--cron", "0 1 * * *", *bad]
        refused = await ainvoke(args, env)
        assert refused.exit_code == ExitCode.USAGE, (bad, refused.output)


async def test_queue_commands_on_a_read_only_session_say_so_in_one_line(seeded: Any) -> None:
    # asyncpg passes unknown DSN parameters as session settings: every session of this DSN
    # is read-only, as on a standby.
    env = {**seeded.env(), "STEEPLE_DATABASE_URL": seeded.dsn + "?default_transaction_read_only=on"}
    failed = await fail_task(seeded.dsn, seeded.schema)
    for args in (["tasks", "retry", str(failed)], ["jobs", "pause", "nightly"]):
        result = await ainvoke(args, env)
        assert result.exit_code == ExitCode.UNAVAILABLE, result.output
        line = one_error(result)
        assert "read-only (SQLSTATE 25006" in line, line
        assert "Traceback" not in result.output
    assert await _task_state(seeded.dsn, seeded.schema, failed) == "failed"


async def test_queue_commands_past_lock_timeout_say_so_in_one_line(seeded: Any) -> None:
    env = {**seeded.env(), "STEEPLE_DATABASE_URL": seeded.dsn + "?lock_timeout=200"}
    failed = await fail_task(seeded.dsn, seeded.schema)
    holder = await asyncpg.connect(seeded.dsn)
    try:
        async with holder.transaction():
            await holder.execute(f'LOCK TABLE "{seeded.schema}".tasks IN ACCESS EXCLUSIVE MODE')
            result = await ainvoke(["tasks", "retry", str(failed)], env)
    finally:
        await holder.close()
    assert result.exit_code == ExitCode.UNAVAILABLE, result.output
    assert "lock_timeout (SQLSTATE 55P03)" in one_error(result)
    assert await _task_state(seeded.dsn, seeded.schema, failed) == "failed"


async def _task_state(dsn: str, schema: str, task_id: int) -> str:
    conn = await asyncpg.connect(dsn)
    try:
        return str(
            await conn.fetchval(f'SELECT state FROM "{schema}".tasks WHERE id = $1', task_id)
        )
    finally:
        await conn.close()


# --- tasks show: result, progress, attempts, traceback (issue 13.4, 13.5) -----------------------


async def _run_tasks(dsn: str, schema: str) -> tuple[int, int]:
    """Run one task that reports progress and returns a result, one that fails twice."""
    from steeple.postgres import queue

    def lookup(ctx: queue.JobContext, args: Any) -> Any:
        ctx.report_progress(0.5, "halfway")
        if args == "fail":
            raise LookupError("no such customer \x1b[31m (an escape in a message)")
        return {"customer": "ada", "total": 3}

    task: queue.Task[Any] = queue.Task(
        "lookup", retry=queue.RetryPolicy(max_attempts=2, base_delay=timedelta(milliseconds=1))
    )
    conn = await asyncpg.connect(dsn)
    try:
        ok = (await queue.enqueue(conn, task, "ok", schema=schema)).id
        bad = (await queue.enqueue(conn, task, "fail", schema=schema)).id
        worker = queue.Scheduler(dsn, worker_id="cli-w", schema=schema, poll_interval=0.05)
        worker.register(task, lookup)
        stop = asyncio.Event()
        run = asyncio.create_task(worker.run_until_shutdown(stop))
        try:
            for _ in range(600):
                if (worker.stats.succeeded, worker.stats.failed) == (1, 1) or run.done():
                    break
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(run, 30)
        return int(ok), int(bad)
    finally:
        await conn.close()


async def test_tasks_show_prints_result_progress_attempts_and_the_traceback(seeded: Any) -> None:
    env = {**seeded.env(), "COLUMNS": "200"}
    ok, bad = await _run_tasks(seeded.dsn, seeded.schema)
    shown = await ainvoke(["tasks", "show", str(ok)], env)
    assert shown.exit_code == 0, shown.output
    assert "result" in shown.stdout
    assert '"customer":"ada"' in shown.stdout  # jsonb keeps its own key order
    assert "progress" in shown.stdout
    assert "50% halfway" in shown.stdout
    assert "#1 succeeded on cli-w" in shown.stdout
    detail = json.loads((await ainvoke(["tasks", "show", str(ok), "--json"], env)).stdout)
    assert detail["result"] == {"customer": "ada", "total": 3}
    assert detail["progress"] == {"fraction": 0.5, "message": "halfway"}
    assert [a["outcome"] for a in detail["history"]] == ["succeeded"]

    failed = await ainvoke(["tasks", "show", str(bad)], env)
    assert failed.exit_code == 0, failed.output
    text = failed.stdout
    assert "#1 retried on cli-w" in text
    assert "#2 failed on cli-w" in text
    assert "traceback of attempt 2 (LookupError):" in text
    assert "in lookup" in text
    assert "\x1b" not in text  # a handler's message cannot steer the terminal
    assert "\\x1b[31m (an escape in a message)" in text  # shown escaped instead
    lines = text.splitlines()
    # Fields stay aligned: every value starts in the same column.
    fields = lines[: lines.index("attempts (2):")]
    starts = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in fields}
    assert len(starts) == 1, fields
    # The traceback keeps its indentation: frames two spaces in, source lines four.
    trace = lines[lines.index("traceback of attempt 2 (LookupError):") + 1 :]
    assert trace[0] == "Traceback (most recent call last):"
    assert any(line.startswith('  File "') for line in trace), trace
    assert any(line.startswith("    ") and line.strip() for line in trace), trace
    detail = json.loads((await ainvoke(["tasks", "show", str(bad), "--json"], env)).stdout)
    assert detail["state"] == "failed"
    assert [a["error_type"] for a in detail["history"]] == ["LookupError", "LookupError"]
    assert "Traceback (most recent call last)" in detail["history"][-1]["traceback"]
    assert "args" not in detail
