"""The writer: checksums and commits staged shards, off the trainer's critical path.

``base.Writer`` is the one small interface the Checkpointer talks to; ``thread`` runs it
on a background thread. A process-based writer implements the same interface.
"""
