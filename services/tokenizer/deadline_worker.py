"""Work that must not hang the tokenizer: run on a thread of its own, each call under a deadline.

A chat template ships with the model, so it is code from a download: a template looping over
``range(100000)`` twice renders nothing for hours. Rendering therefore never runs on the event
loop (which also serves every scheduler's Detokenize stream), and a call still running at its
deadline is interrupted: the worker thread gets an exception raised into it (CPython's
PyThreadState_SetAsyncExc), which a template's Python-level loop meets within its next few
bytecodes. The caller hears DEADLINE_EXCEEDED at the deadline either way. C code does not see
the exception until it returns, so what runs here must bound its C calls (the template sandbox
bounds ranges and string products; encoding is bounded by the input limits).

One worker thread, calls in arrival order. The deadline counts from submission: a call queued
behind a slow one is skipped if its time ran out before it started.
"""

from __future__ import annotations

import asyncio
import ctypes
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from services.common.errors import DeadlineExceededError

_log = structlog.get_logger("tokenmill.tokenizer")

T = TypeVar("T")


class Interrupted(BaseException):
    """Raised into the worker thread at a call's deadline (BaseException: code under it that
    catches Exception, as template code does, does not swallow it)."""


class _Call:
    __slots__ = ("work", "future", "loop", "running")

    def __init__(self, work: Callable[[], Any], future: asyncio.Future, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.future = future
        self.loop = loop
        self.running = False


class DeadlineWorker:
    def __init__(self, name: str, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        """Held while a call starts or ends, and while one is interrupted: an interruption
        never lands outside the call it was meant for."""
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self.interrupted = 0

    async def run(self, work: Callable[[], T], what: str) -> T:
        """``work()`` on the worker thread; DeadlineExceededError naming ``what`` once it has
        run for timeout_s (it is interrupted then)."""
        loop = asyncio.get_running_loop()
        call = _Call(work, loop.create_future(), loop)
        self._calls.put(call)
        try:
            return await asyncio.wait_for(asyncio.shield(call.future), self.timeout_s)
        except asyncio.TimeoutError:
            self._interrupt(call)
            raise DeadlineExceededError(f"{what} took longer than {self.timeout_s:g} s") from None
        except asyncio.CancelledError:
            self._interrupt(call)  # the caller went away: its result is not needed
            raise

    def _interrupt(self, call: _Call) -> None:
        with self._lock:
            if not call.running:
                call.work = None  # not started yet: it is skipped
                return
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident),
                                                      ctypes.py_object(Interrupted))
            self.interrupted += 1
        _log.warning("deadline_interrupted", worker=self._thread.name, timeout_s=self.timeout_s)

    def close(self) -> None:
        self._calls.put(None)

    def _serve(self) -> None:
        while True:
            try:
                call = self._calls.get()
                if call is None:
                    return
                self._run(call)
            except Interrupted:
                continue  # meant for a call that ended just before: nothing to undo

    def _run(self, call: _Call) -> None:
        result: Any = None
        error: BaseException | None = None
        try:
            with self._lock:
                if call.work is None:
                    return
                call.running = True
            try:
                result = call.work()
            finally:
                with self._lock:
                    call.running = False
        except Interrupted:
            error = DeadlineExceededError("interrupted at its deadline")
        except Exception as exc:  # noqa: BLE001 - handed to the caller, as run_in_executor does
            error = exc
        try:
            call.loop.call_soon_threadsafe(_settle, call.future, result, error)
        except RuntimeError:
            pass  # the loop closed (the service stopped): nobody waits for it


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
