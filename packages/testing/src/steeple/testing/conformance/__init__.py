"""Conformance suites: recurring-store and work-queue state machines, broker checks.

Import the submodules (:mod:`.recurring`, :mod:`.queue`, :mod:`.brokers`); they need
hypothesis.
"""
