"""Storage tiers. ``local``: this node's RAM disk (slot files plus sidecars)."""
