"""Demonstrations run by ``incluster demo``."""
