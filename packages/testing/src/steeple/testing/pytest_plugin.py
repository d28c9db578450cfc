"""pytest plugin for steeple: registers steeple's fixtures (a fake clock)."""
