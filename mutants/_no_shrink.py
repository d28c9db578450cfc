"""A pytest plugin the mutant runner loads: Hypothesis finds a failure but does not shrink it.

A mutant is killed by any failing example; the smallest one is not needed, and shrinking a
stateful PostgreSQL test's failure takes minutes.
"""

from __future__ import annotations

from hypothesis import Phase, settings

settings.register_profile(
    "steeple-mutants", phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
)
settings.load_profile("steeple-mutants")
