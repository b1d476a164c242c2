"""configure_logging: one JSON object per line with service, level, timestamp and context."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from collections.abc import Iterator

import pytest
import structlog

from services.common.logging import configure_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    yield out
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if type(handler).__name__ == "_TokenmillHandler":
            root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_line_has_service_level_timestamp_and_context(stream: io.StringIO) -> None:
    configure_logging("scheduler", stream=stream)
    structlog.contextvars.bind_contextvars(request_id="req-1")
    structlog.get_logger().info("admitted", prompt_tokens=12)
    [entry] = lines(stream)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", entry.pop("timestamp"))
    assert entry == {"event": "admitted", "prompt_tokens": 12, "request_id": "req-1", "level": "info", "service": "scheduler"}


def test_level_filters_structlog_and_stdlib(stream: io.StringIO) -> None:
    configure_logging("executor", level="warning", stream=stream)
    log = structlog.get_logger()
    log.info("dropped")
    log.warning("kept")
    logging.getLogger("grpc").info("dropped too")
    logging.getLogger("grpc").error("kept %s", "too")
    assert [(e["event"], e["level"]) for e in lines(stream)] == [("kept", "warning"), ("kept too", "error")]


def test_stdlib_records_share_the_format(stream: io.StringIO) -> None:
    configure_logging("tokenizer", stream=stream)
    structlog.contextvars.bind_contextvars(request_id="req-9")
    logging.getLogger("asyncio").warning("slow callback %dms", 120)
    [entry] = lines(stream)
    assert {k: entry[k] for k in ("event", "logger", "level", "service", "request_id")} == {
        "event": "slow callback 120ms",
        "logger": "asyncio",
        "level": "warning",
        "service": "tokenizer",
        "request_id": "req-9",
    }


def test_exception_is_one_line_with_traceback(stream: io.StringIO) -> None:
    configure_logging("scheduler", stream=stream)
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        structlog.get_logger().exception("step_failed")
    assert stream.getvalue().count("\n") == 1
    [entry] = lines(stream)
    assert entry["level"] == "error"
    assert entry["exception"].startswith("Traceback (most recent call last):")
    assert entry["exception"].endswith("RuntimeError: kaput")


async def test_context_is_per_task(stream: io.StringIO) -> None:
    configure_logging("scheduler", stream=stream)
    log = structlog.get_logger()

    async def handle(request_id: str) -> None:
        structlog.contextvars.bind_contextvars(request_id=request_id)
        await asyncio.sleep(0)
        log.info("done")

    await asyncio.gather(handle("a"), handle("b"))
    log.info("outside")
    assert [(e["event"], e.get("request_id")) for e in lines(stream)] == [("done", "a"), ("done", "b"), ("outside", None)]


def test_reconfiguring_replaces_the_root_handler(stream: io.StringIO) -> None:
    configure_logging("a", stream=stream)
    configure_logging("b", stream=stream)
    logging.getLogger("x").warning("once")
    assert [e["service"] for e in lines(stream)] == ["b"]


def test_console_format_and_bad_level(stream: io.StringIO) -> None:
    configure_logging("drafter", json=False, stream=stream)
    structlog.get_logger().info("hello", k=1)
    assert re.search(r"\[info\s*\] hello\s+k=1 service=drafter", stream.getvalue())
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error, critical; got 'verbose'"):
        configure_logging("drafter", level="verbose", stream=stream)
