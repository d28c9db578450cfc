"""steeple's operator surfaces: the ``steeple`` command, the admin ASGI app, the demo.

Import what you mount or run: :func:`create_admin_app` (the admin app) and
:class:`WorkerApp` (what ``steeple worker --app module:object`` runs).
"""

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
