"""steeple's operator surfaces: the ``steeple`` command, the admin ASGI app, the demo.

Import what you mount or run: :func:`create_admin_app` (the admin app) and
:class:`WorkerApp` (what ``steeple worker --app module:object`` runs).

The names are loaded on first use, so running the command (``steeple --help`` above all)
does not import the web framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from steeple.core._lazy import lazy_exports as _lazy_exports

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


__getattr__, __dir__ = _lazy_exports("steeple.admin", _HOMES, globals(), __all__)
