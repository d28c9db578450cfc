"""Integrations of the work queue with application frameworks.

Each module imports no framework at import time (importing :mod:`steeple.postgres.queue`
never loads this package): :mod:`.asgi` runs workers inside an ASGI application's lifespan
(FastAPI, Starlette and any other ASGI framework). Django needs no helper: see the recipes
in the README (enqueue with ``enqueue_sync`` on ``django.db.connection.connection``).
"""
