"""steeple-brokers."""
