"""Conformance suites: a recurring-store state machine and broker checks.

Import the submodules (:mod:`.recurring`, :mod:`.brokers`); they need hypothesis.
"""
