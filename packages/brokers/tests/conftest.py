"""Fixtures for the broker adapters' tests."""

from __future__ import annotations

import sys
from pathlib import Path

# The tests import the shared suite module beside them (broker_support.py); with
# --import-mode=importlib the test directory is not on sys.path by itself.
_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
