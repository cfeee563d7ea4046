"""The "incluster: " that starts each message, said once.

Every message starts with "incluster: ", so that it says where it is from where logging
is not configured (Python then prints the bare message). A format that shows the
logger's name (``%(name)s``, torchtitan's and pytest's among them) said it twice:
"incluster - WARNING - incluster: rank 0 ...". A filter on the ``incluster`` logger drops
the word from a message when every handler that will print it shows the name.
"""

from __future__ import annotations

import logging

PREFIX = "incluster: "
_NAME_FIELDS = ("%(name)", "{name}", "{name:", "{name!", "$name", "${name}")


class _NameShownOnce(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith(PREFIX) and _names_shown(record):
            record.msg = record.msg[len(PREFIX):]
        return True


def _names_shown(record: logging.LogRecord) -> bool:
    """Whether every handler that emits ``record`` prints the logger's name (False when
    none does: Python's last-resort handler prints the bare message)."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    emitting = []
    while logger is not None:
        emitting += [h for h in logger.handlers if record.levelno >= h.level]
        if not logger.propagate:
            break
        logger = logger.parent
    if not emitting:
        return False
    for handler in emitting:
        fmt = getattr(handler.formatter, "_fmt", None) or ""
        if not any(field in fmt for field in _NAME_FIELDS):
            return False
    return True


def install() -> None:
    """Once per process (idempotent)."""
    log = logging.getLogger("incluster")
    if not any(isinstance(f, _NameShownOnce) for f in log.filters):
        log.addFilter(_NameShownOnce())
