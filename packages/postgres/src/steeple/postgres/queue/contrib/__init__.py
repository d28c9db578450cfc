"""Integrations of the work queue with application frameworks.

Each module imports no framework at import time (importing :mod:`steeple.postgres.queue`
never loads this package): :mod:`.asgi` runs workers inside an ASGI application's lifespan
(FastAPI, Starlette and any other ASGI framework). Django needs no helper: see the framework
recipes in the documentation (enqueue with ``enqueue_sync`` on ``django.db.connection.connection``).
"""
