"""One logging setup for the ``ftmesh`` command and for ``ftmesh.connect()``.

Theory of operation: ftmesh logs through the standard ``logging`` module under the
``ftmesh`` logger hierarchy (``ftmesh.node``, ``ftmesh.torch``, ...) and never configures the
root logger, so a training script's own logging setup is left alone. :func:`configure`
gives the ``ftmesh`` logger one handler on stderr, in ``text`` (for people) or ``json`` (one
object per line, for log collectors: ``time``, ``level``, ``logger``, ``message``, and
``exc`` when there is a traceback), and a level. The CLI calls it from ``--log-level`` /
``--log-format`` (``-v``), and hands the same settings to the scripts it starts through
``FTMESH_LOG_LEVEL`` / ``FTMESH_LOG_FORMAT``, which ``connect()`` applies; called again, it
replaces its own handler instead of adding a second one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from .errors import ConfigError

if TYPE_CHECKING:
    from .membership.messages import MemberSnapshot

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"

_HANDLER_NAME = "ftmesh"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"), default=str)


def parse_level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    if level.lower() not in LOG_LEVELS:
        raise ConfigError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {level!r}")
    return int(getattr(logging, level.upper()))


def configure(
    level: str | int = "warning", fmt: str = "text", stream: TextIO | None = None
) -> logging.Logger:
    """Send the ``ftmesh`` loggers' records at ``level`` and above to ``stream`` (stderr) in
    ``fmt``; see the module docstring. Returns the ``ftmesh`` logger."""
    if fmt not in LOG_FORMATS:
        raise ConfigError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    logger = logging.getLogger("ftmesh")
    for h in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(h)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(parse_level(level))
    logger.propagate = False  # ours go to our handler once, not also to the root's
    return logger


def event_record(kind: str, m: MemberSnapshot) -> dict[str, Any]:
    """One membership event as the JSON record ``ftmesh node --events json`` prints and the
    lab's workers emit: ``kind`` (``"alive"``, ``"dead"``, ``"self"``...) and the member."""
    return {
        "event": kind,
        "node": m.node,
        "name": m.name,
        "addr": f"{m.addr[0]}:{m.addr[1]}",
        "incarnation": m.incarnation,
        "meta": m.meta,
        "time": round(time.time(), 6),
    }
