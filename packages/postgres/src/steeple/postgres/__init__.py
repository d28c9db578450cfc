"""steeple-postgres."""
