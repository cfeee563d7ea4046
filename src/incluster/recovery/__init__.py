"""Restore after any restart: inventory -> plan -> transfer -> heal (DESIGN §5 Recovery)."""
