"""One log format for every service: a JSON object per line on stderr.

Every line carries ``timestamp`` (ISO 8601, UTC), ``level``, ``service``, ``event`` and
whatever is bound in the current context, so a request id bound once where a request
enters a service appears on every line logged on its behalf::

    structlog.contextvars.bind_contextvars(request_id=request_id)
    log.info("admitted", prompt_tokens=12)
    # {"prompt_tokens": 12, "event": "admitted", "request_id": "r-1", "level": "info",
    #  "timestamp": "2026-01-01T00:00:00.000000Z", "service": "scheduler"}

Context variables follow asyncio tasks (each task starts with a copy of its creator's
context), so binding inside an RPC handler never leaks into other requests.

Records from the standard ``logging`` module (grpc, asyncio, libraries) go through the
same processors and come out in the same format.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")


class _TokenmillHandler(logging.StreamHandler):
    """Marks the root handler we installed, so reconfiguring replaces it instead of adding one."""


def _add_service(service: str) -> structlog.types.Processor:
    def add_service(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event_dict.setdefault("service", service)
        return event_dict

    return add_service


def configure_logging(service: str, level: str = "info", json: bool = True, *, stream: TextIO | None = None) -> None:
    """Configure structlog and the standard logging root for this process.

    service: name written on every line ("scheduler", "executor", ...).
    level: the least severe level written, one of LEVELS.
    json: one JSON object per line; False gives aligned human-readable lines (for a terminal).
    stream: where lines go; stderr by default (stdout stays free for program output).
    """
    level_name = level.lower()
    if level_name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}; got {level!r}")
    level_number = logging.getLevelName(level_name.upper())
    out = stream if stream is not None else sys.stderr

    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        _add_service(service),
    ]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    # JSON wants the traceback as a string field; the console renderer formats it itself.
    exception_formatting: list[structlog.types.Processor] = (
        [structlog.processors.StackInfoRenderer(), structlog.processors.format_exc_info] if json else []
    )

    structlog.configure(
        processors=[*shared, *exception_formatting, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=structlog.WriteLoggerFactory(file=out),
        # Not cached, so a later configure_logging (tests, a CLI flag parsed late) also
        # reaches module-level loggers created before it.
        cache_logger_on_first_use=False,
    )

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            *exception_formatting,
            renderer,
        ],
    )
    handler = _TokenmillHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _TokenmillHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_number)
