"""The limits from the product contracts, in one place."""

from __future__ import annotations

from datetime import timedelta

MAX_PAYLOAD_BYTES = 16 * 1024
"""Raw message payloads are limited to 16 KiB."""
MAX_DEFINITIONS = 10_000
"""A namespace holds at most this many definitions (cancelled ones included)."""
MAX_OCCURRENCES = 100_000
"""A namespace holds at most this many occurrences (terminal ones until purged)."""
MIN_BATCH, MAX_BATCH = 1, 100
"""Tick budgets, claim limits, page sizes and purge limits lie in 1..100."""
MIN_LEASE, MAX_LEASE = timedelta(seconds=1), timedelta(seconds=300)
DEFAULT_LEASE = timedelta(seconds=60)
DEFAULT_DELIVERY_WINDOW = timedelta(days=1)
MAX_DELIVERY_WINDOW = timedelta(days=7)
MAX_KEYS = 8
"""A keyring holds at most eight keys."""
RELAY_MAX_ATTEMPTS = 10
"""Automatic publication stops after ten attempts (or at window expiry)."""
CALL_DEADLINE = timedelta(seconds=10)
"""Each store call has a 10-second storage deadline."""
POOL_MAX_SIZE = 4
POOL_DEADLINE = timedelta(seconds=5)
"""Acquisition, statement and lock-wait deadline."""
PUBLISH_DEADLINE = timedelta(seconds=10)
"""Broker publication is bounded by the remaining lease and at most 10 seconds."""
RELAY_CONCURRENCY = 32
"""A batched relay runs at most this many publications at once (by default)."""
CLOCK_TOLERANCE = timedelta(seconds=5)
"""An instance trailing the recorded time by at most this adopts it; more is a clock error."""
MAX_NAME_LENGTH = 200
MAX_TOPIC_LENGTH = 255
MAX_HEADERS = 32
MAX_HEADER_NAME_LENGTH = 128
MAX_HEADER_VALUE_LENGTH = 1024
MAX_LOCATION_LENGTH = 1024
"""A broker receipt's ``location`` (stream sequence, entry id...) is at most this long."""
MAX_BACKOFF_FACTOR = 2**31 - 1
"""A backoff factor fits a 32-bit integer column; any larger one reaches the cap at once."""
