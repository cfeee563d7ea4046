"""Adapters for the frameworks people train with. Each submodule imports its framework
lazily (only when used); the core of incluster never imports them."""
