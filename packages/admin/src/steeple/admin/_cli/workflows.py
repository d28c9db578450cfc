"""Workflows of the work queue: show one graph, every task's state and what it waits for."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from steeple.admin._cli import output
from steeple.admin._cli.options import JsonOpt, Typer, Where, where_options
from steeple.admin._cli.output import guard, say
from steeple.admin.settings import CliError, ExitCode
from steeple.core.tasks import MAX_TASK_ID

if TYPE_CHECKING:
    from steeple.postgres.queue import WorkflowState

__all__ = ["workflows_app"]

workflows_app = Typer(
    help="Workflows (tasks enqueued after others): show one.",
    no_args_is_help=True,
    rich_markup_mode=None,
)

WorkflowIdArg = Annotated[
    int,
    typer.Argument(
        min=1, max=MAX_TASK_ID, help="The workflow's id, or the id of any of its tasks."
    ),
]


@workflows_app.command("show")
@where_options(queue=True, store=False)
def workflows_show(workflow_id: WorkflowIdArg, where: Where, as_json: JsonOpt = False) -> None:
    """Show a workflow: each task's state, the tasks it waits for, and how many remain.

    Never its tasks' arguments or results.
    """
    from steeple.postgres.queue import TaskNotFoundError, workflow_state

    target = guard(where.target)

    async def read(conn: Any) -> WorkflowState:
        try:
            return await workflow_state(conn, workflow_id, schema=target.queue_schema)
        except TaskNotFoundError:
            raise CliError(
                f"there is no task {workflow_id}", code=ExitCode.FAILED, hint="see steeple tasks"
            ) from None

    state = output.on_queue(target, read)
    if as_json:
        output.print_json(
            {
                "workflow_id": state.workflow_id,
                "finished": state.finished,
                "tasks": [{**t.to_json(), "result": None} for t in state.tasks],
            }
        )
        return
    counts = ", ".join(f"{n} {s.value}" for s, n in sorted(state.counts().items(), key=_order))
    output.print_table(
        f"workflow {state.workflow_id}: {len(state.tasks)} tasks ({counts})",
        ("id", "name", "state", "after", "waiting on", "if a parent fails", "last error"),
        (
            (
                str(t.run.id),
                t.run.task_name,
                t.run.state.value,
                ",".join(str(i) for i in t.after) or "-",
                "-" if t.waiting_on is None else str(t.waiting_on),
                "-" if t.on_parent_failure is None else t.on_parent_failure.value,
                t.run.last_error or "",
            )
            for t in state.tasks
        ),
        elastic="last error",
    )
    if state.finished:
        say("every task has finished")


def _order(item: tuple[Any, int]) -> int:
    from steeple.core.tasks import TaskState

    return list(TaskState).index(item[0])
