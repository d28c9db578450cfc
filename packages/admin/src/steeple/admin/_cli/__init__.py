"""The ``steeple`` command, in rooms: option bundles, output, one module per command group.

``steeple.admin.cli`` assembles the app from :mod:`.recurring`, :mod:`.queue`, :mod:`.keys`,
:mod:`.worker`, :mod:`.serve` and :mod:`.demo`. Modules here import only ``typer`` and the
standard library at import time (plus steeple's core and settings), so ``steeple --help``
stays fast; drivers, servers and tables are imported inside the commands.
"""
