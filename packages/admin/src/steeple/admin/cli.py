"""The ``steeple`` command."""


def main() -> None:
    """Run the ``steeple`` command."""
    raise SystemExit("steeple: not built yet")
