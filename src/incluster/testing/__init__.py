"""Helpers shipped for users' own tests: fault injection, failing and slow tiers, and a
multi-process launcher (:mod:`incluster.testing.launch`)."""

from incluster.testing.faults import FaultInjector, InjectedFault
from incluster.testing.tiers import FaultyTier, SlowTier

__all__ = ["FaultInjector", "FaultyTier", "InjectedFault", "SlowTier"]
