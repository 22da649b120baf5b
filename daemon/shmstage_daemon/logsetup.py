"""Logging to stderr (systemd's journal) as text lines or JSON objects, re-configurable live.

One handler on the root logger whose level and formatter a SIGHUP reload may change: a
second ``basicConfig`` would be a no-op, and adding handlers would print every line twice.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Final

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_HANDLER_NAME: Final = "shmstaged-stderr"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what log collectors parse without a custom pattern."""

    def format(self, record: logging.LogRecord) -> str:
        document = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return json.dumps(document, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """One event, one line: control characters in a message are escaped.

    Messages quote what clients sent (their names, paths, errors); a name with a newline
    must not forge a second, official-looking line in the daemon's log.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_ESCAPES)


#: C0 controls and DEL, written as Python escapes (\n, \x1b, ...).
_ESCAPES: Final = {c: repr(chr(c))[1:-1] for c in [*range(32), 127]}


def configure(level: str, fmt: str) -> None:
    """Apply ``[log] level`` and ``format``; safe to call again on reload."""
    root = logging.getLogger()
    handler = next((h for h in root.handlers if h.get_name() == _HANDLER_NAME), None)
    if handler is None:
        handler = logging.StreamHandler(sys.stderr)
        handler.set_name(_HANDLER_NAME)
        root.addHandler(handler)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root.setLevel(level.upper())
