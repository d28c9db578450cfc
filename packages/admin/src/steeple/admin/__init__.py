"""steeple's operator surfaces: the ``steeple`` command, the admin ASGI app, the demo.

Import what you mount or run: :func:`create_admin_app` (the admin app) and
:class:`WorkerApp` (what ``steeple worker --app module:object`` runs).

The names are loaded on first use, so running the command (``steeple --help`` above all)
does not import the web framework.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from steeple.admin.app import ACTIONS, CSRF_HEADER, SECURITY_HEADERS, create_admin_app
    from steeple.admin.settings import ExitCode
    from steeple.admin.tasks import TaskAdmin, TaskRecord
    from steeple.admin.worker import WorkerApp

__all__ = [
    "ACTIONS",
    "CSRF_HEADER",
    "SECURITY_HEADERS",
    "ExitCode",
    "TaskAdmin",
    "TaskRecord",
    "WorkerApp",
    "create_admin_app",
]

_HOMES = {
    "ACTIONS": "steeple.admin.app",
    "CSRF_HEADER": "steeple.admin.app",
    "SECURITY_HEADERS": "steeple.admin.app",
    "create_admin_app": "steeple.admin.app",
    "ExitCode": "steeple.admin.settings",
    "TaskAdmin": "steeple.admin.tasks",
    "TaskRecord": "steeple.admin.tasks",
    "WorkerApp": "steeple.admin.worker",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'steeple.admin' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
