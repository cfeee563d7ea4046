"""Helpers shipped for users' own tests: fault injection and a multi-process launcher."""

from incluster.testing.faults import FaultInjector, InjectedFault

__all__ = ["FaultInjector", "InjectedFault"]
