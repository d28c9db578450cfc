"""``steeple workflows show``: a workflow's tasks, their states and what each waits for."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import asyncpg
import pytest
from typer.testing import CliRunner

from steeple.admin.cli import app

pytestmark = [pytest.mark.postgres, pytest.mark.usefixtures("clean_env")]


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"}, catch_exceptions=False)


async def test_workflows_show_prints_the_graph_and_each_tasks_state(
    pg_schema: tuple[str, str],
) -> None:
    from steeple.postgres import queue

    dsn, schema = pg_schema
    conn = await asyncpg.connect(dsn)
    try:
        await queue.install(conn, schema=schema)
        wf = queue.Workflow()
        fetch = wf.add(queue.Task("fetch"), {"secret": "never shown"})
        parts = wf.group((queue.Task("parse"), {}), (queue.Task("parse"), {}), after=[fetch])
        wf.add(queue.Task("report"), {}, after=parts, on_parent_failure="run")
        handle = await queue.enqueue_workflow(conn, wf, schema=schema)
    finally:
        await conn.close()
    where = ["--dsn", dsn, "--queue-schema", schema]
    shown = await asyncio.to_thread(invoke, ["workflows", "show", str(handle.ids[2]), *where])
    assert shown.exit_code == 0, shown.output
    text = shown.stdout
    assert f"workflow {handle.workflow_id}: 4 tasks (3 waiting, 1 pending)" in text
    rows = [line.split() for line in text.splitlines()[3:] if line.strip()]
    assert [r[:5] for r in rows] == [
        [str(handle.ids[0]), "fetch", "pending", "-", "0"],
        [str(handle.ids[1]), "parse", "waiting", str(handle.ids[0]), "1"],
        [str(handle.ids[2]), "parse", "waiting", str(handle.ids[0]), "1"],
        [str(handle.ids[3]), "report", "waiting", f"{handle.ids[1]},{handle.ids[2]}", "2"],
    ]
    assert "secret" not in text
    as_json = await asyncio.to_thread(
        invoke, ["workflows", "show", str(handle.workflow_id), "--json", *where]
    )
    data = json.loads(as_json.stdout)
    assert data["workflow_id"] == handle.workflow_id
    assert [t["on_parent_failure"] for t in data["tasks"]] == ["cancel", "cancel", "cancel", "run"]
    assert "secret" not in as_json.stdout
    missing = await asyncio.to_thread(invoke, ["workflows", "show", "999999", *where])
    assert missing.exit_code != 0
    assert "there is no task 999999" in missing.stderr
    huge = await asyncio.to_thread(invoke, ["workflows", "show", str(2**63), *where])
    assert huge.exit_code != 0
