"""gymproxy's log: its level and format (`log_level`, `log_format` text or json), the worker index on
every line of `--workers N`, and the access log (`access_log`): one line per request with what finds
a slow rollout (duration, status, request id, route, upstream, session, model, tokens, outcome).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

ACCESS = logging.getLogger("gymproxy.access")
TEXT = "%(asctime)s %(levelname)s %(name)s%(worker_tag)s: %(message)s"
ACCESS_FIELDS = (
    "request_id",
    "method",
    "route",
    "status",
    "duration_ms",
    "upstream",
    "session",
    "model",
    "prompt_tokens",
    "completion_tokens",
    "outcome",
)
# The record's own attributes: everything else on it came as `extra` and goes into a JSON line.
_RECORD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "worker_tag"}


class _Worker(logging.Filter):
    """Puts the worker index on every record (`worker`, and ` [w<i>]` for the text format)."""

    def __init__(self, worker: int | None) -> None:
        super().__init__()
        self.worker = worker
        self.tag = "" if worker is None else f" [w{worker}]"

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        record.worker_tag = self.tag
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, worker, and the record's extra fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD and value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def configure(level: str = "info", fmt: str = "text", worker: int | None = None) -> None:
    """The process's log: to stderr, at `level`, as `fmt` (text or json); `worker`: its index."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Worker(worker))
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def access(fields: dict[str, Any]) -> None:
    """One request's access line; in text, `key=value` pairs (absent ones left out)."""
    text = " ".join(f"{key}={fields[key]}" for key in ACCESS_FIELDS if fields.get(key) is not None)
    ACCESS.info("%s", text, extra=fields)
