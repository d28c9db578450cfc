"""steeple-keyring."""
